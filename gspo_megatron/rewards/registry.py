"""Registry of reward functions, looked up by name.

A reward function has the signature ``fn(response: str, answer: str, metadata: Mapping | None)
-> float`` and returns a value in [0, 1] (GSPO's advantage assumes bounded rewards). Built-in
rewards register themselves with ``@register_reward("name")`` in ``builtin.py``, which the
package's ``__init__`` imports, so they are registered whenever this module is; a user function
is named ``"package.module:function"`` and is imported on first use, so a run can plug in its
own verifier without touching this package.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Mapping, Optional

RewardFn = Callable[[str, str, Optional[Mapping]], float]

_REGISTRY: Dict[str, RewardFn] = {}


class RewardLookupError(ValueError):
    """An unknown reward name or an unimportable ``module:function``."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as ``get_reward_fn(name)``."""

    def decorator(fn: RewardFn) -> RewardFn:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"reward '{name}' is already registered by "
                             f"{existing.__module__}.{existing.__qualname__}")
        _REGISTRY[name] = fn
        return fn

    return decorator


def registered_rewards() -> list:
    """Sorted names of all registered rewards."""
    return sorted(_REGISTRY)


def _import_user_fn(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardLookupError(f"reward '{spec}': expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardLookupError(f"reward '{spec}': cannot import module '{module_name}': {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise RewardLookupError(f"reward '{spec}': module '{module_name}' has no callable '{attr}'")
    return fn


def get_reward_fn(name: str) -> RewardFn:
    """The registered reward ``name``, or the user function ``module:function``."""
    if ":" in name:
        return _import_user_fn(name)
    if name not in _REGISTRY:
        raise RewardLookupError(f"unknown reward '{name}'; registered rewards: "
                                f"{', '.join(registered_rewards())} (or give 'module:function')")
    return _REGISTRY[name]
