"""Exactly reducible training metrics: ``[sum, count]`` tensors, merged over micro-batches and ranks.

Every loss returns its metrics as float64 tensors of two numbers. For an ordinary metric they are
``[sum, count]`` and the reported value is ``total sum / total count`` after merging all
micro-batches and ranks, so a mean over tokens stays a mean over tokens however the batch was
split (averaging per-micro-batch means would weight small micro-batches too much). A name ending
in ``_max`` or ``_min`` holds ``[value, count]`` and merges by max / min.

    totals = {}
    for mb in micro_batches:
        accumulate_metrics(totals, loss_fn(inputs, cfg).metrics)
    all_reduce_metrics(totals, group=dp_cp_group)   # every rank must hold the same names
    log(metrics_to_floats(totals))
"""

from __future__ import annotations

import zlib
from typing import Dict, Optional

import torch
import torch.distributed as dist

Metrics = Dict[str, torch.Tensor]


def reduce_kind(name: str) -> str:
    """``max``, ``min`` or ``mean``, from the metric's name suffix."""
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


def metric_mean(values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[sum, count]`` of ``values`` (where ``mask`` is True), float64, detached."""
    values = values.detach().to(torch.float64)
    if mask is not None:
        values = values[mask.bool()]
    return torch.stack([values.sum(), values.new_tensor(float(values.numel()))])


def metric_rows(names, sums: torch.Tensor, counts: torch.Tensor) -> Metrics:
    """Many ``[sum, count]`` metrics at once: ``names[i]`` gets ``[sums[i], counts[i]]``
    (float64, detached); one stack instead of one per metric."""
    pairs = torch.stack([sums.detach().to(torch.float64), counts.detach().to(torch.float64)], 1)
    if pairs.shape[0] != len(names):
        raise ValueError(f"{len(names)} metric names for {pairs.shape[0]} values")
    return dict(zip(names, pairs.unbind(0)))


def metric_max(values: torch.Tensor) -> torch.Tensor:
    """``[max, count]`` (``[-inf, 0]`` when empty)."""
    values = values.detach().to(torch.float64)
    top = values.max() if values.numel() else values.new_tensor(float("-inf"))
    return torch.stack([top, values.new_tensor(float(values.numel()))])


def metric_min(values: torch.Tensor) -> torch.Tensor:
    """``[min, count]`` (``[inf, 0]`` when empty)."""
    values = values.detach().to(torch.float64)
    low = values.min() if values.numel() else values.new_tensor(float("inf"))
    return torch.stack([low, values.new_tensor(float(values.numel()))])


def _merge(name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    kind = reduce_kind(name)
    if kind == "mean":
        return a + b
    pick = torch.maximum if kind == "max" else torch.minimum
    return torch.stack([pick(a[0], b[0]), a[1] + b[1]])


def accumulate_metrics(totals: Metrics, new: Metrics) -> Metrics:
    """Merge ``new`` into ``totals`` in place (and return it)."""
    for name, value in new.items():
        if value.shape != (2,):
            raise ValueError(f"metric {name!r} must be a [sum, count] tensor, got shape "
                             f"{tuple(value.shape)}")
        value = value.detach().to(torch.float64)
        totals[name] = value.clone() if name not in totals else _merge(name, totals[name], value)
    return totals


def _check_same_names(names: list, group, device: torch.device) -> None:
    """Refuse to reduce when ranks hold different metric names (it would mix values silently)."""
    digest = zlib.crc32("\n".join(names).encode()) & 0x7FFFFFFF
    probe = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    if int(probe[0]) != digest or int(probe[1]) != -digest:
        raise RuntimeError(f"ranks hold different metric names; this rank has {names}")


def all_reduce_metrics(metrics: Metrics, group=None) -> Metrics:
    """Reduce every metric over ``group`` in place: sums for means, max / min by name.

    At most six small all-reduces whatever the number of metrics. No-op without
    ``torch.distributed`` or on a group of one.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return metrics
    names = sorted(metrics)
    if metrics:
        device = metrics[names[0]].device
    else:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(group) == "nccl" else torch.device("cpu")
    _check_same_names(names, group, device)
    ops = {"mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    for kind, op in ops.items():
        chosen = [n for n in names if reduce_kind(n) == kind]
        if not chosen:
            continue
        stacked = torch.stack([metrics[n] for n in chosen])
        if kind == "mean":
            dist.all_reduce(stacked, op=op, group=group)
        else:
            values, counts = stacked[:, 0].contiguous(), stacked[:, 1].contiguous()
            dist.all_reduce(values, op=op, group=group)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
            stacked = torch.stack([values, counts], dim=1)
        for i, n in enumerate(chosen):
            metrics[n] = stacked[i]
    return metrics


def metrics_to_floats(metrics: Metrics) -> Dict[str, float]:
    """Plain floats: ``sum / count`` for means, the value for max / min; empty metrics are left out."""
    if not metrics:
        return {}
    names = sorted(metrics)
    table = torch.stack([metrics[n].detach().to(torch.float64) for n in names]).cpu().tolist()
    out: Dict[str, float] = {}
    for name, (value, count) in zip(names, table):
        if count <= 0:
            continue
        out[name] = value / count if reduce_kind(name) == "mean" else value
    return out
