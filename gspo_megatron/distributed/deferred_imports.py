"""Packages that Megatron-Core imports at its own import but a run may never use, loaded on use.

``megatron/core/inference/contexts/dynamic_context.py`` and ``megatron/core/timers.py`` run
``try: import wandb`` when Megatron is imported, for inference engines and timer writers that
the trainer and the checkpoint tools never use: ~0.3-0.4 CPU-seconds of every process that
imports Megatron (0.41 s of 4.4 s of imports measured here), whether or not its run logs to
wandb. :func:`defer_import` puts a stand-in module in ``sys.modules`` that executes the real
module, in place, on the first attribute it does not have: ``wandb.init`` of a run that logs
(``trainer/metrics_log.py``) loads it then, and every holder of the name sees the real module
(the stand-in becomes it, as ``importlib.util.LazyLoader``'s modules do). Unlike LazyLoader's,
the stand-in answers ``__file__``, ``__spec__``, ``__path__`` without loading: ``inspect``
walks ``sys.modules`` asking them (torch does so at import, which would load everything).
"""

from __future__ import annotations

import importlib.util
import sys
import types


class DeferredModule(types.ModuleType):
    """A module whose code runs on the first access to an attribute it does not have yet."""

    def __getattr__(self, attr: str):
        self.__class__ = types.ModuleType  # from here on a plain module, being filled
        try:
            self.__spec__.loader.exec_module(self)
        except BaseException:
            sys.modules.pop(self.__name__, None)  # as a failed import: the next one starts over
            raise
        return getattr(self, attr)


def defer_import(name: str) -> bool:
    """Make ``import name`` cheap until the module is used; False if it is already imported
    (or not installed), so nothing changes."""
    if name in sys.modules:
        return False
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return False
    module = DeferredModule(name)
    module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
    module.__package__ = name.rpartition(".")[0]
    if spec.submodule_search_locations is not None:  # a package
        module.__package__, module.__path__ = name, list(spec.submodule_search_locations)
    sys.modules[name] = module
    return True


def megatron_imports_wandb() -> bool:
    """True while importing Megatron-Core loads wandb (run in a fresh interpreter: the
    ``deferred_wandb`` patch's probe in ``cpu_compat``)."""
    import megatron.core  # noqa: F401

    module = sys.modules.get("wandb")
    return module is not None and not isinstance(module, DeferredModule)
