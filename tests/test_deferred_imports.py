"""gspo_megatron/distributed/deferred_imports.py: a deferred module costs nothing until used,
then is the real module for every holder of the name; inspecting ``sys.modules`` does not load
it; a module that fails to load leaves no half-filled entry. Each case runs in a fresh
interpreter (what is imported there is the point)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from gspo_megatron.distributed.deferred_imports import defer_import


def _run(code: str, cwd=None) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stdout + out.stderr


def test_wandb_loads_on_first_use_and_is_then_the_real_module():
    _run("""
        import inspect, sys, types
        from gspo_megatron.distributed.deferred_imports import DeferredModule, defer_import
        assert defer_import("wandb") and not defer_import("wandb")  # once
        held = sys.modules["wandb"]
        import megatron.core  # its `try: import wandb` takes the stand-in
        assert isinstance(sys.modules["wandb"], DeferredModule) and "wandb.sdk" not in sys.modules
        inspect.getframeinfo(sys._getframe())  # walks sys.modules asking __file__: no load
        assert held.__file__.endswith("wandb/__init__.py") and held.__path__
        import wandb
        assert wandb is held and isinstance(wandb.__version__, str)  # loaded here
        assert type(wandb) is types.ModuleType and "wandb.sdk" in sys.modules
        assert sys.modules["wandb"] is held and callable(held.init) and callable(wandb.teardown)
    """)


def test_a_module_that_fails_to_load_is_not_left_half_imported(tmp_path):
    (tmp_path / "broken.py").write_text("VALUE = 1\nraise RuntimeError('cannot load')\n")
    _run("""
        import sys
        from gspo_megatron.distributed.deferred_imports import defer_import
        assert defer_import("broken")
        import broken
        try:
            broken.VALUE
        except RuntimeError as exc:
            assert "cannot load" in str(exc)
        else:
            raise AssertionError("loaded")
        assert "broken" not in sys.modules  # the next import starts over, as after a failed one
    """, cwd=tmp_path)


def test_nothing_changes_for_a_module_already_imported_or_missing():
    assert not defer_import("json")  # imported: left as it is
    assert not defer_import("no_such_module_anywhere")
    assert "no_such_module_anywhere" not in sys.modules
