"""What a process holds open: its listening TCP sockets (each gloo device of a process group
has one, so they count the groups still alive) and all its descriptors by kind."""

from __future__ import annotations

import os
from collections import Counter
from typing import Dict

_LISTEN = "0A"  # TCP state in /proc/net/tcp


def listening_sockets() -> int:
    """This process's TCP sockets in the LISTEN state (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor, another thread's)
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    count += 1
    return count


def descriptor_kinds() -> Dict[str, int]:
    """Open descriptors by kind: ``socket``, ``pipe``, ``anon_inode`` or ``file``."""
    kinds: Counter = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        kinds["file" if target.startswith("/") else target.split(":")[0]] += 1
    return dict(kinds)
