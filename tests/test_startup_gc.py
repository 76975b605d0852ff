"""The collector pause around start-up: off inside, one collection and a freeze after, back on
only if it was on (run in a fresh interpreter: a freeze in the test process would outlive it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip()


def test_collector_is_paused_then_frozen_start_up_objects_and_back_on():
    out = _run("""
        import gc
        from gspo_megatron.distributed.startup_gc import collector_paused_for_start_up
        frozen_before = gc.get_freeze_count()
        with collector_paused_for_start_up():
            inside = gc.isenabled()
            kept = [[i] for i in range(5000)]          # long-lived start-up objects
            cycle = []; cycle.append(cycle); del cycle  # start-up garbage
        print(inside, gc.isenabled(), gc.get_freeze_count() - frozen_before >= 5000,
              gc.collect() == 0)
    """)
    assert out == "False True True True"


def test_a_failing_start_up_still_restores_and_a_disabled_collector_stays_off():
    out = _run("""
        import gc
        from gspo_megatron.distributed.startup_gc import collector_paused_for_start_up
        try:
            with collector_paused_for_start_up():
                raise ValueError("start-up failed")
        except ValueError:
            pass
        after_failure = gc.isenabled()
        gc.disable()
        with collector_paused_for_start_up():
            pass
        print(after_failure, gc.isenabled())
    """)
    assert out == "True False"


def test_thawing_after_the_run_lets_its_start_up_cycles_be_collected():
    """Frozen objects are never collected: a model built during start-up (cycles, gloo groups)
    would outlive its run in a process that runs again; ``thaw_start_up`` gives it back."""
    out = _run("""
        import gc, weakref
        from gspo_megatron.distributed.startup_gc import collector_paused_for_start_up, thaw_start_up

        class Model:
            pass

        with collector_paused_for_start_up():
            model = Model()
            model.self = model                         # a cycle, as a model's modules make
            alive = weakref.ref(model)
        del model
        gc.collect()
        frozen_kept_it = alive() is not None
        thaw_start_up()
        print(frozen_kept_it, alive() is None, gc.get_freeze_count())
    """)
    assert out == "True True 0"
