"""One job at a time in a run directory: an exclusive lock file with its holder's identity.

Two jobs writing one run directory interleave ``metrics.jsonl`` and silently replace each
other's checkpoints and export. :class:`RunDirLock` creates ``<run_dir>/run.lock`` as an
exclusive hard link of a file already holding the host, PID, process start time, Slurm job id
and start time of its holder (atomic, also on NFS v3+ and Lustre, unlike ``flock`` across
nodes). A second job gets :class:`RunDirLockedError` naming that holder. A lock is stale, and taken over with a warning,
when its holder is this very Slurm job (a requeued job keeps its id) or ran on this host and
its process is gone (or the PID now belongs to a process started at another time). A stale lock
is deleted under a short takeover mutex (only if it still names the stale holder), and the new
lock is again created exclusively: of several jobs taking it over at once exactly one wins.

    with RunDirLock(run_dir):
        ...   # the lock file is removed on exit
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Dict, Optional

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
TORN_LOCK_AGE_S = 10.0
"""An unreadable lock file older than this was torn by a holder killed while writing it."""


class RunDirLockedError(RuntimeError):
    """Another live job holds the run directory."""


def _process_start_ticks(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (Linux), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may contain spaces, so split after its ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def holder_identity() -> Dict[str, Any]:
    """Who this process is, as written into the lock file."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start_ticks": _process_start_ticks(pid),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def describe_holder(holder: Dict[str, Any]) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return (f"PID {holder.get('pid')} on {holder.get('host')}{job}, started "
            f"{holder.get('started')}")


def stale_reason(holder: Dict[str, Any], me: Dict[str, Any]) -> Optional[str]:
    """Why the lock of ``holder`` may be taken over by ``me`` (None: it is live or unknown)."""
    if holder.get("slurm_job_id") and holder.get("slurm_job_id") == me.get("slurm_job_id"):
        return f"it belongs to this Slurm job ({me['slurm_job_id']}), requeued"
    if holder.get("host") != me["host"]:
        return None  # cannot look at another host's processes
    pid = holder.get("pid")
    if not isinstance(pid, int) or not _pid_alive(pid):
        return f"its process {pid} on this host is gone"
    recorded = holder.get("pid_start_ticks")
    if recorded is not None and _process_start_ticks(pid) not in (None, recorded):
        return f"PID {pid} now belongs to another process"
    return None


class RunDirLock:
    """Exclusive lock on a run directory for the lifetime of a job (context manager)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.identity = holder_identity()
        self.held = False

    def _create(self) -> bool:
        """Create the lock file with its holder already in it: written to a private file first,
        then hard-linked into place (``link`` fails if the lock exists, as ``O_EXCL`` does), so
        no other job ever reads it empty. Created empty and then written, a holder stopped in
        between (``SIGSTOP``, a busy machine) showed as "PID None" to the job it refused."""
        temp = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}")
        with open(temp, "w") as f:
            json.dump(self.identity, f)
        try:
            os.link(temp, self.path)
        except FileExistsError:
            return False
        finally:
            temp.unlink()
        return True

    def _read_holder(self) -> Dict[str, Any]:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):  # torn: a holder killed while writing it, or writing now
            return {"unreadable": True}

    def _unreadable_reason(self) -> Optional[str]:
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        return f"unreadable lock file, untouched for {age:.0f} s" if age > TORN_LOCK_AGE_S else None

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        removed = None
        for _ in range(50):  # lost races (another job created or took over first) retry
            if self._create():
                self.held = True
                if removed:
                    log.warning("took over the stale lock %s of %s: %s", self.path, *removed)
                return self
            holder = self._read_holder()
            if not holder:
                continue  # released between our two looks
            reason = (stale_reason(holder, self.identity) if "unreadable" not in holder
                      else self._unreadable_reason())
            if reason is None:
                raise RunDirLockedError(
                    f"{self.path.parent}: run directory is in use by {describe_holder(holder)} "
                    f"(lock file {self.path}); use another logging.run_dir, or delete the lock "
                    "file if that job is certainly gone")
            if self._remove_if_still(holder):
                removed = (describe_holder(holder), reason)
            time.sleep(0.01)
        raise RunDirLockedError(f"{self.path}: could not take the run directory's lock "
                                "(other jobs keep taking it)")

    def _remove_if_still(self, holder: Dict[str, Any]) -> bool:
        """Delete the lock file if it still holds ``holder`` (judged stale), under a takeover
        mutex so that no job deletes a lock another job has just created; then every taker
        races on ``O_EXCL`` creation and exactly one wins."""
        mutex = self.path.with_name(LOCK_FILE + ".takeover")
        try:
            os.close(os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:  # a taker killed inside this short section leaves the mutex behind
                if time.time() - mutex.stat().st_mtime > TORN_LOCK_AGE_S:
                    mutex.unlink()
            except FileNotFoundError:
                pass
            return False
        try:
            if self._read_holder() != holder:
                return False
            self.path.unlink()
            return True
        except FileNotFoundError:
            return False
        finally:
            mutex.unlink()

    def release(self) -> None:
        if self.held:
            try:
                if self._read_holder().get("pid") == self.identity["pid"]:
                    self.path.unlink()
            except FileNotFoundError:
                pass
            self.held = False

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
