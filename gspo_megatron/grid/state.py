"""Where each point of a grid stands: pending, running, preempted and requeued, done, or failed
with its exit code and last error line; ``missing`` when nothing ran and nothing is queued.

Two sources, the scheduler's first: ``scontrol show job -o`` for every array job of the grid
(pending tasks appear as ranges), then ``sacct`` for tasks scontrol has forgotten; then the
point's run directory, whose ``logs/<array job>_<task>/batch.log`` ends with the job script's
own verdict (``slurm/lib.sh``: ``job done``, ``FAILED (exit code N): ...``, ``requeueing job``).
Without Slurm (a grid copied off the cluster) the run directory alone decides.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

ACTIVE = {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "RESIZING"}
FAILED = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
          "PREEMPTED"}
VERDICT_RE = re.compile(r"\] (job done|FAILED \(exit code (\d+)\): (.*)|.*; requeueing job .*)$")


@dataclass
class SlurmTask:
    state: str
    exit_code: Optional[int] = None
    restarts: int = 0


@dataclass
class PointState:
    """One point's state and, when it failed, why."""

    state: str
    """pending, running, requeued, done, failed or missing."""
    exit_code: Optional[int] = None
    error: str = ""
    slurm_id: Optional[str] = None
    slurm_state: Optional[str] = None


def _task_ids(text: str) -> List[int]:
    """``3``, ``2-3``, ``[0-3%1]``, ``1,4`` -> task indices."""
    text = text.strip("[]").split("%", 1)[0]
    out: List[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _exit_code(text: str) -> Optional[int]:
    """Slurm's ``code:signal``: the code, or 128 + the signal when a signal ended it."""
    code, _, signal = (text or "").partition(":")
    if not code.isdigit():
        return None
    return int(code) if int(code) or not signal.isdigit() or not int(signal) else 128 + int(signal)


def _run(cmd: List[str]) -> Optional[str]:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def scheduler_tasks(array_ids: Iterable[str]) -> Dict[str, SlurmTask]:
    """``"<array id>_<task>" -> SlurmTask`` for what Slurm still knows ({} without Slurm)."""
    tasks: Dict[str, SlurmTask] = {}
    for array_id in array_ids:
        out = _run(["scontrol", "show", "job", "-o", array_id])
        for line in (out or "").splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if fields.get("ArrayJobId") != array_id or "ArrayTaskId" not in fields:
                continue
            for index in _task_ids(fields["ArrayTaskId"]):
                tasks[f"{array_id}_{index}"] = SlurmTask(fields.get("JobState", "UNKNOWN"),
                                                         _exit_code(fields.get("ExitCode", "")),
                                                         int(fields.get("Restarts", "0") or 0))
        if out:
            continue
        out = _run(["sacct", "-j", array_id, "-n", "-P", "-X", "-o", "JobID,State,ExitCode"])
        for line in (out or "").splitlines():
            job, _, rest = line.partition("|")
            state, _, code = rest.partition("|")
            base, _, task = job.partition("_")
            if base == array_id and task:
                for index in _task_ids(task):
                    tasks[f"{array_id}_{index}"] = SlurmTask(state.split()[0] if state else "UNKNOWN",
                                                             _exit_code(code))
    return tasks


def batch_log(run_dir: Path, slurm_id: Optional[str]) -> Optional[Path]:
    """The job script's log of ``slurm_id`` in ``run_dir``, else the newest one there."""
    if slurm_id and (run_dir / "logs" / slurm_id / "batch.log").is_file():
        return run_dir / "logs" / slurm_id / "batch.log"
    logs = sorted((run_dir / "logs").glob("*/batch.log"), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


def log_verdict(log: Optional[Path]) -> Tuple[Optional[str], Optional[int], str]:
    """(``done`` / ``failed`` / ``requeued`` / None, exit code, error line) from a batch log."""
    if log is None:
        return None, None, ""
    lines = [line.rstrip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        match = VERDICT_RE.search(lines[i])
        if not match:
            continue
        if match.group(1) == "job done":
            return "done", 0, ""
        if match.group(2) is not None:
            after = [line for line in lines[i + 1:] if "error" in line.lower() or "[rank" in line]
            error = match.group(3) + (f" | {after[-1].strip()}" if after else "")
            return "failed", int(match.group(2)), error
        return "requeued", None, ""
    return None, None, lines[-1] if lines else ""


def point_state(run_dir: Path, slurm_id: Optional[str], task: Optional[SlurmTask],
                slurm_known: bool) -> PointState:
    """Combine the scheduler's view of the point's latest task with its run directory's."""
    verdict, code, error = log_verdict(batch_log(run_dir, slurm_id))
    out = PointState("missing", slurm_id=slurm_id, slurm_state=task.state if task else None)
    if task is not None:
        if task.state == "PENDING":
            out.state = "requeued" if task.restarts or verdict == "requeued" else "pending"
        elif task.state == "REQUEUED" or (task.state in ACTIVE and verdict == "requeued" and task.restarts):
            out.state = "requeued"
        elif task.state in ACTIVE:
            out.state = "running"
        elif task.state == "COMPLETED" and verdict != "failed":
            out.state, out.exit_code = "done", 0
        else:
            out.state, out.exit_code = "failed", code if code is not None else task.exit_code
            out.error = error or f"Slurm state {task.state}"
        return out
    if verdict == "done":
        out.state, out.exit_code = "done", 0
    elif verdict == "failed":
        out.state, out.exit_code, out.error = "failed", code, error
    elif verdict == "requeued":
        out.state = "requeued"
    elif (run_dir / "metrics.jsonl").is_file():
        if slurm_known:  # the scheduler has forgotten a task that left no verdict
            out.state, out.error = "failed", error or "no verdict in its batch log"
        else:
            out.state = "running"  # no scheduler to ask; its log has no verdict yet
    return out
