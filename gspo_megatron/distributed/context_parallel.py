"""Context parallelism (CP) index math: which positions of a sequence each CP rank holds.

Pure torch, no process groups, so both the learner (which cuts micro-batches into CP shares,
``learner/batch.py``) and the model (whose local CP attention and RoPE slice by the same indices,
``model/context_parallel_attention.py``) import it from this floor below them.

Megatron's convention (``megatron.core.utils.get_batch_on_this_cp_rank``): a sequence is cut into
``2 * cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, so every rank
gets the same amount of causal-attention work (an early chunk is cheap, a late one expensive).

- ``rows`` layout (local attention, CPU): every row ``[L]`` is one sequence padded to ``L``, a
  multiple of ``2 * cp``; each rank keeps the columns :func:`load_balanced_indices` of every row.
  Megatron's RoPE slices its position table with the same indices.
- ``packed`` layout (Transformer Engine THD, GPU): one row of concatenated sequences, each padded
  to a multiple of ``2 * cp`` (:func:`padded_boundaries`, ``cu_seqlens_padded``); each rank keeps
  chunks ``r`` and ``2 * cp - 1 - r`` of *every sequence* (:func:`thd_partition_indices`, the
  pure-torch equivalent of TE's ``thd_get_partitioned_indices``).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} is not in [0, cp_size={cp_size})")


def load_balanced_indices(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 ``[length // cp_size]``: the positions of a row of ``length`` held by ``cp_rank``."""
    _check_rank(cp_size, cp_rank)
    if length % (2 * cp_size):
        raise ValueError(f"a row of {length} tokens cannot be split into 2*cp = {2 * cp_size} "
                         "equal chunks; pad it to a multiple of 2*cp")
    chunk = length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    last_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(last_start, last_start + chunk)])


def padded_boundaries(lengths: Sequence[int], multiple: int) -> Tuple[List[int], List[int]]:
    """``cu_seqlens`` of the real lengths and ``cu_seqlens_padded`` of the lengths rounded up to
    ``multiple`` (what TE's THD attention needs under CP: each sequence splits into 2*cp chunks)."""
    real, padded = [0], [0]
    for n in lengths:
        real.append(real[-1] + n)
        padded.append(padded[-1] + -(-n // multiple) * multiple)
    return real, padded


def thd_partition_indices(cu_seqlens_padded: Sequence[int], cp_size: int,
                          cp_rank: int) -> torch.Tensor:
    """int64 ``[S // cp_size]``: positions of a packed row held by ``cp_rank``, sequence by
    sequence.

    ``cu_seqlens_padded`` ``[num_seqs + 1]`` are the padded boundaries; every padded length must be
    a multiple of ``2 * cp_size``.
    """
    _check_rank(cp_size, cp_rank)
    bounds = [int(b) for b in cu_seqlens_padded]
    parts = []
    for k in range(len(bounds) - 1):
        length = bounds[k + 1] - bounds[k]
        if length % (2 * cp_size):
            raise ValueError(f"packed sequence {k} has padded length {length}, not a multiple of "
                             f"2*cp = {2 * cp_size}")
        if length:
            parts.append(bounds[k] + load_balanced_indices(length, cp_size, cp_rank))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def load_balanced_causal_mask(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """bool ``[1, 1, length // cp, length]``, True where *not* allowed (Megatron's convention).

    Queries are this rank's positions (:func:`load_balanced_indices`); keys are the whole row in
    the order an all-gather over the CP group returns them (rank 0's positions, then rank 1's...).
    """
    queries = load_balanced_indices(length, cp_size, cp_rank)
    keys = torch.cat([load_balanced_indices(length, cp_size, r) for r in range(cp_size)])
    return (keys[None, :] > queries[:, None]).view(1, 1, queries.numel(), keys.numel())


def response_token_index(seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """int64 ``[N]``: index of each response token inside its sequence's response (full batch:
    tokens of a sequence are contiguous and in order)."""
    counts = torch.bincount(seq_index, minlength=num_seqs)
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(seq_index.numel()) - starts[seq_index]
