"""Ports picked now and bound later by another process: a rollout server's, a rendezvous'.

A port from ``bind((host, 0))`` comes from the kernel's ephemeral range, which is also where the
local port of every outgoing connection and every other ``bind(0)`` on the machine come from.
Between the pick and the later bind (a real SGLang server on CPU binds its HTTP port 15-20 s
after its launch) the kernel may hand the same port to anyone: fresh clone 14 lost a real-server
start to "address already in use" that way. Below the ephemeral range only a process that names
a port takes it; a reservation file shared by the processes of this machine keeps two of our own
pickers (tests, tools and trainers running side by side) from naming the same one while it waits
to be bound. Others below the range that ours stay clear of: SGLang 0.5.23's internal ports,
22000-29999 (``get_free_port_below_ephemeral`` in ``sglang/srt/utils/network.py``); a Slurm
job's default ``MASTER_PORT``, 20000 + job id (``distributed/runtime.py``); the local Slurm
clusters of the tests, 17817-17859.
"""

from __future__ import annotations

import contextlib
import fcntl
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, Optional

LOW, HIGH = 10000, 17499
"""Where picked ports come from: below the default ephemeral range (32768-60999) and below the
fixed ports named above."""

RESERVE_S = 600.0
"""How long a picked port stays reserved for the process that will bind it."""

REGISTRY = Path(tempfile.gettempdir()) / "gspo-megatron-ports"
"""One line per reserved port, ``PORT EPOCH_SECONDS``, read and written under ``flock``."""


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port the kernel hands out to ``bind(0)`` and ``connect``."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` now (no listener, no connection holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _reservations(registry: Optional[Path], now: float, reserve_s: float) -> Iterator[Dict[int, float]]:
    """The ports reserved less than ``reserve_s`` ago, held under the registry's lock; what the
    caller adds is written back. A registry that cannot be opened (a read-only temp dir) leaves
    the pick to the bind check alone."""
    try:
        handle = open(registry, "a+") if registry is not None else None
    except OSError:
        handle = None
    if handle is None:
        yield {}
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        reserved: Dict[int, float] = {}
        for line in handle.read().splitlines():
            fields = line.split()
            try:
                port, at = int(fields[0]), float(fields[1])
            except (IndexError, ValueError):
                continue  # a line cut by a crash: that reservation is lost, nothing else
            if now - at < reserve_s:
                reserved[port] = at
        yield reserved
        handle.seek(0)
        handle.truncate()
        handle.write("".join(f"{port} {at:.3f}\n" for port, at in sorted(reserved.items())))
        handle.flush()


def free_port(host: str = "127.0.0.1", *, low: int = LOW, high: int = HIGH,
              registry: Optional[Path] = REGISTRY, reserve_s: float = RESERVE_S) -> int:
    """A port of ``host`` that nothing holds now, below the ephemeral range, not handed out by
    this function (in any process of this machine) in the last ``reserve_s`` seconds.

    Raises ``RuntimeError`` naming the range when every port in it is taken or reserved."""
    host = "127.0.0.1" if host == "localhost" else host
    high = min(high, ephemeral_low() - 1)
    if high < low:
        raise RuntimeError(f"no ports to pick from: {low}-{high} (the kernel's ephemeral range, "
                           "/proc/sys/net/ipv4/ip_local_port_range, starts below it)")
    now = time.time()
    with _reservations(registry, now, reserve_s) as reserved:
        num_ports = high - low + 1
        first = random.SystemRandom().randrange(num_ports)  # not the seeded `random` of a run
        for port in (low + (first + i) % num_ports for i in range(num_ports)):
            if port not in reserved and _bindable(host, port):
                reserved[port] = now
                return port
    raise RuntimeError(f"no free port on {host} in {low}-{high}: each is taken or was handed out "
                       f"in the last {reserve_s:.0f} s (see {registry})")

