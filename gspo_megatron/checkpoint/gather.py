"""Gather a distributed Megatron model into full Hugging Face tensors, one tensor at a time.

``iter_hf_tensors(model_chunks, model_cfg, dst="rank0" | "all")`` is a generator that every rank
must run to the end (it issues collectives). For each canonical parameter, in HF checkpoint order:
the ranks holding it all-gather its TP (or expert-TP) slices, the lowest holding rank then sends
the full tensor to rank 0 (``dst="rank0"``) or broadcasts it to every rank (``dst="all"``), and
the receiving ranks yield the HF ``(name, tensor)`` pairs (QKV and gate/up un-fused, vocabulary
padding cut). Only one full tensor is alive at a time, so memory stays bounded; export writes the
pairs to safetensors shards and the learner -> rollout weight sync streams the same pairs.

Yielded tensors may be views of live parameters (no copy when nothing had to be gathered):
consume or copy them before the model changes.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gspo_megatron.checkpoint import mapping
from gspo_megatron.checkpoint.local_params import LocalUnit, iter_local_units
from gspo_megatron.config.schema import ModelConfig

_Info = Tuple[Tuple[int, ...], str]


def _full_shape(unit: LocalUnit) -> Tuple[int, ...]:
    shape = list(unit.tensor.shape)
    if unit.spec.dim is not None:
        shape[unit.spec.dim] *= unit.tp_size
    return tuple(shape)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def _tp_group(unit: LocalUnit):
    from megatron.core import parallel_state as ps

    return (ps.get_expert_tensor_parallel_group() if unit.spec.expert
            else ps.get_tensor_model_parallel_group())


def gather_tp(unit: LocalUnit) -> torch.Tensor:
    """Full canonical tensor from this rank's slice and its TP (or expert-TP) peers."""
    if unit.tp_size == 1:
        return unit.tensor
    local = unit.tensor.contiguous()
    parts = [torch.empty_like(local) for _ in range(unit.tp_size)]
    dist.all_gather(parts, local, group=_tp_group(unit))
    return mapping.unshard(parts, unit.spec)


def _plan(units: Dict[str, LocalUnit], cfg: ModelConfig) -> List[Tuple[str, int, _Info]]:
    """(name, source rank, (full shape, dtype)) for every exported parameter, same on all ranks."""
    local: Dict[str, _Info] = {n: (_full_shape(u), str(u.tensor.dtype)) for n, u in units.items()}
    everyone: List[Dict[str, _Info]] = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(everyone, local)
    plan = []
    for name in mapping.canonical_names(cfg):
        holders = [r for r, info in enumerate(everyone) if name in info]
        if not holders:
            raise mapping.MappingError(f"no rank holds '{name}': the model does not match the "
                                       "config it was exported with")
        plan.append((name, holders[0], everyone[holders[0]][name]))
    return plan


def iter_hf_tensors(model_chunks: Sequence[torch.nn.Module], model_cfg: ModelConfig,
                    parallel_cfg: Optional[object] = None,
                    dst: str = "rank0") -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` on rank 0 (``dst="rank0"``) or on every rank (``"all"``).

    ``parallel_cfg`` is accepted for symmetry with conversion; the layout is read from Megatron's
    parallel state. Every rank must exhaust the generator.
    """
    if dst not in ("rank0", "all"):
        raise ValueError(f"dst must be 'rank0' or 'all', got {dst!r}")
    units = {u.name: u for chunk in model_chunks for u in iter_local_units(chunk, model_cfg)
             if mapping.is_exported(u.name, model_cfg)}
    multi = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if multi else 0
    device = next(iter(model_chunks[0].parameters())).device
    for name, src, (shape, dtype) in _plan(units, model_cfg):
        full = gather_tp(units[name]) if name in units else None
        if multi and dst == "all":
            if rank != src:
                full = torch.empty(shape, dtype=_dtype(dtype), device=device)
            full = full.contiguous()
            dist.broadcast(full, src)
        elif multi and src != 0:
            if rank == src:
                dist.send(full.contiguous(), 0)
            elif rank == 0:
                full = torch.empty(shape, dtype=_dtype(dtype), device=device)
                dist.recv(full, src)
        if dst == "all" or rank == 0:
            yield from mapping.megatron_to_hf(name, full, model_cfg)
