"""Expand a Slurm host list (``node[01-04,07],gpu5``) without ``scontrol``, for dry runs.

Inside a job the scripts ask ``scontrol show hostnames``; a dry run on a laptop or login node
has only the string. Supports one bracket group per name (ranges keep their zero padding),
which is what Slurm prints for a job's ``SLURM_JOB_NODELIST`` on flat node names.
"""

from __future__ import annotations

import re
from typing import List

_GROUP = re.compile(r"^([^\[\],]*)\[([^\]]+)\](.*)$")


def _split_top_level(text: str) -> List[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            raise ValueError(f"host list '{text}': unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list '{text}': unbalanced '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def expand_hostlist(text: str) -> List[str]:
    """``'n[1-3],m'`` -> ``['n1', 'n2', 'n3', 'm']``; a ValueError names the bad part."""
    hosts: List[str] = []
    for part in _split_top_level(text.strip()):
        match = _GROUP.match(part)
        if not match:
            if "[" in part or "]" in part:
                raise ValueError(f"host list '{text}': cannot read '{part}'")
            hosts.append(part)
            continue
        prefix, body, suffix = match.groups()
        if "[" in suffix:
            raise ValueError(f"host list '{text}': one bracket group per name is supported ('{part}')")
        for item in body.split(","):
            lo, sep, hi = item.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise ValueError(f"host list '{text}': bad range '{item}'")
            width = len(lo)
            for n in range(int(lo), int(hi if sep else lo) + 1):
                hosts.append(f"{prefix}{n:0{width}d}{suffix}")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"host list '{text}': a host appears twice")
    return hosts
