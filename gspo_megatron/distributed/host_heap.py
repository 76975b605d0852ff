"""Give the C heap's free pages back to the operating system (glibc ``malloc_trim``).

On CPU every tensor lives in the process heap. glibc serves allocations below its dynamic
``mmap`` threshold (up to 32 MiB once large blocks have been freed) from heap arenas, and a
freed block inside an arena stays resident until ``malloc_trim`` returns its pages. The learner
frees such blocks in bulk: building DDP's buffers copies every trained weight into one buffer
and frees the originals (at Qwen3-30B-A3B's widths 128 experts x 3 matrices of 3-6 MB each), and
every step frees its activations and gradients. Measured there (``docs/real_geometry.md``), the
learner process kept 0.6-1.9 GiB of freed heap above its live tensors, varying from run to run;
a trim after building and after each update takes 5-50 ms and returns it.

    trim_host_heap()   # True when glibc trimmed; False elsewhere (musl, macOS) or on a GPU run
    resident_bytes()   # the process's resident set now
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Optional

log = logging.getLogger(__name__)


def resident_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``; 0 where there is none): what a
    checkpoint save reports as its host-memory high-water mark."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Optional[object]:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_host_heap() -> bool:
    """Return the heap's free pages to the OS; whether glibc's ``malloc_trim`` ran."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
