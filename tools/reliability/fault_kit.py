"""The faults' common kit: the registry (:func:`fault`) and what every fault needs: the
uninterrupted reference run, running and spawning the tiny trainer, and the checks (same metrics
and weights as the reference, no traceback, checkpoint complete).
"""

from __future__ import annotations

import functools
import importlib
import shutil
import signal
import time
from pathlib import Path
from typing import Callable, List, Optional

from tools.reliability import harness
from tools.reliability.harness import Result, Workspace

FAULTS: List[Callable[[Workspace], Result]] = []
BYPASS_SPACE_CHECK = ("import gspo_megatron.learner.checkpoint_write as w, "
                      "gspo_megatron.checkpoint.export as e\n"
                      "w.check_free_space = e.check_free_space = lambda *a, **k: None")
"""Injected before ``main`` to let a write run into a full disk (the check would stop it)."""


def all_faults() -> List[Callable[[Workspace], Result]]:
    """Every registered fault, in the order of the table (imports the fault modules)."""
    modules = ["tools.reliability.faults", "tools.reliability.disk_faults"]
    for name in modules:
        importlib.import_module(name)  # importing registers its faults
    return sorted(FAULTS, key=lambda f: modules.index(f.__module__))


def fault(name: str, how: str):
    """Register ``fn(ws, d) -> (exit codes, observed line, problem or None)`` as a fault; it runs
    in a fresh directory ``d`` and becomes one :class:`Result` (``how`` says what it does)."""
    def register(fn):
        @functools.wraps(fn)
        def wrapped(ws: Workspace) -> Result:
            start = time.monotonic()
            d = ws.fresh_dir(name)
            try:
                codes, line, problem = fn(ws, d)
            except Exception as exc:  # a broken fault must show up in the table, not vanish
                codes, line, problem = "-", "", f"fault script failed: {exc!r}"
            return Result("fault", name, how, codes, line, ok=not problem,
                          verdict=problem or "handled", seconds=time.monotonic() - start)
        wrapped.name = name
        FAULTS.append(wrapped)
        return wrapped
    return register


def reference(ws: Workspace) -> Path:
    """An uninterrupted run with the standard overrides (made once)."""
    ref = ws.root / "reference" / "run"
    with harness.BUILD_ONCE:  # faults run in threads; one of them makes it
        if (ref / "hf_export").is_dir():
            return ref
        shutil.rmtree(ref.parent, ignore_errors=True)
        ref.parent.mkdir(parents=True)
        code = harness.run(harness.train_command(ws.overrides(ref)), ref.parent / "train.log")
        if code != 0:
            raise RuntimeError(f"reference run failed ({code}); see {ref.parent}/train.log")
        return ref


def copy_of_reference(ws: Workspace, d: Path) -> Path:
    run_dir = d / "run"
    shutil.copytree(reference(ws), run_dir)
    return run_dir


def same_as_reference(ws: Workspace, run_dir: Path) -> Optional[str]:
    """None when metrics and exported weights equal the uninterrupted run's, else why not."""
    ref = reference(ws)
    if harness.metrics_steps(run_dir) != harness.metrics_steps(ref):
        return f"metrics steps {harness.metrics_steps(run_dir)} != {harness.metrics_steps(ref)}"
    if harness.comparable_metrics(run_dir) != harness.comparable_metrics(ref):
        return "metrics differ from the uninterrupted run"
    for f in sorted((ref / "hf_export").glob("*.safetensors")):
        other = run_dir / "hf_export" / f.name
        if not other.is_file() or other.read_bytes() != f.read_bytes():
            return f"exported {f.name} differs from the uninterrupted run"
    return None


def train(ws: Workspace, d: Path, run_dir: Path, *extra: str, flags=(), log="train.log",
          env=None) -> int:
    return harness.run(harness.train_command(ws.overrides(run_dir, *extra), *flags), d / log,
                       env=env)


def spawn_train(ws: Workspace, d: Path, run_dir: Path, *extra: str, log="train.log", env=None):
    return harness.spawn(harness.train_command(ws.overrides(run_dir, *extra)), d / log, env)


def complete(run_dir: Path, step: int) -> bool:
    return (run_dir / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()


def first_problem(*checks) -> Optional[str]:
    return next((msg for ok, msg in checks if not ok), None)


def no_traceback(d: Path) -> tuple:
    logs = [p.name for p in d.glob("*.log") if harness.has_traceback(p)]
    return not logs, f"Python traceback in {', '.join(logs)}"


def killed_then_resumed(ws: Workspace, d: Path, ready: Callable[[Path], bool], sig=signal.SIGKILL,
                        expect_code=None, extra=(), line_pattern="resuming from|resumed from"):
    run_dir = d / "run"
    proc = spawn_train(ws, d, run_dir, *extra)
    if not harness.wait_until(lambda: ready(run_dir), proc, poll_s=0.01):
        return "-", "", f"the fault point was never reached (exit {proc.poll()})"
    proc.send_signal(sig)
    first = proc.wait(timeout=300)
    second = train(ws, d, run_dir, *extra, log="rerun.log")
    problem = first_problem(
        (expect_code is None or first == expect_code, f"first run exited {first}, expected {expect_code}"),
        (second == 0, f"rerun exited {second}"), no_traceback(d))
    problem = problem or same_as_reference(ws, run_dir)
    line = harness.find_line(d / "rerun.log", line_pattern) or harness.find_line(d / "train.log", line_pattern)
    return f"{first} then {second}", line, problem
