"""Run the commands that ``tests/ahead.py`` planned, in the background of a test session.

    python tests/ahead_runner.py PLAN.json [NICE]

Commands run at nice value ``NICE`` (the session's runner: 19, so a test running in the
foreground loses next to nothing to them and an idle core is what they use; a test's own run:
its own), except those asking for ``foreground_priority`` (a memory sampler that must not
starve). Every ``waits`` command starts at once (they mostly wait on the network); the others
run in two lanes, one command at a time in each: the ``early`` ones, and the rest in the plan's
order. A command that asks for memory (``min_available_gib``) waits, first in its lane, until
the machine has it available. Each command runs in a session of its own in its directory's files (``stdout``,
``stderr``, ``pgid``); when it ends, ``result.json`` gets its exit code, seconds, CPU-seconds
(its whole waited-for tree, from ``wait4``) and the nice value it started at. A command past its
timeout is killed with its process group (exit code -9). SIGTERM, or the end of the session's
process, ends the runner and every command still running, by their process groups.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.2


def available_gib() -> float:
    """The kernel's estimate of memory available to a new process (``MemAvailable``), GiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")  # an old kernel: no estimate, no wait


def fits(job: dict) -> bool:
    """Whether ``job`` may start now: the memory it asks for is available."""
    return available_gib() >= job.get("min_available_gib", 0.0)


def _start(job: dict, nice: int) -> subprocess.Popen:
    out_dir = Path(job["dir"])
    lower = nice > os.getpriority(os.PRIO_PROCESS, 0)
    with open(out_dir / "stdout", "wb") as out, open(out_dir / "stderr", "wb") as err:
        proc = subprocess.Popen(job["argv"], cwd=job["cwd"], env=dict(os.environ, **job["env"]),
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True,
                                preexec_fn=(lambda: os.setpriority(os.PRIO_PROCESS, 0, nice))
                                if lower else None)
    (out_dir / "pgid").write_text(str(proc.pid))
    return proc


def _finish(job: dict, code: int, started: float, cpu_s: float, nice: int) -> None:
    result = {"returncode": code, "seconds": round(time.monotonic() - started, 2),
              "cpu_s": round(cpu_s, 2), "nice": nice}
    path = Path(job["dir"]) / "result.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").rename(path)  # whole, or not there


def run(plan: list, nice: int = 0) -> None:
    """``nice``: the nice value of the commands (at least the runner's own, which those asking
    for the foreground's priority keep)."""
    lanes = [[job for job in plan if not job["waits"] and job["early"]],
             [job for job in plan if not job["waits"] and not job["early"]]]
    running = {}  # pid -> (job, Popen (kept: a dropped one may be reaped by subprocess), started)

    own = os.getpriority(os.PRIO_PROCESS, 0)

    def start(job: dict) -> None:
        job["nice"] = own if job["foreground_priority"] else max(own, nice)
        try:
            proc = _start(job, job["nice"])
        except OSError as exc:  # no such interpreter, ...: the test reads why
            (Path(job["dir"]) / "stderr").write_text(f"could not start {job['argv']}: {exc}\n")
            _finish(job, 127, time.monotonic(), 0.0, job["nice"])
            return
        running[proc.pid] = (job, proc, time.monotonic())

    def stop(signum, frame):
        for _, proc, _ in running.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    session = os.getppid()
    for job in plan:
        if job["waits"]:
            start(job)
    while any(lanes) or running:
        if os.getppid() != session:  # the session died without ending us (SIGKILL, SIGTERM)
            stop(signal.SIGTERM, None)
        busy = {job["early"] for job, _, _ in running.values() if not job["waits"]}
        ready = [lane for lane in lanes if lane and lane[0]["early"] not in busy and fits(lane[0])]
        if ready:
            start(ready[0].pop(0))
            continue
        for pid, (job, _, started) in list(running.items()):
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                del running[pid]
                _finish(job, os.waitstatus_to_exitcode(status), started,
                        usage.ru_utime + usage.ru_stime, job["nice"])
            elif time.monotonic() - started > job["timeout_s"]:
                os.killpg(pid, signal.SIGKILL)
        time.sleep(POLL_S)


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
