"""Children that die with the process that started them (Linux parent-death signal).

A trainer killed with SIGKILL (OOM killer, ``kill -9``, a node agent) runs no cleanup, so any
process it started keeps running unless the kernel is told to end it. ``prctl(PR_SET_PDEATHSIG,
SIGKILL)`` in the child does that: the child gets SIGKILL when the thread that forked it exits.
It is reset by ``fork`` but kept across ``exec``, so it has to be set in every child:

* :func:`children_die_with_this_process` registers an ``os.register_at_fork`` hook, which covers
  every child made by ``os.fork`` (multiprocessing's ``fork`` context: dist_checkpointing's
  writer processes, ``strategies/filesystem_async.py`` in megatron-core 0.16.1);
* for ``subprocess.Popen`` children (rollout servers, ``rollout/sglang/launcher.py``) this
  module is a command-line wrapper: ``python -m gspo_megatron.distributed.child_processes
  --parent PID -- CMD ...`` sets the signal, checks that ``PID`` is still its parent, then
  ``exec``-s ``CMD`` (same process, signal kept), like util-linux ``setpriv --pdeathsig KILL``,
  which is not installed everywhere.

Elsewhere than Linux these are no-ops. Slurm's cgroups end a job step's processes anyway; this
covers a trainer killed alone.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import signal
import sys
from typing import Optional, Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_hook_installed = False
_forking_pid = 0
# Resolved in the parent at import: a child right after fork should not dlopen (locks).
_LIBC = (ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
         if sys.platform.startswith("linux") else None)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only)."""
    if _LIBC is None:
        return
    if _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent()
    if os.getppid() != _forking_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def children_die_with_this_process() -> None:
    """Make every process later forked from this one die with it (idempotent)."""
    global _hook_installed
    if _hook_installed or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _hook_installed = True


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="exec a command that dies with its parent")
    parser.add_argument("--parent", type=int, required=True, help="the expected parent PID")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    die_with_parent()
    if os.getppid() != args.parent:  # the parent died before prctl took effect
        return 1
    os.execvp(command[0], command)
    return 1  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main())
