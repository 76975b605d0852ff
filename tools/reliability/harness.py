"""Run gspo-train / gspo-convert / gspo-export as a user would, and judge what came back.

Bad inputs run in this process (``main(argv)`` of the CLI, its ERROR log lines and stderr
captured), which costs one start-up for all of them; faults run the trainer as a subprocess
(``python -m gspo_megatron.cli.train``) so that it can be killed, signalled, raced or given a
small file system (a tmpfs in a private mount namespace: ``unshare -rm``).

A result is one row of ``docs/reliability.md``: the observed error line, the exit code(s) and a
verdict. ``ok`` means: the expected exit code, a message that names the key, file or path, no
Python traceback, nothing written where nothing should be, and no lost data.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
BUILD_ONCE = threading.RLock()
"""Held while a shared artefact (reference run, converted checkpoint) is made."""
TINY_CONFIG = REPO / "configs" / "tiny_cpu.yaml"
TRACEBACK = "Traceback (most recent call last)"


@dataclass
class Result:
    """One row of the table."""

    kind: str
    """``bad input`` or ``fault``."""
    name: str
    how: str
    """What was done (overrides, arguments or the fault's steps)."""
    exit_codes: str
    line: str
    """The observed error (or key log) line."""
    ok: bool
    verdict: str
    seconds: float = 0.0


@dataclass
class Workspace:
    """Tiny assets and a scratch directory shared by every case."""

    root: Path
    model_dir: Path = field(init=False)
    train_path: Path = field(init=False)
    eval_path: Path = field(init=False)
    _counter: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        from gspo_megatron.tiny_task.assets import make_tiny_assets
        from gspo_megatron.tiny_task.task import AdditionTaskConfig

        self.root.mkdir(parents=True, exist_ok=True)
        assets = self.root / "assets"
        if not (assets / "model" / "config.json").is_file():
            make_tiny_assets(assets, task=AdditionTaskConfig(num_train=200, num_eval=16))
        self.model_dir = assets / "model"
        self.train_path = assets / "data" / "train.jsonl"
        self.eval_path = assets / "data" / "eval.jsonl"

    def converted_checkpoint(self) -> Path:
        """The tiny model converted once with gspo-convert (a complete checkpoint)."""
        with BUILD_ONCE:  # faults run in threads
            return self._convert()

    def _convert(self) -> Path:
        out = self.root / "converted"
        if not out.exists():
            code = run([sys.executable, "-m", "gspo_megatron.cli.convert", "--hf-dir",
                        str(self.model_dir), "--out", str(out)], self.root / "convert.log")
            if code != 0:
                raise RuntimeError(f"gspo-convert of the tiny model failed; see {self.root}/convert.log")
        return out

    def finished_run(self, d: Path, changed_data: bool = False) -> Path:
        """A finished tiny run in ``d/run``; with ``changed_data`` its train file ``d/t.jsonl``
        loses its last 10 rows afterwards (the prompts a resume would find changed)."""
        extra = []
        if changed_data:
            rows = self.train_path.read_text().splitlines(keepends=True)
            (d / "t.jsonl").write_text("".join(rows))
            extra = [f"data.train_path={d / 't.jsonl'}"]
        code = run(train_command(self.overrides(d / "run", "trainer.num_steps=1", *extra)),
                   d / "setup.log")
        if code != 0:
            raise RuntimeError(f"setup run failed; see {d}/setup.log")
        if changed_data:
            (d / "t.jsonl").write_text("".join(rows[:-10]))
        return d / "run"

    def fresh_dir(self, name: str) -> Path:
        slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")[:40]
        path = self.root / f"{next(self._counter):03d}_{slug}"  # count(): safe across threads
        path.mkdir(parents=True)
        return path

    def overrides(self, run_dir: Path, *extra: str) -> List[str]:
        """A small, deterministic tiny run (about 10 s), then ``extra``."""
        return [f"model.hf_path={self.model_dir}", f"data.train_path={self.train_path}",
                "data.eval_path=null", f"logging.run_dir={run_dir}", "logging.wandb.enabled=false",
                "logging.plot=false", "batch.num_prompts_per_step=4",
                "rollout.n_samples_per_prompt=4", "batch.num_mini_batches=2",
                "trainer.num_sft_steps=2", "trainer.sft_batch_size=8",
                "trainer.eval_every_steps=0", "trainer.num_steps=4",
                "checkpoint.save_every_steps=1", *extra]


# ---- in-process CLI calls (bad inputs) ------------------------------------------------------

class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@dataclass
class CliCall:
    code: object
    """Exit code, or ``"traceback"`` when an exception escaped ``main``."""
    line: str
    traceback: str = ""


def call_cli(main: Callable[[Sequence[str]], int], argv: Sequence[str]) -> CliCall:
    """``main(argv)`` with its ERROR records and stderr captured (argparse errors included)."""
    handler = _Errors()
    root = logging.getLogger()
    root.addHandler(handler)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse: usage error
                code = exc.code
            except BaseException:  # noqa: BLE001 - exactly what the table must catch
                return CliCall("traceback", traceback.format_exc().strip().splitlines()[-1],
                               traceback.format_exc())
    finally:
        root.removeHandler(handler)
    errors = [m for m in handler.messages if m.strip()]
    if errors:
        line = " ".join(errors[-1].split())
    else:
        lines = [ln for ln in stderr.getvalue().splitlines() if ln.strip()]
        line = lines[-1] if lines else ""
    return CliCall(code, line)


def snapshot(path: Path) -> Dict[str, int]:
    """Every file under ``path`` with its size (to see what a failed start wrote)."""
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}


# ---- subprocess runs (faults) ----------------------------------------------------------------

def python_env() -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def train_command(overrides: Sequence[str], *flags: str, inject: str = "") -> List[str]:
    """``python -m gspo_megatron.cli.train``, or with ``inject`` run before ``main`` (faults)."""
    if not inject:
        return [sys.executable, "-m", "gspo_megatron.cli.train", str(TINY_CONFIG), *overrides,
                *flags]
    code = f"{inject}\nimport sys\nfrom gspo_megatron.cli.train import main\nsys.exit(main())"
    return [sys.executable, "-c", code, str(TINY_CONFIG), *overrides, *flags]


def spawn(command: Sequence[str], log_path: Path, env: Optional[dict] = None) -> subprocess.Popen:
    out = open(log_path, "ab")
    try:
        return subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT,
                                env=env or python_env())
    finally:
        out.close()


def run(command: Sequence[str], log_path: Path, timeout_s: float = 600,
        env: Optional[dict] = None) -> int:
    proc = spawn(command, log_path, env)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -9


def wait_until(condition: Callable[[], bool], proc: subprocess.Popen, timeout_s: float = 300,
               poll_s: float = 0.05) -> bool:
    """True once ``condition()`` holds; False if ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return condition()
        time.sleep(poll_s)
    return False


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (``SigCgt`` in
    ``/proc/<pid>/status``, a hex mask with bit ``sig - 1``); False once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")),
                "0")
    return bool(int(mask, 16) >> (sig - 1) & 1)


def log_lines(path: Path) -> List[str]:
    text = path.read_text(errors="replace") if path.exists() else ""
    return [line.rstrip() for line in text.replace("\r", "\n").splitlines()]


def find_line(path: Path, pattern: str) -> str:
    """The first log line matching ``pattern``, without its time/rank prefix ('' if none)."""
    regex = re.compile(pattern)
    for line in log_lines(path):
        if regex.search(line):
            return re.sub(r"^\d\d:\d\d:\d\d \[rank\d+\] ", "", line)
    return ""


def has_traceback(path: Path) -> bool:
    return any(TRACEBACK in line for line in log_lines(path))


def metrics_steps(run_dir: Path) -> List[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def comparable_metrics(run_dir: Path) -> List[dict]:
    """Metrics without timings, peak memory and the saves' numbers (which differ between any two
    runs: a resumed run did not make the save of its checkpoint)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items()
             if not k.startswith(("time/", "memory/", "checkpoint/")) and "per_s" not in k
             and not k.endswith("_s")} for r in rows]


def in_tmpfs(size: str, mount_dir: Path, script: str, timeout_s: float = 900) -> str:
    """Run the shell ``script`` in a private mount namespace with a tmpfs of ``size`` at
    ``mount_dir`` (gone when the script ends); returns its output. ``$MNT`` is the mount."""
    mount_dir.mkdir(parents=True, exist_ok=True)
    body = (f"set -u\nmount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mount_dir))}\n"
            f"MNT={shlex.quote(str(mount_dir))}\n{script}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", body], capture_output=True, text=True,
                          timeout=timeout_s, env=python_env())
    return proc.stdout + proc.stderr


def shell(command: Sequence[str]) -> str:
    return " ".join(shlex.quote(c) for c in command)
