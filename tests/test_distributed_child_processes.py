"""Children die with the process that started them, even when it is killed with SIGKILL: a
forked child (the fork hook) and a command started through the module's exec wrapper."""

from __future__ import annotations

import os
import subprocess
import sys
import time

PARENT = r"""
import os, subprocess, sys, time
from gspo_megatron.distributed.child_processes import children_die_with_this_process
children_die_with_this_process()
forked = os.fork()
if forked == 0:
    time.sleep(600)
    os._exit(0)
popen = subprocess.Popen([sys.executable, "-m", "gspo_megatron.distributed.child_processes",
                          "--parent", str(os.getpid()), "--",
                          sys.executable, "-c", "import time; time.sleep(600)"])
print(forked, popen.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_forked_and_popen_children_die_when_the_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.getcwd()))
    children = [int(p) for p in parent.stdout.readline().split()]
    assert len(children) == 2 and all(_alive(p) for p in children)
    parent.kill()
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in children if _alive(p)]


def test_wrapper_refuses_when_its_parent_is_not_the_expected_one():
    code = subprocess.run([sys.executable, "-m", "gspo_megatron.distributed.child_processes",
                           "--parent", "1", "--", "true"], env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert code.returncode == 1
