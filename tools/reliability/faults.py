"""The faults: kills, signals, two jobs, damaged checkpoints and torn files.

Each fault runs the tiny trainer (``Workspace.overrides``: 2 SFT + 4 RL steps, a checkpoint
every step) as a subprocess, does its damage, reruns when the fault calls for it, and checks the
outcome a user needs: the exit code, a line that says what happened, and no lost or mixed data
(a resumed run must end with exactly the metrics and exported weights of an uninterrupted one).
Every function returns one :class:`harness.Result`; full disks are in ``disk_faults.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Callable, List

from tools.reliability import harness
from tools.reliability.fault_kit import (complete, copy_of_reference, fault, first_problem,
                                         killed_then_resumed, no_traceback, same_as_reference,
                                         spawn_train, train)

# ---- kills and signals --------------------------------------------------------------------------

@fault("SIGKILL after a checkpoint, rerun", "kill -9 once step_000002 is complete; rerun")
def sigkill_mid_run(ws, d):
    return killed_then_resumed(ws, d, lambda r: complete(r, 2))


@fault("SIGKILL during a checkpoint write", "keep_last=1; kill -9 while step_000003.partial is being "
       "written; rerun")
def sigkill_during_checkpoint(ws, d):
    return killed_then_resumed(ws, d, lambda r: (r / "checkpoints" / "step_000003.partial").exists(),
                               extra=("checkpoint.keep_last=1",),
                               line_pattern="left over by an interrupted write|resuming from")


@fault("SIGKILL before the first checkpoint", "save_every_steps=3; kill -9 once metrics.jsonl has "
       "step 2; rerun (fresh start, no duplicate steps)")
def sigkill_before_first_checkpoint(ws, d):
    return killed_then_resumed(ws, d, lambda r: 2 in harness.metrics_steps(r),
                               extra=("checkpoint.save_every_steps=3",),
                               line_pattern="dropped \\d+ rows past a fresh start")


@fault("SIGUSR1 (Slurm time limit) mid-run", "kill -USR1 once metrics.jsonl has step 2; rerun")
def sigusr1_mid_run(ws, d):
    return killed_then_resumed(ws, d, lambda r: 2 in harness.metrics_steps(r), sig=signal.SIGUSR1,
                               expect_code=124, line_pattern="exiting 124 for requeue")


@fault("SIGTERM (Slurm preemption) mid-run", "kill -TERM once metrics.jsonl has step 1; rerun")
def sigterm_mid_run(ws, d):
    return killed_then_resumed(ws, d, lambda r: 1 in harness.metrics_steps(r), sig=signal.SIGTERM,
                               expect_code=124, line_pattern="exiting 124 for requeue")


@fault("SIGUSR1 during start-up", "kill -USR1 as soon as the trainer catches it (still importing)")
def sigusr1_at_start(ws, d):
    """Sent the moment ``/proc`` shows the handler, not after a fixed delay: before it, SIGUSR1's
    default action ends any process (no program can answer it), and on a loaded machine a fixed
    0.5 s fell before the handler (exit -10 in CI, 2026-12-07)."""
    run_dir = d / "run"
    proc = spawn_train(ws, d, run_dir)
    if not harness.wait_until(lambda: harness.catches(proc.pid, signal.SIGUSR1), proc,
                              timeout_s=60, poll_s=0.002):
        return "-", "", f"the trainer never installed its SIGUSR1 handler (exit {proc.poll()})"
    proc.send_signal(signal.SIGUSR1)
    code = proc.wait(timeout=300)
    written = harness.snapshot(run_dir)
    problem = first_problem((code == 124, f"exit {code}, expected 124 (requeue)"),
                            (not written, f"wrote {sorted(written)}"), no_traceback(d))
    return str(code), harness.find_line(d / "train.log", "during start-up"), problem


def _descendants(pid: int) -> List[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@fault("SIGKILL leaves no process behind", "wandb offline on; kill -9 while the second checkpoint "
       "is being written (its children: wandb's service, any writer); look for survivors 5 s later")
def sigkill_orphans(ws, d):
    run_dir = d / "run"
    env = dict(harness.python_env(), WANDB_MODE="offline")
    proc = spawn_train(ws, d, run_dir, "logging.wandb.enabled=true", env=env)
    seen = set()

    def writers_running() -> bool:
        seen.update(_descendants(proc.pid))
        return (run_dir / "checkpoints" / "step_000002.partial").exists() or complete(run_dir, 2)

    harness.wait_until(writers_running, proc, poll_s=0.005)
    seen.update(_descendants(proc.pid))
    proc.kill()
    proc.wait()
    time.sleep(5)
    alive = sorted(p for p in seen if _alive(p))
    line = f"{len(seen)} child processes seen, {len(alive)} alive 5 s after SIGKILL"
    problem = first_problem((bool(seen), "no child process was observed"),
                            (not alive, f"survivors: {alive}"))
    for pid in alive:  # ours: started by the trainer this function started
        os.kill(pid, signal.SIGKILL)
    return "-9", line, problem


# ---- one run directory, one job -----------------------------------------------------------------

@fault("Two jobs in one run directory", "start a second identical job while the first holds the "
       "run directory (the first is paused meanwhile)")
def two_jobs(ws, d):
    run_dir = d / "run"
    first = spawn_train(ws, d, run_dir)
    if not harness.wait_until(lambda: (run_dir / "run.lock").exists(), first, poll_s=0.01):
        return "-", "", "the first job never took the lock"
    first.send_signal(signal.SIGSTOP)  # keep it mid-run, however slow the second one starts
    try:
        second = train(ws, d, run_dir, log="second.log")
    finally:
        first.send_signal(signal.SIGCONT)
    code = first.wait(timeout=600)
    line = harness.find_line(d / "second.log", "run directory is in use")
    problem = first_problem((second == 2, f"second job exited {second}, expected 2"),
                            (f"PID {first.pid}" in line, "the holder is not named"),
                            (code == 0, f"first job exited {code}"), no_traceback(d))
    return f"{code} and {second}", line, problem or same_as_reference(ws, run_dir)


def _stale_lock(ws, d, holder: dict, env_extra: dict):
    run_dir = d / "run"
    run_dir.mkdir()
    (run_dir / "run.lock").write_text(json.dumps(holder))
    code = train(ws, d, run_dir, env=dict(harness.python_env(), **env_extra))
    line = harness.find_line(d / "train.log", "took over the stale lock")
    problem = first_problem((code == 0, f"exit {code}"), (bool(line), "no takeover logged"),
                            no_traceback(d))
    return str(code), line, problem


@fault("Stale lock of a killed job", "run.lock left by a dead PID on this host")
def stale_lock_dead_pid(ws, d):
    proc = harness.spawn(["true"], d / "dead.log")
    proc.wait()
    holder = {"host": socket.gethostname(), "pid": proc.pid, "slurm_job_id": None,
              "started": "earlier"}
    return _stale_lock(ws, d, holder, {})


@fault("Stale lock after a Slurm requeue", "run.lock of this Slurm job id, written on another node")
def stale_lock_requeue(ws, d):
    holder = {"host": "node-0042", "pid": 4242, "slurm_job_id": "31337", "started": "earlier"}
    return _stale_lock(ws, d, holder, {"SLURM_JOB_ID": "31337"})


# ---- damaged checkpoints --------------------------------------------------------------------------

def _damaged_newest(ws, d, damage: Callable[[Path], None], flags=(), expect=0,
                    pattern="skipping damaged checkpoint"):
    run_dir = copy_of_reference(ws, d)
    damage(run_dir / "checkpoints" / "step_000004")
    code = train(ws, d, run_dir, flags=flags)
    line = harness.find_line(d / "train.log", pattern)
    problem = first_problem((code == expect, f"exit {code}, expected {expect}"),
                            (bool(line), f"no line matching {pattern!r}"), no_traceback(d))
    if expect == 0 and not problem:
        problem = same_as_reference(ws, run_dir) or first_problem(
            (complete(run_dir, 4), "step_000004 was not rewritten complete"))
    return str(code), line, problem


@fault("Newest checkpoint lost a .distcp shard", "rm step_000004/__0_0.distcp; rerun")
def damaged_distcp(ws, d):
    return _damaged_newest(ws, d, lambda s: (s / "__0_0.distcp").unlink())


@fault("Newest checkpoint lost common.pt", "rm step_000004/common.pt; rerun")
def damaged_common(ws, d):
    return _damaged_newest(ws, d, lambda s: (s / "common.pt").unlink())


@fault("Newest checkpoint truncated", "truncate step_000004/__0_1.distcp to half; rerun")
def damaged_truncated(ws, d):
    def truncate(s: Path) -> None:
        f = s / "__0_1.distcp"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return _damaged_newest(ws, d, truncate)


@fault("Newest checkpoint without its manifest", "rm step_000004/manifest.json (a write that never "
       "finished); rerun")
def damaged_manifest(ws, d):
    return _damaged_newest(ws, d, lambda s: (s / "manifest.json").unlink())


@fault("Every checkpoint damaged, --resume", "rm manifest.json of step 3 and 4; rerun --resume")
def all_damaged(ws, d):
    def damage(s: Path) -> None:
        (s / "manifest.json").unlink()
        (s.parent / "step_000003" / "manifest.json").unlink()
    return _damaged_newest(ws, d, damage, flags=("--resume",), expect=2,
                           pattern="no complete checkpoint")


@fault("Final rename of a checkpoint interrupted", "mv step_000004 step_000004.partial (complete); "
       "rerun")
def interrupted_rename(ws, d):
    def rename(s: Path) -> None:
        s.rename(s.with_name(s.name + ".partial"))
    return _damaged_newest(ws, d, rename, pattern="into place")


@fault("Torn last line in metrics.jsonl", "rm step_000004; append half a row to metrics.jsonl; rerun")
def torn_metrics(ws, d):
    def tear(s: Path) -> None:
        shutil.rmtree(s)
        with open(s.parent.parent / "metrics.jsonl", "a") as f:
            f.write('{"step": 5, "reward/me')
    return _damaged_newest(ws, d, tear, pattern="dropping a torn last line")
