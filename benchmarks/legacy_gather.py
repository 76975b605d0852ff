"""The per-tensor gather this project used before issue 12, kept only to be measured against.

For each canonical parameter, in HF order: the ranks holding it all-gather its TP slices, the
lowest holding rank sends the full tensor to global rank 0 (point to point), and rank 0 yields the
HF pairs. A table of every rank's units is all-gathered first (every sync). Use
``checkpoint.gather.iter_hf_buckets`` for real work; ``bench_weight_sync.py --measure-gather``
times both in the same run.
"""

from __future__ import annotations

from typing import Iterator, Sequence, Tuple

import torch
import torch.distributed as dist

from gspo_megatron.checkpoint import mapping
from gspo_megatron.checkpoint.local_params import iter_local_units


def _full_shape(unit) -> Tuple[int, ...]:
    shape = list(unit.tensor.shape)
    if unit.spec.dim is not None:
        shape[unit.spec.dim] *= unit.tp_size
    return tuple(shape)


def _gather_tp(unit) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if unit.tp_size == 1:
        return unit.tensor
    group = (ps.get_expert_tensor_parallel_group() if unit.spec.expert
             else ps.get_tensor_model_parallel_group())
    local = unit.tensor.contiguous()
    parts = [torch.empty_like(local) for _ in range(unit.tp_size)]
    dist.all_gather(parts, local, group=group)
    return mapping.unshard(parts, unit.spec)


def legacy_iter_hf_tensors(model_chunks: Sequence[torch.nn.Module], cfg) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` on rank 0, one canonical tensor at a time (every rank must exhaust it)."""
    units = {u.name: u for c in model_chunks for u in iter_local_units(c, cfg)
             if mapping.is_exported(u.name, cfg)}
    local = {n: (_full_shape(u), u.tensor.dtype) for n, u in units.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    rank = dist.get_rank()
    for name in mapping.canonical_names(cfg):
        src = next(r for r, info in enumerate(everyone) if name in info)
        shape, dtype = everyone[src][name]
        full = _gather_tp(units[name]) if name in units else None
        if src != 0:
            if rank == src:
                dist.send(full.contiguous(), 0)
            elif rank == 0:
                full = torch.empty(shape, dtype=dtype)
                dist.recv(full, src)
        if rank == 0:
            yield from mapping.megatron_to_hf(name, full, cfg)
