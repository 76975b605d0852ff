"""One job per run directory: the holder is named, stale locks are taken over (dead PID, reused
PID, same Slurm job after a requeue, torn lock file), and a race for a stale lock has one winner."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_megatron.trainer import run_lock
from gspo_megatron.trainer.run_lock import LOCK_FILE, RunDirLock, RunDirLockedError


def _write_holder(run_dir, **fields):
    holder = {"host": run_lock.socket.gethostname(), "pid": os.getpid(), "pid_start_ticks": None,
              "slurm_job_id": None, "started": "2026-01-01T00:00:00+0000", **fields}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps(holder))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_holds_identity_and_is_removed_on_exit(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with RunDirLock(tmp_path / "run") as lock:
        holder = json.loads(lock.path.read_text())
        assert holder["pid"] == os.getpid() and holder["slurm_job_id"] == "4242"
        assert holder["host"] and holder["started"] and holder["pid_start_ticks"]
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_second_job_is_refused_with_the_holder_named(tmp_path):
    _write_holder(tmp_path, host="node-a7", pid=1234, slurm_job_id="99")
    with pytest.raises(RunDirLockedError) as info:
        RunDirLock(tmp_path).acquire()
    assert "in use by PID 1234 on node-a7, Slurm job 99" in str(info.value)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == 1234  # untouched


def test_live_process_on_this_host_keeps_its_lock(tmp_path):
    _write_holder(tmp_path, pid=os.getppid())  # pytest's parent is alive
    with pytest.raises(RunDirLockedError, match=f"PID {os.getppid()}"):
        RunDirLock(tmp_path).acquire()


@pytest.mark.parametrize("case", ["dead_pid", "reused_pid", "same_slurm_job", "torn"])
def test_stale_locks_are_taken_over_and_logged(tmp_path, monkeypatch, caplog, case):
    if case == "dead_pid":
        _write_holder(tmp_path, pid=_dead_pid())
        reason = "on this host is gone"
    elif case == "reused_pid":  # a live PID whose process started at another time
        _write_holder(tmp_path, pid=os.getppid(), pid_start_ticks=1)
        reason = "now belongs to another process"
    elif case == "same_slurm_job":
        monkeypatch.setenv("SLURM_JOB_ID", "777")
        _write_holder(tmp_path, host="another-node", pid=1, slurm_job_id="777")
        reason = "belongs to this Slurm job (777), requeued"
    else:
        (tmp_path / LOCK_FILE).write_text('{"host": "x", "pi')
        old = time.time() - 60
        os.utime(tmp_path / LOCK_FILE, (old, old))
        reason = "unreadable lock file"
    with caplog.at_level(logging.WARNING):
        lock = RunDirLock(tmp_path).acquire()
    assert "took over the stale lock" in caplog.text and reason in caplog.text
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]
    lock.release()


def test_a_fresh_torn_lock_is_not_taken(tmp_path):
    (tmp_path / LOCK_FILE).write_text("")  # its holder may be writing it right now
    with pytest.raises(RunDirLockedError):
        RunDirLock(tmp_path).acquire()


def _race(run_dir: str, start_at: float, results) -> None:
    while time.time() < start_at:
        pass
    try:
        RunDirLock(run_dir).acquire()  # kept: the process exits holding it
        results.put("won")
    except RunDirLockedError:
        results.put("refused")


def test_two_jobs_racing_for_a_stale_lock_have_one_winner(tmp_path):
    _write_holder(tmp_path, pid=_dead_pid())
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    start_at = time.time() + 0.5
    procs = [ctx.Process(target=_race, args=(str(tmp_path), start_at, results)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert outcomes == ["refused", "refused", "refused", "won"]


def test_the_lock_appears_with_its_holder_in_it(tmp_path, monkeypatch):
    """Issue 41 (a CI flake of the "two jobs" fault): the lock used to be created empty and then
    written, so a holder stopped in between was refused to the second job as "PID None". It
    now appears in one step: at the instant it exists it names its holder."""
    seen = []
    real_link = os.link

    def link_and_look(src, dst, *args, **kwargs):
        real_link(src, dst, *args, **kwargs)
        seen.append(json.loads(Path(dst).read_text()))  # what another job could read right now

    monkeypatch.setattr(os, "link", link_and_look)
    with RunDirLock(tmp_path):
        assert seen and seen[0]["pid"] == os.getpid()
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]  # no private file left
        with pytest.raises(RunDirLockedError, match=f"in use by PID {os.getpid()} on "):
            RunDirLock(tmp_path).acquire()
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]
