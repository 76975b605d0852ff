"""Enumerate the layouts that fit N nodes and rank them.

For every split of the nodes into learner and rollout nodes (disaggregated, as the production
scripts run): the rollout nodes get the SGLang server TP (configured, or another power of two up
to a node) with the highest estimated throughput whose KV cache holds a sequence; every learner
layout Megatron-Core accepts for the model (TP within a node dividing the attention and KV heads,
PP with an even or the suggested uneven split, EP dividing the experts, ETP 1 or TP, CP 1 or 2,
SP with TP) gets the least recomputation, then the largest micro-batch budget (twice, equal to or
half the configured one), that fits. Fitting plans come first, those with at least 10% of the
usable memory to spare before tighter ones, each ordered by estimated RL-step time (at the
config's ``rollout.max_staleness``, ``timing.step_seconds``); ties prefer
less recomputation, smaller model-parallel groups, then memory margin.

The optimizer options (precision-aware optimizer, CPU offload) stay as configured unless
``search_optimizer`` asks to try them too. Pure Python; the 30B config on 8 nodes takes well
under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Iterator, List, Optional, Tuple

from gspo_megatron.config.pipeline_split import (PipelineSplitError, stage_layer_counts,
                                                 suggest_uneven_split)
from gspo_megatron.planner.hardware import Hardware
from gspo_megatron.planner.learner_memory import estimate_learner
from gspo_megatron.planner.model_shape import Layout, ModelShape
from gspo_megatron.planner.plan import Plan, model_shape, plain_config, plan_layout, workload
from gspo_megatron.planner.precision import Precision
from gspo_megatron.planner.rollout_memory import RolloutEstimate, estimate_rollout

RECOMPUTE_ORDER = ("none", "selective", "full")
COMFORT_MARGIN = 0.1
"""Plans leaving less than this share of usable memory free rank after roomier ones: routing
imbalance and allocator fragmentation are not in the estimate."""


@dataclass(frozen=True)
class OptimizerVariant:
    """An optimizer choice to try: its overrides and what it costs per parameter."""

    name: str
    overrides: Tuple[str, ...]
    precision: Precision


def optimizer_variants(base: Precision, search: bool) -> List[OptimizerVariant]:
    """The configured optimizer, plus (``search``) bf16-moment precision-aware and CPU offload."""
    variants = [OptimizerVariant("as configured", (), base)]
    if not search or base.param_bytes != 2:
        return variants
    if base.moment_bytes != 4 or base.offload_fraction:
        variants.append(OptimizerVariant(
            "precision-aware, bf16 moments",
            ("optimizer.precision_aware=true", "optimizer.moments_dtype=bf16",
             "optimizer.cpu_offload=false"),
            replace(base, main_param_bytes=2, moment_bytes=4, offload_fraction=0.0)))
    if base.offload_fraction < 1.0:
        variants.append(OptimizerVariant(
            "CPU offload", ("optimizer.cpu_offload=true", "optimizer.offload_fraction=1.0",
                            "optimizer.moments_dtype=fp32"),
            replace(base, main_param_bytes=4, moment_bytes=8, offload_fraction=1.0)))
    return variants


def _divisors(n: int, limit: int) -> List[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d <= limit and n % d == 0]


def learner_layouts(shape: ModelShape, world: int, gpus_per_node: int) -> Iterator[Layout]:
    """Every layout of ``world`` learner GPUs that Megatron-Core can build for ``shape``."""
    for tp in _divisors(shape.num_attention_heads, gpus_per_node):
        if shape.num_query_groups % tp:
            continue
        for pp in _divisors(world // tp, min(shape.num_layers, world)):
            split: Tuple[Optional[int], Optional[int]] = (None, None)
            if shape.num_layers % pp:
                try:
                    split = suggest_uneven_split(shape.num_layers, pp) or (None, None)
                    stage_layer_counts(shape.num_layers, pp, *split)
                except PipelineSplitError:
                    continue
            for cp in (1, 2):
                if world % (tp * pp * cp):
                    continue
                for ep in _divisors(shape.num_experts, world // pp) if shape.is_moe else [1]:
                    for etp in sorted({1, tp}) if shape.is_moe else [1]:
                        if world % (ep * etp * pp):
                            continue
                        yield Layout(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, sp=tp > 1,
                                     world_size=world, first_stage_layers=split[0],
                                     last_stage_layers=split[1])


def micro_batch_budgets(cfg) -> List[int]:
    """Twice, equal to and half the configured budget (largest first), each >= one sequence."""
    base = cfg.batch.max_tokens_per_micro_batch
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    return sorted({b for b in (base // 2, base, base * 2) if b >= longest}, reverse=True)


def best_rollout(cfg, hw: Hardware, shape: ModelShape,
                 num_nodes: int) -> Optional[Tuple[int, int, RolloutEstimate]]:
    """(server TP, servers, estimate) of the fastest fleet on ``num_nodes`` rollout nodes."""
    seq_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    best, best_rate = None, -1.0
    dp = cfg.rollout.sglang.dp  # a server uses tp * dp devices of one node
    for tp in sorted({cfg.rollout.sglang.tp, 1, 2, 4, 8}):
        servers = num_nodes * (hw.gpus_per_node // (tp * dp))
        if servers < 1:
            continue
        est = estimate_rollout(shape, tp, cfg.rollout.sglang.mem_fraction_static, seq_len, hw)
        if not est.fits:
            continue
        batch = min(est.max_sequences, cfg.rollout.sglang.max_concurrency_per_server)
        rate = servers * batch / (est.weights_bytes + batch * seq_len / 2 * est.kv_bytes_per_token)
        if rate > best_rate or (rate == best_rate and tp == cfg.rollout.sglang.tp):
            best, best_rate = (tp, servers, est), rate
    return best


def search(cfg, hw: Hardware, num_nodes: int, *, top: int = 5, search_optimizer: bool = False,
           learner_nodes: Optional[Iterable[int]] = None) -> List[Plan]:
    """The ``top`` best plans for ``num_nodes`` nodes (fitting ones first)."""
    cfg = plain_config(cfg)
    shape = model_shape(cfg)
    base = Precision.from_config(cfg, on_gpu=cfg.model.transformer_impl != "local")
    variants = optimizer_variants(base, search_optimizer)
    budgets = micro_batch_budgets(cfg) or [cfg.batch.max_tokens_per_micro_batch]
    plans: List[Plan] = []
    splits = list(learner_nodes) if learner_nodes is not None else range(1, num_nodes)
    for n_learn in splits:
        fleet = best_rollout(cfg, hw, shape, num_nodes - n_learn)
        if n_learn < 1 or fleet is None:
            continue
        server_tp, servers, rollout = fleet
        for layout in learner_layouts(shape, n_learn * hw.gpus_per_node, hw.gpus_per_node):
            for var in variants:
                choice = _least_recompute_that_fits(cfg, hw, shape, layout, var.precision, budgets)
                recompute, budget, learner = choice
                plans.append(plan_layout(cfg, hw, layout, recompute=recompute, max_tokens=budget,
                                         num_servers=servers, server_tp=server_tp,
                                         precision=var.precision, shape=shape,
                                         extra_overrides=list(var.overrides), learner=learner,
                                         rollout=rollout))
    plans.sort(key=_key)
    return plans[:top]


def _least_recompute_that_fits(cfg, hw, shape, layout, precision, budgets):
    """(recompute, budget, estimate); the last tried (full, smallest) when nothing fits."""
    for recompute in RECOMPUTE_ORDER:
        for budget in budgets:
            est = estimate_learner(shape, layout, precision,
                                   workload(cfg, layout, shape, budget, recompute))
            if est.peak_bytes <= hw.usable_bytes:
                return recompute, budget, est
    return recompute, budget, est


def _key(plan: Plan):
    lay = plan.layout
    tight = plan.learner_margin_bytes < COMFORT_MARGIN * plan.hardware.usable_bytes
    return (not plan.fits, tight, round(plan.step_s, 1), RECOMPUTE_ORDER.index(plan.recompute),
            lay.tp * lay.pp * lay.cp, -plan.learner_margin_bytes)
