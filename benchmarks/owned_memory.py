"""Peak *owned* memory of a command and every process it starts, sampled from ``/proc``.

Owned bytes of one process are ``RssAnon + RssShmem`` from ``/proc/PID/status``: its heap and
tensors plus the shared memory it maps, leaving out file-backed pages (the interpreter's
libraries, a safetensors file mapped with ``mmap``) that the kernel can drop and reread. The
tree's owned bytes are that sum over the command's process and its descendants (torchrun, its
ranks, the writer processes ``dist_checkpointing`` forks), sampled every ``interval_s``; the
peak of that sum is what a tool costs a machine that runs it.

Summed RSS counts a page twice when two processes map it: a forked child's copy-on-write view of
its parent's heap is counted in both (that is what a machine's memory accounting sees when the
child writes, and what an OOM killer scores), shared memory in every process that maps it.

    result = run_measured(["torchrun", "--nproc_per_node=2", "tools/reshard.py", ...])
    print(result.peak_bytes / 2**30, result.peak_by_name)

    with OwnedMemorySampler(os.getpid()) as sampler:   # this process and its children
        work()
    sampler.peak_bytes

Used by ``benchmarks/bench_checkpoint_memory.py`` and the memory bound of
``tests/test_checkpoint_memory.py``. Linux only (it reads ``/proc``).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

_PROC = Path("/proc")


def owned_bytes(pid: int) -> int:
    """``RssAnon + RssShmem`` of one process in bytes (0 when it has exited or is a zombie)."""
    try:
        text = (_PROC / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    total = 0
    for line in text.splitlines():
        if line.startswith(("RssAnon:", "RssShmem:")):
            total += int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    return total


def _parents() -> Dict[int, int]:
    """``{pid: parent pid}`` of every process visible in ``/proc``."""
    out = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it
        out[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return out


def process_tree(root: int) -> List[int]:
    """``root`` and all its descendants alive now."""
    children: Dict[int, List[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _name(pid: int) -> str:
    """The process's command line, shortened (``python tools/reshard.py``), for reports."""
    try:
        argv = (_PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return str(pid)
    words = [Path(a.decode(errors="replace")).name for a in argv[:2] if a]
    return " ".join(words) or str(pid)


class OwnedMemorySampler:
    """A thread that samples the owned bytes of ``root``'s process tree every ``interval_s``.

    ``peak_bytes`` is the largest tree sum seen; ``peak_by_pid`` what each process owned in
    that sample (to say where the peak was). Starting and stopping: ``with`` or
    :meth:`start` / :meth:`stop` (which takes one last sample).
    """

    def __init__(self, root: int, interval_s: float = 0.1) -> None:
        self.root = root
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.peak_by_pid: Dict[int, int] = {}
        self.names: Dict[int, str] = {}
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="owned-memory", daemon=True)

    def sample(self) -> int:
        """One sample of the tree now; updates the peak. Returns the tree's owned bytes."""
        by_pid = {pid: owned_bytes(pid) for pid in process_tree(self.root)}
        total = sum(by_pid.values())
        for pid in by_pid:
            if pid not in self.names:
                self.names[pid] = _name(pid)
        self.num_samples += 1
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_by_pid = total, by_pid
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            self.sample()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - start)))

    def start(self) -> "OwnedMemorySampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def __enter__(self) -> "OwnedMemorySampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def peak_by_name(self) -> Dict[str, int]:
        """The peak sample's bytes per process, keyed ``"<pid> <command>"``, largest first."""
        return {f"{pid} {self.names.get(pid, '')}": n
                for pid, n in sorted(self.peak_by_pid.items(), key=lambda kv: -kv[1]) if n}


@dataclass
class MeasuredRun:
    """What :func:`run_measured` saw."""

    returncode: int
    wall_s: float
    peak_bytes: int
    """Largest sum of RssAnon + RssShmem over the command's process tree in one sample."""
    peak_by_name: Dict[str, int] = field(default_factory=dict)
    num_samples: int = 0
    output: str = ""
    """stdout and stderr together (when captured)."""


def run_measured(cmd: Sequence[str], env: Optional[Mapping[str, str]] = None,
                 cwd: Optional[str] = None, timeout_s: Optional[float] = None,
                 interval_s: float = 0.1, capture: bool = True,
                 log_path: Optional[str] = None) -> MeasuredRun:
    """Run ``cmd`` to its end, sampling its process tree; a timeout kills the process (its
    own children, e.g. torchrun's ranks, end with it) and raises ``subprocess.TimeoutExpired``.
    ``log_path``: stdout and stderr go to that file instead of a pipe (``output`` is then its
    text) — for commands that leave a daemon holding their output open (torch's
    ``torch_shm_manager`` lives as long as another process maps its shared memory), where
    waiting for the pipe to close would wait for that daemon."""
    start = time.monotonic()
    log_file = open(log_path, "w") if log_path else None
    out = log_file or (subprocess.PIPE if capture else None)
    proc = subprocess.Popen(list(cmd), env=dict(env) if env is not None else None, cwd=cwd,
                            stdout=out, stderr=subprocess.STDOUT if (capture or log_file) else None,
                            text=True)
    if log_file is not None:
        log_file.close()  # the child holds its own descriptor
    sampler = OwnedMemorySampler(proc.pid, interval_s).start()
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    finally:
        sampler.stop()
    if log_path:
        with open(log_path, errors="replace") as f:
            output = f.read()
    return MeasuredRun(proc.returncode, time.monotonic() - start, sampler.peak_bytes,
                       sampler.peak_by_name, sampler.num_samples, output or "")


def split_tree(root: int, is_branch: Callable[[int], bool]) -> Tuple[List[int], List[int]]:
    """``root``'s tree cut in two: the processes at or under one for which ``is_branch(pid)``
    holds (e.g. a server the command started), and all the others."""
    children: Dict[int, List[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    rest, branch = [], []
    todo = [(root, False)]
    while todo:
        pid, inside = todo.pop()
        inside = inside or (pid != root and is_branch(pid))
        (branch if inside else rest).append(pid)
        todo.extend((c, inside) for c in children.get(pid, []))
    return rest, branch


def command_line(pid: int) -> str:
    """The whole command line of ``pid`` ('' once it has exited)."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


class SplitMemorySampler:
    """Owned bytes of a command's tree in two parts (``split_tree``), sampled every
    ``interval_s``, each part's peak kept per phase: ``phase()`` is asked at every sample (say,
    the rows a run has logged so far) and names the phase the sample belongs to.

    ``peaks[phase]`` = ``{"main": bytes, "branch": bytes, "total": bytes}``, each the largest
    seen in that phase (the three need not come from one sample)."""

    def __init__(self, root: int, is_branch: Callable[[int], bool],
                 phase: Callable[[], str] = lambda: "run", interval_s: float = 0.1) -> None:
        self.root, self.is_branch, self.phase, self.interval_s = root, is_branch, phase, interval_s
        self.peaks: Dict[str, Dict[str, int]] = {}
        self.num_samples = 0
        self._branch_pids: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="split-memory", daemon=True)

    def _is_branch(self, pid: int) -> bool:
        if pid in self._branch_pids:
            return True
        if self.is_branch(pid):
            self._branch_pids.add(pid)
            return True
        return False

    def sample(self) -> Dict[str, int]:
        """One sample; returns ``{"main", "branch", "total"}`` bytes now."""
        rest, branch = split_tree(self.root, self._is_branch)
        now = {"main": sum(owned_bytes(p) for p in rest),
               "branch": sum(owned_bytes(p) for p in branch)}
        # the phase when the sample ends: a sample that spans a phase change may have read memory
        # of the new phase, so it must not count for the old one
        label = self.phase()
        now["total"] = now["main"] + now["branch"]
        peak = self.peaks.setdefault(label, {"main": 0, "branch": 0, "total": 0})
        for k, v in now.items():
            peak[k] = max(peak[k], v)
        self.num_samples += 1
        return now

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            self.sample()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - start)))

    def start(self) -> "SplitMemorySampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def overall(self, phases: Optional[Sequence[str]] = None) -> Dict[str, int]:
        """The largest of each part over ``phases`` (default: all)."""
        chosen = [v for k, v in self.peaks.items() if phases is None or k in phases]
        return {k: max((p[k] for p in chosen), default=0) for k in ("main", "branch", "total")}
