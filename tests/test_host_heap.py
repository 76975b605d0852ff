"""``distributed/host_heap.py``: on glibc, freed heap blocks below the mmap threshold stay
resident until the trim, which gives them back."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import ctypes, sys
from benchmarks.owned_memory import owned_bytes
from gspo_megatron.distributed.host_heap import trim_host_heap
import os, torch
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD: 4 MB blocks come from the heap, as after a free
keep, spare = [], []
for i in range(100):  # interleaved: the freed ones are not at the heap's top
    (spare if i % 2 else keep).append(torch.ones(2**20))  # 4 MB each
before = owned_bytes(os.getpid())
del spare
freed = owned_bytes(os.getpid())
assert trim_host_heap()
after = owned_bytes(os.getpid())
print((before - freed) / 2**20, (freed - after) / 2**20)
"""


def test_trim_returns_freed_heap_blocks():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=120, check=True)
    kept_after_free, returned_by_trim = map(float, out.stdout.split())
    assert kept_after_free < 20  # the free alone returns (almost) nothing: 200 MB stay resident
    assert returned_by_trim > 150  # the trim gives most of the 200 MB back
