"""Text rendering of plans for ``gspo-plan`` (and JSON-ready dicts for ``--json``)."""

from __future__ import annotations

from typing import List

from gspo_megatron.planner.hardware import GB
from gspo_megatron.planner.plan import Plan


def _gb(x: float) -> str:
    return f"{x / GB:7.1f} GB"


def layout_name(plan: Plan) -> str:
    """``TP2+SP PP1 EP8 ETP1 CP1 DP8 on 16 GPUs``."""
    lay = plan.layout
    split = ""
    if lay.first_stage_layers is not None:
        split = f" ({lay.first_stage_layers}/../{lay.last_stage_layers} layers)"
    return (f"TP{lay.tp}{'+SP' if lay.sp else ''} PP{lay.pp}{split} EP{lay.ep} ETP{lay.etp} "
            f"CP{lay.cp} DP{lay.dp} on {lay.world_size} GPUs")


def describe(plan: Plan, title: str) -> str:
    """Every term of one plan: learner, rollout, times, verdict."""
    hw, est, r, t = plan.hardware, plan.learner, plan.rollout, plan.times
    lines = [title, f"  learner  {layout_name(plan)}, recompute={plan.recompute}, "
                    f"{plan.max_tokens_per_micro_batch} tokens per micro-batch",
             f"  per GPU, pipeline stage {est.stage} (the most loaded):"]
    lines += [f"    {term.name:<48s}{_gb(term.bytes)}" for term in est.terms]
    lines.append(f"    {'= training peak':<48s}{_gb(est.training_bytes)}")
    if est.peak_moment != "training":
        lines.append(f"    {'peak is at ' + est.peak_moment:<48s}{_gb(est.peak_bytes)}")
    if est.host_bytes:
        lines.append(f"    {'optimizer state in host memory (per GPU)':<48s}{_gb(est.host_bytes)}"
                     f"   ({est.host_bytes * hw.gpus_per_node / GB:.0f} GB per node)")
    lines.append(f"    {'usable (GPU memory - reserved)':<48s}{_gb(hw.usable_bytes)}   "
                 f"{'fits' if plan.learner_fits else 'DOES NOT FIT'}, margin "
                 f"{plan.learner_margin_bytes / GB:.1f} GB")
    lines += [f"  rollout  {plan.num_servers} SGLang servers x TP{plan.server_tp}",
              f"    {'weights per GPU':<48s}{_gb(r.weights_bytes)}",
              f"    {'KV cache per GPU (mem_fraction_static)':<48s}{_gb(max(r.kv_cache_bytes, 0))}",
              f"    sequences of {r.seq_len} tokens per server: {r.max_sequences}"
              f"{'' if r.fits else '   DOES NOT FIT'}",
              *_colocated_lines(plan),
              f"  times per RL step (rough): learner {t.learner_s:.0f} s at MFU, rollout "
              f"{t.rollout_s:.0f} s ({t.rollout_tokens_per_s:,.0f} tokens/s), weight sync "
              f">= {t.weight_sync_floor_s:.1f} s"]
    return "\n".join(lines)


def _colocated_lines(plan: Plan) -> List[str]:
    """Each phase of a GPU shared by learner and server, in the trainer's order."""
    if not plan.colocated:
        return []
    usable = plan.hardware.usable_bytes
    lines = ["  colocated, per GPU, in the trainer's order (servers released before the learner "
             "is built):"]
    for phase in plan.colocated:
        verdict = "fits" if phase.total_bytes <= usable else "DOES NOT FIT"
        lines.append(f"    {phase.name:<56s}{_gb(phase.total_bytes)}   {verdict}")
    return lines


def ranking(plans: List[Plan], num_nodes: int) -> str:
    """The best plans on ``num_nodes`` nodes, each with the overrides that select it."""
    g = plans[0].hardware.gpus_per_node if plans else 8
    lines = [f"best layouts on {num_nodes} nodes x {g} GPUs:"]
    if not plans:
        return lines[0] + " none (no layout of the model on these nodes)"
    for i, p in enumerate(plans, 1):
        nodes = p.layout.world_size // g
        verdict = "fits" if p.fits else "DOES NOT FIT"
        host = (f" (+{p.learner.host_bytes * g / GB:.0f} GB host memory per node)"
                if p.learner.host_bytes else "")
        lines.append(
            f"  {i}. {verdict}: learner {nodes} node(s) {layout_name(p)}, recompute="
            f"{p.recompute}, {p.max_tokens_per_micro_batch} tokens/micro-batch; peak "
            f"{p.learner.peak_bytes / GB:.1f} GB{host}; rollout {p.num_servers} x "
            f"TP{p.server_tp}; step ~{p.step_s:.0f} s")
        lines.append(f"     {' '.join(p.overrides())}")
    return "\n".join(lines)


def as_dict(plan: Plan) -> dict:
    """The plan for ``--json``, sizes in GB."""
    return {"fits": plan.fits, "layout": layout_name(plan), "overrides": plan.overrides(),
            "learner": {"stage": plan.learner.stage, "peak_gb": plan.learner.peak_bytes / GB,
                        "peak_moment": plan.learner.peak_moment,
                        "terms_gb": {t.name: t.bytes / GB for t in plan.learner.terms},
                        "host_gb": plan.learner.host_bytes / GB},
            "rollout": {"weights_gb": plan.rollout.weights_bytes / GB,
                        "kv_cache_gb": plan.rollout.kv_cache_bytes / GB,
                        "max_sequences": plan.rollout.max_sequences},
            "colocated_gb": {p.name: p.total_bytes / GB for p in plan.colocated},
            "times_s": {"learner": plan.times.learner_s, "rollout": plan.times.rollout_s,
                        "weight_sync_floor": plan.times.weight_sync_floor_s}}
