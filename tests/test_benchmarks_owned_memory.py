"""The owned-memory sampler: a child's heap is seen, so is a grandchild's (summed over the tree),
file-backed pages (a mapped file) are not, and a command that outlives its timeout is stopped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.owned_memory import owned_bytes, process_tree, run_measured

MB = 2**20
HOLD = "import time; b = bytearray({n}); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0)"


def test_a_childs_heap_is_counted_and_the_tree_is_summed():
    one = run_measured([sys.executable, "-c", HOLD.format(n=150 * MB)])
    assert one.returncode == 0 and one.num_samples >= 5
    assert 150 * MB < one.peak_bytes < 150 * MB + 60 * MB  # + the interpreter's own heap
    spawn = ("import subprocess, sys; "
             f"c = subprocess.Popen([sys.executable, '-c', {HOLD.format(n=100 * MB)!r}]); "
             f"exec({HOLD.format(n=100 * MB)!r}); c.wait()")
    two = run_measured([sys.executable, "-c", spawn])
    assert two.returncode == 0 and len(two.peak_by_name) == 2
    assert 200 * MB < two.peak_bytes < 200 * MB + 120 * MB


def test_a_mapped_file_is_not_owned(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"\1" * (150 * MB))
    read_mapped = ("import mmap, time; f = open({p!r}, 'rb'); "
                   "m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
                   "s = sum(m[i] for i in range(0, len(m), 4096)); "
                   "time.sleep(1.0)").format(p=str(data))
    run = run_measured([sys.executable, "-c", read_mapped])
    assert run.returncode == 0 and run.peak_bytes < 60 * MB


def test_process_tree_and_owned_bytes_of_this_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    try:
        tree = process_tree(__import__("os").getpid())
        assert child.pid in tree and owned_bytes(tree[0]) > 0
    finally:
        child.kill()
        child.wait()
    assert owned_bytes(child.pid) == 0  # gone


def test_timeout_stops_the_command():
    with pytest.raises(subprocess.TimeoutExpired):
        run_measured([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=1)


def test_a_daemon_left_holding_the_output_does_not_hold_the_run(tmp_path):
    """torch's torch_shm_manager outlives the ranks that start it while another process maps
    its shared memory, holding their stdout: a run that logs to a file ends with its command."""
    import os
    import signal
    import time

    script = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(30)']); print('daemon', p.pid, flush=True)")
    t0 = time.monotonic()
    run = run_measured([sys.executable, "-c", script], log_path=str(tmp_path / "out.log"),
                       timeout_s=20)
    took = time.monotonic() - t0
    pid = int(run.output.split()[1])
    try:
        assert run.returncode == 0 and run.output.startswith("daemon ")
        assert took < 15, took  # a pipe would have waited for the daemon's 30 s
    finally:
        os.kill(pid, signal.SIGKILL)

def test_split_sampler_counts_a_marked_child_apart_from_the_rest():
    """The sampler is rooted at a parent process of the test's own, not at pytest: pytest's tree
    also holds the commands ``tests/ahead.py`` runs in the background, whose trainers come and go
    (a test rooted there waited for all of them: 340 s in fresh clone 14)."""
    import os
    import signal
    import time

    from benchmarks.owned_memory import SplitMemorySampler, command_line

    marker = "held_by_the_branch_child"
    child_code = (f"{marker} = 1; " + HOLD.format(n=120 * MB)
                  .replace("time.sleep(1.0)", "print('ready', flush=True); time.sleep(120)"))
    # the parent starts the marked child, passes on its "ready", then grows by 80 MB when told
    # and holds it; every wait below is on what the sampler has seen, with a deadline, not a
    # fixed sleep (flaky under load)
    parent_code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}], stdout=subprocess.PIPE,"
        " text=True)\n"
        "print(child.stdout.readline().strip(), flush=True)\n"
        "sys.stdin.readline()\n"
        f"big = bytearray({80 * MB}); big[::4096] = b'x' * len(big[::4096])\n"
        "print('grown', flush=True)\n"
        "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    phase = {"now": "before"}
    sampler = None

    def wait_for(seen, what):
        deadline = time.monotonic() + 60
        while not seen():
            assert time.monotonic() < deadline, f"the sampler never saw {what}"
            time.sleep(0.05)

    try:
        assert parent.stdout.readline().strip() == "ready"
        sampler = SplitMemorySampler(parent.pid, lambda pid: marker in command_line(pid),
                                     phase=lambda: phase["now"], interval_s=0.05).start()
        wait_for(lambda: sampler.peaks.get("before", {}).get("branch", 0) > 120 * MB,
                 "the child's 120 MB")
        wait_for(lambda: sampler.peaks.get("before", {}).get("main", 0) > 0, "the parent")
        phase["now"] = "after"
        base = sampler.peaks["before"]["main"]
        parent.stdin.write("grow\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "grown"
        wait_for(lambda: sampler.peaks.get("after", {}).get("main", 0) - base > 70 * MB,
                 "the parent's new 80 MB")
    finally:
        if sampler is not None:
            sampler.stop()
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and its child
        parent.wait()
        parent.stdin.close()
        parent.stdout.close()
    before, after = sampler.peaks["before"], sampler.peaks["after"]
    assert 120 * MB < before["branch"] < 150 * MB and after["branch"] > 120 * MB
    assert before["main"] < 60 * MB  # the parent's interpreter: the child is not in it
    assert after["main"] - before["main"] > 70 * MB  # the parent's new 80 MB, not the child's
    assert sampler.overall()["total"] >= after["main"] + 120 * MB
