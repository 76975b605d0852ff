"""Which sequences go to which data-parallel rank and micro-batch: integer bin packing.

Steps 1 and 2 of ``learner/batch.py``: :func:`split_across_dp` balances *token* counts across DP
ranks (longest first onto the lightest rank), :func:`pack_by_tokens` fills micro-batches of at
most ``batch.max_tokens_per_micro_batch`` tokens (first-fit-decreasing). Both are deterministic,
so every rank computes the same plan from the same mini-batch without communicating.
"""

from __future__ import annotations

from typing import List, Sequence


def split_across_dp(lengths: Sequence[int], dp_size: int) -> List[List[int]]:
    """Sequence indices per DP rank, balancing token counts (longest first onto lightest rank).

    Deterministic: ties go to the lower rank, so every process computes the same split.
    """
    loads = [0] * dp_size
    shares: List[List[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(s) for s in shares]


def pack_by_tokens(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> List[List[int]]:
    """First-fit-decreasing packing of sequences into bins of at most ``max_tokens`` tokens."""
    bins: List[List[int]] = []
    loads: List[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        if lengths[i] > max_tokens:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than "
                             f"batch.max_tokens_per_micro_batch={max_tokens}")
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]
