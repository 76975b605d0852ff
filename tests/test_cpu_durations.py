"""tests/cpu_durations.py: each test gets the CPU-seconds of the processes it ran, wherever they
ran: in pytest, in a child it waited for, in a server a module fixture keeps across tests, in a
grandchild orphaned by its parent, in a process too short-lived to be sampled. The case runs in
a fresh pytest process with this repository's conftest, so its sampler thread stays there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.test_conftest import conftest_package

BURN_S = 0.6
"""CPU-seconds each burning process spends: well above one sampling interval (0.05 s here)."""

CASE = '''
import subprocess, sys, time
import pytest

BURN = "import time\\nend = time.process_time() + {burn}\\nwhile time.process_time() < end: pass"

def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_idle():
    time.sleep(1.0)

def test_in_pytest():
    burn({burn})

def test_waited_child():
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_orphaned_grandchild():
    # the child starts a burning grandchild in a session of its own and exits without waiting
    code = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
            "start_new_session=True, stdout=open(sys.argv[2], 'w'))")
    subprocess.run([sys.executable, "-c", code, BURN + "\\nprint('done', flush=True)", "out.txt"],
                   check=True)
    deadline = time.monotonic() + 60
    while open("out.txt").read().strip() != "done" and time.monotonic() < deadline:
        time.sleep(0.05)

def test_short_lived_children():
    for _ in range(3):  # each ends before a sample can see it
        subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time\\n" +
                             "for line in sys.stdin:\\n" +
                             "    end = time.process_time() + float(line)\\n" +
                             "    while time.process_time() < end: pass\\n" +
                             "    print('ok', flush=True)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    yield proc
    proc.stdin.close()
    proc.wait()

def test_server_first(server):
    server.stdin.write("{burn}\\n"); server.stdin.flush(); server.stdout.readline()

def test_server_second(server):
    server.stdin.write("{burn}\\n"); server.stdin.flush(); server.stdout.readline()
'''


def test_each_test_gets_the_cpu_of_its_processes(tmp_path):
    package = conftest_package(tmp_path)
    (package / "test_case.py").write_text(textwrap.dedent(CASE.format(burn=BURN_S)))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-o", "markers=leaves_threads", "test_case.py",
                          "--cpu-durations=3", "--cpu-durations-interval=0.05",
                          "--cpu-durations-file", str(tmp_path / "cpu.jsonl")],
                         cwd=package, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {json.loads(line)["test"].split("::")[1]: json.loads(line)
            for line in (tmp_path / "cpu.jsonl").read_text().splitlines()}
    assert len(rows) == 7
    low, high = 0.8 * BURN_S, BURN_S + 0.5  # a python start-up is ~0.02-0.1 CPU-s more
    assert rows["test_idle"]["cpu"] < 0.15 and rows["test_idle"]["idle"] > 0.7, rows["test_idle"]
    busy = rows["test_in_pytest"]
    assert busy["idle"] < 0.5 * busy["wall"], busy
    assert low < rows["test_in_pytest"]["self"] < high, rows["test_in_pytest"]
    for name in ("test_waited_child", "test_orphaned_grandchild", "test_server_second"):
        assert low < rows[name]["children"] < high, rows[name]
        assert rows[name]["self"] < 0.3, rows[name]
    # the fixture's start counts in the first test, its stop in the second: neither twice
    assert low < rows["test_server_first"]["children"] < high + 0.3, rows["test_server_first"]
    short = rows["test_short_lived_children"]
    assert 0.01 < short["children"] < 1.0, short
    assert "cpu durations (tests/cpu_durations.py)" in out.stdout
    shown = [line.split()[-1] for line in out.stdout.splitlines() if "test_case.py::" in line]
    costliest = sorted(rows.values(), key=lambda r: -r["cpu"])[:3]
    assert shown == [r["test"] for r in costliest]  # the 3 asked for, costliest first
    by_module = out.stdout.split("tests  module\n", 1)[1].splitlines()  # the modules' table
    assert "7 tests:" in out.stdout and by_module[0].endswith("  test_case.py"), out.stdout


def test_off_unless_asked(tmp_path):
    package = conftest_package(tmp_path)
    (package / "test_case.py").write_text("import os, threading\n\ndef test_env():\n"
                                          "    assert 'GSPO_CPU_LEDGER' not in os.environ\n"
                                          "    assert threading.active_count() == 1\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GSPO_CPU_DURATIONS", "GSPO_CPU_LEDGER")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "test_case.py"], cwd=package, capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0 and "cpu durations" not in out.stdout, out.stdout + out.stderr


def _scripted_clock(monkeypatch, samples):
    """A ``ProcessTreeClock`` whose reads of ``/proc`` and of its own usage follow ``samples``:
    one ``(children's stat by pid, this process's reaped CPU-s)`` per ``sample()``, in order."""
    from tests import cpu_durations

    clock = cpu_durations.ProcessTreeClock(interval_s=3600.0)  # sampled by hand only
    me = clock._me
    frames = iter(samples)
    current = {}

    def listdir(path):
        assert path == "/proc"
        stats, reaped = next(frames)
        current.clear()
        current.update(stats=stats, reaped=reaped)
        return [str(pid) for pid in stats]

    def proc_stat(path):
        pid = int(path.rsplit("/", 1)[1])
        ppid, own, reaped = current["stats"][pid]
        return (me if ppid == "me" else ppid, 1000 + pid, own, reaped, False)

    self_s = cpu_durations._rusage_s(cpu_durations.resource.RUSAGE_SELF)
    monkeypatch.setattr(cpu_durations.os, "listdir", listdir)
    monkeypatch.setattr(cpu_durations, "_proc_stat", proc_stat)
    monkeypatch.setattr(cpu_durations, "_any_thread_running", lambda pid, but: False)
    monkeypatch.setattr(cpu_durations, "_rusage_s", lambda who: self_s if who == cpu_durations.resource.RUSAGE_SELF
                        else current["reaped"])
    clock._self_s = self_s
    return clock, self_s


def test_a_child_reaped_between_the_listing_and_the_usage_read_counts_once(monkeypatch):
    """Fresh clone 13: a child that burned 0.6 CPU-s was counted 1.23: it was still listed with
    its 0.6 s when pytest's reaped CPU, read just after, already held the same 0.6 s."""
    clock, _ = _scripted_clock(monkeypatch, [
        ({7: ("me", 0.4, 0.0)}, 0.0),   # running
        ({7: ("me", 0.6, 0.0)}, 0.6),   # listed as it ended; reaped before the usage read
        ({}, 0.6),                      # gone
        ({}, 0.6)])
    try:
        totals = [clock.sample() - clock.self_total_s for _ in range(4)]
    finally:
        clock.close()
    assert totals[-1] == pytest.approx(0.6)


def test_a_grandchild_reaped_after_its_parent_was_read_counts_once(monkeypatch):
    """The other order: the grandchild is gone from the listing while its parent's reaped CPU,
    read earlier in the same listing, does not hold it yet; the next sample's does."""
    clock, _ = _scripted_clock(monkeypatch, [
        ({5: ("me", 0.1, 0.0), 9: (5, 0.3, 0.0)}, 0.0),
        ({5: ("me", 0.1, 0.0)}, 0.0),          # 9 ended at 0.5 s, 5 not updated yet
        ({5: ("me", 0.1, 0.5)}, 0.0),          # now 5 has reaped it
        ({5: ("me", 0.1, 0.5)}, 0.0)])
    try:
        totals = [clock.sample() - clock.self_total_s for _ in range(4)]
    finally:
        clock.close()
    assert totals[-1] == pytest.approx(0.6)  # 0.1 of the parent, 0.5 of the grandchild
