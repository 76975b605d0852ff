"""Predicted weight-sync time of Qwen3-MoE: the floor, the old per-tensor gather, the staged one.

Method (docs/rollout.md shows the numbers). A sync is gather (learner side) + transport (learner
-> servers); both gathers end in the same bucketed broadcast, so they differ in how the bytes
reach the senders:

- **floor** = model bytes / link bandwidth: every server GPU must receive every byte through its
  NIC (a pipelined broadcast costs about one model transfer whatever the number of receivers).
- **old gather** (the code before issue 12): one step per canonical tensor (``n_canonical``):
  a TP (or expert-TP) all-gather when the tensor is split, then a point-to-point send to global
  rank 0 when another rank holds it (experts of other EP ranks; layers of other pipeline
  stages), then rank 0 alone broadcasts every bucket. Cost = per-tensor Python work + one
  collective latency per collective + gathered bytes / NVLink (intra-node) or link (other node)
  + per bucket (HTTP round trip + bucket / link).
- **staged gather** (checkpoint/gather.py now): per pipeline stage, per bucket, one TP all-gather
  (dense) or one expert-TP + one EP all-gather (experts); the stage's first rank broadcasts its
  own buckets; stages go one after the other. Cost = per-tensor Python work + one latency per
  bucket collective + gathered bytes / NVLink + per bucket (HTTP + bucket / link).

Hardware constants are inputs (:class:`Hardware`); ``python_per_tensor_s`` is measured by
``benchmarks/bench_weight_sync.py --measure-gather`` on this machine. Both gathers are assumed not
to overlap with the broadcast (neither implementation overlaps them).

    >>> b = QWEN3_30B_A3B.total_params() * 2                    # bf16
    >>> round(b / 1e9, 1)
    61.1
    >>> round(b / 50e9, 2)                                      # floor at 50 GB/s
    1.22
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

from gspo_megatron.planner.model_shape import ModelShape

QWEN3_30B_A3B = ModelShape(hidden_size=2048, num_layers=48, num_experts=128,
                           moe_ffn_hidden_size=768, moe_router_topk=8, ffn_hidden_size=6144,
                           num_attention_heads=32, num_query_groups=4, head_dim=128,
                           vocab_size=151936, tie_word_embeddings=False)
"""Architecture of Qwen3-30B-A3B (its config.json); parameters counted by the planner's
:class:`ModelShape`, the one parameter count of the project."""


@dataclass(frozen=True)
class LearnerLayout:
    """Parallel layout of the learner (configs/qwen3_30b_a3b_gspo.yaml by default)."""

    tp: int = 2
    pp: int = 1
    ep: int = 8
    etp: int = 1
    gpus_per_node: int = 8


@dataclass(frozen=True)
class Hardware:
    link_gb_per_s: float = 50.0
    """Learner -> server GPU (one 400 Gb/s NIC per GPU)."""
    nvlink_gb_per_s: float = 350.0
    """Achieved intra-node all-gather / point-to-point bandwidth (H100 NVLink: 450 GB/s per direction)."""
    collective_latency_s: float = 50e-6
    """Launch + completion of one small NCCL collective or send/recv, with its Python call."""
    http_round_trip_s: float = 5e-3
    """One update_weights_from_distributed call per bucket (servers answer in parallel)."""
    python_per_tensor_s: float = 100e-6
    """Slicing, un-fusing and bookkeeping of one canonical tensor (measure it: see module doc)."""


def tensor_counts(cfg: ModelShape) -> Dict[str, int]:
    """Canonical (Megatron) tensors by kind, and HF tensors, of a Qwen3-MoE model."""
    layers, experts = cfg.num_layers, cfg.num_experts
    dense_split = 2 + layers * 2  # embedding, output layer; per layer QKV and proj
    replicated = 1 + layers * 5   # final norm; input / pre-MLP norm, q / k norm, router
    expert = layers * experts * 2  # fc1 (gate+up) and fc2 per expert
    hf = 2 + 1 + layers * (3 + 1 + 2 + 2 + 1 + experts * 3)
    return {"dense_split": dense_split, "replicated": replicated, "expert": expert,
            "canonical": dense_split + replicated + expert, "hf": hf}


def _bytes(cfg: ModelShape, dtype_bytes: int) -> Dict[str, float]:
    total = cfg.total_params() * dtype_bytes
    expert = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size * \
        dtype_bytes
    return {"total": total, "expert": expert, "dense": total - expert}


def predict(cfg: ModelShape = QWEN3_30B_A3B, layout: LearnerLayout = LearnerLayout(),
            hw: Hardware = Hardware(), bucket_bytes: int = 1 << 30,
            dtype_bytes: int = 2) -> Dict[str, float]:
    """Seconds: ``floor``, ``old`` and ``staged`` syncs, and their terms (see module doc)."""
    n = tensor_counts(cfg)
    b = _bytes(cfg, dtype_bytes)
    link, nvl = hw.link_gb_per_s * 1e9, hw.nvlink_gb_per_s * 1e9
    buckets = math.ceil(b["total"] / bucket_bytes)
    send = buckets * hw.http_round_trip_s + b["total"] / link
    python = n["canonical"] * hw.python_per_tensor_s

    # old: per-tensor collectives; experts of the other EP ranks, layers of later stages -> rank 0
    tp_gathers = (n["dense_split"] if layout.tp > 1 else 0) + (n["expert"] if layout.etp > 1 else 0)
    remote_experts = n["expert"] * (1 - 1 / layout.ep)
    later_stages = (n["canonical"] - n["expert"]) * (1 - 1 / layout.pp)
    # Megatron's expert ranks are contiguous (etp innermost): an EP group spans etp * ep GPUs
    ep_span_nodes = layout.etp * layout.ep > layout.gpus_per_node
    old_p2p_bytes = b["expert"] * (1 - 1 / layout.ep)
    old_link_bytes = b["total"] * (1 - 1 / layout.pp) + (old_p2p_bytes if ep_span_nodes else 0)
    old_gather = ((tp_gathers + remote_experts + later_stages) * hw.collective_latency_s
                  + (old_p2p_bytes if not ep_span_nodes else 0) / nvl + old_link_bytes / link)

    # staged: one collective per bucket (two for experts with expert TP), within each stage
    dense_buckets = math.ceil(b["dense"] / bucket_bytes)
    expert_buckets = math.ceil(b["expert"] / bucket_bytes)
    collectives = (dense_buckets if layout.tp > 1 else 0) + expert_buckets * (1 + (layout.etp > 1))
    staged_gather = (collectives * hw.collective_latency_s
                     + old_p2p_bytes / (link if ep_span_nodes else nvl))
    return {"bytes": b["total"], "buckets": buckets, "floor": b["total"] / link,
            "old_collectives": tp_gathers + remote_experts + later_stages,
            "staged_collectives": collectives, "python": python, "send": send,
            "old_gather": old_gather, "staged_gather": staged_gather,
            "old": python + old_gather + send, "staged": python + staged_gather + send}
