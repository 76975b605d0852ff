"""Opt-in CPU accounting per test: where the suite's CPU-seconds go (issue 41 item 8).

    pytest --cpu-durations=30 [--cpu-durations-file cpu.jsonl] ...
    GSPO_CPU_DURATIONS=30 make test          # the same, through the environment

Wall-clock durations on a shared 2-core machine move with everyone else's load; CPU-seconds
barely do, so this is what to compare before and after a change that buys time back. Each test
(setup, call and teardown together: a module fixture's server start counts in its first test,
its stop in its last) gets the user+sys CPU-seconds of

* ``self``: this pytest process, all its threads (``getrusage(RUSAGE_SELF)``);
* ``children``: every other process the session started, however far down: found by an
  environment variable (``GSPO_CPU_LEDGER``, set here and inherited) or by a parent already
  found. That covers what ``getrusage(RUSAGE_CHILDREN)`` misses: it counts a child only once it
  is waited for (a server started by a fixture runs across many tests), and never a process
  orphaned by its parent (an SGLang scheduler whose launcher died first) or started by a daemon
  (jobs of the local Slurm, whose daemons detach from pytest).

A sampler thread reads ``/proc/<pid>/stat`` of those processes every ``--cpu-durations-interval``
seconds (0.5) and at every test's start and end. A process's own CPU counts as it grows; what a
parent reaps (``cutime``: ``RUSAGE_CHILDREN`` for pytest itself) counts minus the children it
was already counted for, which catches processes too short-lived to be sampled. ``idle``: the
test's time between samples in which those processes (and pytest, its sampler aside) used
under 10% of a core and none of them (nor another thread of pytest) was running or waiting for a
core: sleeps, polls, network, timeouts; what a test costs on an idle machine beyond its CPU.
Both measures are estimates at the sampling interval.

A command run ahead (``tests/ahead.py``) counts in the test that takes its result (``ahead``,
from its runner's ``wait4``), not in the tests it ran beside; its runner is left out here.

Limits: a process that ends less than one interval after a sample, and whose parent ended with
it (a killed process group) or does not wait for it, loses that last interval. A process that
clears its environment and whose parent is not in the tree (a daemon started with ``env -i``)
is not found. The sampler itself costs ~1% of a core, counted in ``self``. Collection counts in
the session's total, not in any test.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from collections import defaultdict
from typing import Dict, Optional, Tuple

import pytest

ENV_VAR = "GSPO_CPU_DURATIONS"
MARKER = "GSPO_CPU_LEDGER"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("cpu-durations", "CPU-seconds per test (tests/cpu_durations.py)")
    group.addoption("--cpu-durations", type=int, default=None, metavar="N",
                    help=f"record CPU-seconds of every test and print the N costliest tests and "
                         f"modules (0: all); also ${ENV_VAR}=N")
    group.addoption("--cpu-durations-file", default=None, metavar="PATH",
                    help="also write one JSON line per test there")
    group.addoption("--cpu-durations-interval", type=float, default=0.5, metavar="S",
                    help="seconds between samples of the processes (default 0.5)")


def pytest_configure(config) -> None:
    num = config.getoption("--cpu-durations")
    if num is None and os.environ.get(ENV_VAR, "").strip():
        num = int(os.environ[ENV_VAR])
    if num is not None:
        ledger = CpuLedger(num, config.getoption("--cpu-durations-file"),
                           ProcessTreeClock(config.getoption("--cpu-durations-interval")))
        config.pluginmanager.register(ledger, "cpu-ledger")


def _proc_stat(path: str) -> Optional[tuple]:
    """``(ppid, start time, own user+sys s, reaped user+sys s, running)`` of a live process or
    thread (``/proc/<pid>`` or ``/proc/<pid>/task/<tid>``), else None."""
    try:
        with open(f"{path}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = [int(x) for x in fields[11:15]]  # utime stime cutime cstime (fields 14-17)
    return (int(fields[1]), int(fields[19]), (ticks[0] + ticks[1]) * TICK_S,
            (ticks[2] + ticks[3]) * TICK_S, fields[0] == b"R")


def _any_thread_running(pid: int, but: int) -> bool:
    """Whether a thread of ``pid`` other than ``but`` is running or waiting for a core."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(int(t) != but and (_proc_stat(f"/proc/{pid}/task/{t}") or (0,) * 5)[4] for t in tids)


def _rusage_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class ProcessTreeClock:
    """CPU-seconds used so far by this process and every process of the session (see above)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self._me = os.getpid()
        token = f"{self._me}.{time.time_ns()}"
        os.environ[MARKER] = token  # inherited by everything started from here on
        self._needle = f"{MARKER}={token}".encode()
        self._lock = threading.Lock()
        self._members: Dict[tuple, bool] = {}  # (pid, start) of every process seen -> ours
        self._excluded: set = set()  # PIDs left out with their descendants (a PID reused later
        # by a process of ours would be left out too: one session does not wrap PIDs around)
        self._live: Dict[int, Tuple[int, int, float, float]] = {}  # ours at the last sample
        self._unmatched: Dict[tuple, float] = {}  # per parent: reaped growth - children's ends
        self._counted_reaped: Dict[tuple, float] = {}  # what of that balance is in total_s
        self._self_s, self._reaped_s = _rusage_s(resource.RUSAGE_SELF), 0.0
        self.total_s = self._self_s
        self.self_total_s = self._self_s
        self.idle_s = 0.0
        self._sampled_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True,
                                        name="cpu-durations-sampler")
        self._thread.start()
        self._sampler_clock = time.pthread_getcpuclockid(self._thread.ident)
        self._sampler_s = 0.0

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def exclude(self, pid: int) -> None:
        """Leave ``pid`` and every process it starts out (``tests/ahead.py``'s runner: its
        commands' CPU is added to the tests that take their results)."""
        with self._lock:
            self._excluded.add(pid)
            self._live.pop(pid, None)
            self._members.update({key: False for key in self._members if key[0] == pid})

    def _ours(self, pid: int, ppid: int, start: int, live: dict) -> bool:
        key = (pid, start)
        if key not in self._members:
            if pid in self._excluded or ppid in self._excluded:
                self._excluded.add(pid)
                self._members[key] = False
            elif ppid == self._me or ppid in live or ppid in self._live:
                self._members[key] = True
            else:
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        self._members[key] = self._needle in f.read()
                except OSError:
                    self._members[key] = False
        return self._members[key]

    def _reaped_news(self, parent: tuple, growth: float, ended: float) -> float:
        """What a parent's reaped CPU adds that its children's own samples did not: its growth
        minus what the children that ended had been counted for. The two are seen in either
        order (a child can be listed just before its parent reaps it, or be gone from a listing
        that read its parent before the reap), so the difference is kept as a running balance
        per parent and only its positive part counts, corrected as the other half arrives: a
        per-sample ``max(0, growth - ended)`` counted such a child twice (fresh clone 13: 1.23
        CPU-s for a child that used 0.6)."""
        balance = self._unmatched.get(parent, 0.0) + growth - ended
        counted = max(0.0, balance)
        news = counted - self._counted_reaped.get(parent, 0.0)
        self._unmatched[parent], self._counted_reaped[parent] = balance, counted
        return news

    def sample(self) -> float:
        """Read every process once; return the total so far."""
        with self._lock:
            live = {}
            for name in sorted(os.listdir("/proc"), key=lambda n: (len(n), n)):
                if name.isdigit() and int(name) != self._me:
                    stat = _proc_stat(f"/proc/{name}")
                    if stat and self._ours(int(name), stat[0], stat[1], live):
                        live[int(name)] = stat
            self_s, reaped_s = _rusage_s(resource.RUSAGE_SELF), _rusage_s(resource.RUSAGE_CHILDREN)
            gone_by_parent: Dict[int, float] = defaultdict(float)
            for pid, (ppid, start, own, reaped, _) in self._live.items():
                if pid not in live or live[pid][1] != start:
                    gone_by_parent[ppid] += own + reaped  # now in its parent's reaped, if waited
                    self._unmatched.pop((pid, start), None)
                    self._counted_reaped.pop((pid, start), None)
            added = self_s - self._self_s
            added += self._reaped_news((self._me, 0), reaped_s - self._reaped_s,
                                       gone_by_parent[self._me])
            for pid, (ppid, start, own, reaped, _) in live.items():
                before = self._live.get(pid)
                if before is None or before[1] != start:
                    added += own + reaped  # new: all it ran, with the children it already reaped
                else:
                    added += (own - before[2]) + self._reaped_news(
                        (pid, start), reaped - before[3], gone_by_parent[pid])
            self.self_total_s += self_s - self._self_s
            self._self_s, self._reaped_s, self._live = self_s, reaped_s, live
            self.total_s += added
            now = time.monotonic()
            try:  # the sampler's own CPU is not the tests' work
                sampler_s = time.clock_gettime(self._sampler_clock)
            except OSError:  # closed
                sampler_s = self._sampler_s
            worked = added - (sampler_s - self._sampler_s) > 0.1 * (now - self._sampled_at)
            if not (worked or any(stat[4] for stat in live.values())
                    or _any_thread_running(self._me, threading.get_native_id())):
                self.idle_s += now - self._sampled_at  # nothing of ours ran or waited for a core
            self._sampled_at, self._sampler_s = now, sampler_s
            return self.total_s


class CpuLedger:
    """The registered plugin: the clock read around every test, a summary at the end."""

    def __init__(self, num_shown: int, path: Optional[str], clock: ProcessTreeClock) -> None:
        self.num_shown, self.path, self.clock = num_shown, path, clock
        self.rows: Dict[str, dict] = {}
        self.start_wall = time.monotonic()

    def _now(self) -> Tuple[float, float, float, float]:
        total = self.clock.sample()
        return total, self.clock.self_total_s, self.clock.idle_s, time.monotonic()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        start = self._now()
        try:
            return (yield)
        finally:
            end = self._now()
            cpu, self_s, idle, wall = (b - a for a, b in zip(start, end))
            ahead = sum(v for k, v in item.user_properties if k == "ahead_cpu_s")
            self._record(item.nodeid, {"cpu": cpu + ahead, "self": self_s, "ahead": ahead,
                                       "children": cpu + ahead - self_s, "idle": idle,
                                       "wall": wall})

    def _record(self, nodeid: str, row: dict) -> None:
        self.rows[nodeid] = row
        if self.path:
            with open(self.path, "a") as out:
                out.write(json.dumps({"test": nodeid, **row}) + "\n")

    def pytest_unconfigure(self, config) -> None:
        self.clock.close()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        write = terminalreporter.write_line
        total = self.clock.sample()
        in_tests = sum(r["cpu"] for r in self.rows.values())
        terminalreporter.section("cpu durations (tests/cpu_durations.py)")
        write(f"{len(self.rows)} tests: {in_tests:.1f} CPU-s in tests, {total:.1f} CPU-s in the "
              f"session ({time.monotonic() - self.start_wall:.1f} s wall)")
        ranked = sorted(self.rows.items(), key=lambda kv: -kv[1]["cpu"])
        write(f"{'cpu s':>8} {'self':>7} {'children':>8} {'idle s':>7} {'wall s':>7}  test")
        for nodeid, r in ranked[:self.num_shown or None]:
            write(f"{r['cpu']:8.1f} {r['self']:7.1f} {r['children']:8.1f} {r['idle']:7.1f} "
                  f"{r['wall']:7.1f}  {nodeid}")
        modules: Dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
        for nodeid, r in self.rows.items():
            module = modules[nodeid.split("::")[0]]
            for i, key in enumerate(("cpu", "idle", "wall")):
                module[i] += r[key]
            module[3] += 1
        write(f"{'cpu s':>8} {'idle s':>8} {'wall s':>8} {'tests':>6}  module")
        by_module = sorted(modules.items(), key=lambda kv: -kv[1][0])
        for name, (cpu, idle, wall, count) in by_module[:self.num_shown or None]:
            write(f"{cpu:8.1f} {idle:8.1f} {wall:8.1f} {count:6d}  {name}")
