"""Text rendering of plans for ``gspo-plan`` (JSON-ready dicts for ``--json``, and the marked
section of ``docs/planner.md`` that ``--doc`` rewrites)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional

from gspo_megatron.config.errors import ConfigError
from gspo_megatron.planner.hardware import GB
from gspo_megatron.planner.plan import Plan
from gspo_megatron.planner.timing import (STALENESS_LEVELS, bound_by, longest_response_steps,
                                          requests_in_flight_at_sync, step_seconds,
                                          steps_per_second)

DOC_BEGIN = "<!-- gspo-plan --doc: begin (written by gspo-plan; do not edit) -->"
DOC_END = "<!-- gspo-plan --doc: end -->"


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
              f"{t.rollout_s:.0f} s at full concurrency ({t.rollout_tokens_per_s:,.0f} tokens/s), "
              f"{t.rollout_batch_s:.0f} s on-policy with its tail, weight sync "
              f">= {t.weight_sync_floor_s:.1f} s",
              *staleness_lines(plan)]
    return "\n".join(lines)


def staleness_rows(plan: Plan) -> List[Dict[str, object]]:
    """One row per staleness the config's engine and mode allow: the step, steps/s, the speed-up
    over on-policy, requests re-prefilled per server at a sync, what bounds the step, and the
    steps a longest response spans (``k >= 2``; more than k: its group is dropped as too old)."""
    t = plan.times
    rates = steps_per_second(t, plan.staleness_levels)
    base = step_seconds(t, 0)  # inf when no server holds a sequence: every rate is then 0
    return [{"k": k, "configured": k == plan.configured_staleness, "step_s": step_seconds(t, k),
             "steps_per_s": rate, "speedup": rate * base if rate else 0.0,
             "in_flight": requests_in_flight_at_sync(t, k), "bound_by": bound_by(t, k),
             "spans": longest_response_steps(t, k)}
            for k, rate in rates.items()]


def _spans(row: Dict[str, object]) -> str:
    if row["k"] < 2 or not math.isfinite(row["spans"]):
        return "-"
    return f"{row['spans']:.2f}" + (" (dropped: > k)" if row["spans"] > row["k"] else "")


def staleness_assumptions(plan: Plan) -> List[str]:
    """The terms the rows are made of, each marked modelled or assumed (docs/planner.md)."""
    t, n = plan.times, plan.num_servers
    return [
        f"modelled: learner {t.learner_s:.1f} s (FLOPs at plan.mfu); generation "
        f"{t.rollout_s:.1f} s at full concurrency ({t.concurrency:g} sequences per server, HBM "
        f"bandwidth), {t.rollout_batch_s:.1f} s on-policy with its tail ({t.tail_concurrency:.3g} "
        f"left per server), {t.longest_response_s:.1f} s for a longest response with the "
        f"servers kept full; weight sync {t.weight_sync_floor_s:.2f} s (link "
        f"bandwidth); re-prefill {t.reprefill_per_request_s * 1e3:.1f} ms per aborted request "
        f"per server (prefill FLOPs at plan.mfu on {n} servers x TP{plan.server_tp})",
        f"assumed: mean response {plan.lengths.mean_tokens:,.0f} tokens (plan.mean_response_frac), "
        f"the longest at the cap ({plan.lengths.max_tokens:,}), "
        f"{plan.lengths.truncated_frac:.0%} at the cap (plan.truncated_frac); pause + continue "
        f"{t.pause_s:g} s per sync (ASSUMED_PAUSE_PER_SYNC_S, a placeholder, not measured)"]


def staleness_lines(plan: Plan) -> List[str]:
    """The steps/s table of ``gspo-plan``'s report (``*``: the config's own k)."""
    lines = [f"  RL steps against rollout.max_staleness (k), {plan.num_servers} servers x "
             f"TP{plan.server_tp} for {plan.layout.world_size} learner GPUs (deterministic "
             f"model, planner/timing.py):"]
    lines += [f"    {text}" for text in staleness_assumptions(plan)]
    lines.append(f"    {'k':<4s}{'step s':>9s}{'steps/s':>10s}{'steps/h':>9s}{'vs k=0':>8s}"
                 f"{'re-prefilled':>14s}  {'bound by':<26s}longest response spans (steps)")
    for r in staleness_rows(plan):
        k = f"{r['k']}{'*' if r['configured'] else ''}"
        lines.append(f"    {k:<4s}{r['step_s']:9.1f}{r['steps_per_s']:10.3g}"
                     f"{r['steps_per_s'] * 3600:9.2f}{r['speedup']:7.2f}x{r['in_flight']:14.3g}"
                     f"  {r['bound_by']:<26s}{_spans(r)}")
    if plan.staleness_levels != STALENESS_LEVELS:
        lines.append("    (the other k are refused with this rollout.engine / rollout.mode)")
    return lines


def plan_nodes(plan: Plan) -> float:
    """Nodes the plan's learner GPUs and servers fill."""
    gpus = plan.layout.world_size + plan.num_servers * plan.server_tp
    return gpus / plan.hardware.gpus_per_node


def staleness_markdown(plan: Plan, command: str, title: str,
                       ranked: Optional[Dict[int, List[Plan]]] = None) -> str:
    """The doc section ``gspo-plan --doc`` writes between the markers: the command, the terms,
    the table of the config's own plan, and the RL steps per hour of each ranked plan."""
    lines = [DOC_BEGIN, "", "```bash", command, "```", "", f"{title}: {plan_nodes(plan):g} nodes "
             f"x {plan.hardware.gpus_per_node} GPUs, learner {layout_name(plan)}, "
             f"{plan.num_servers} SGLang servers x TP{plan.server_tp}:", ""]
    lines += [f"- {text}" for text in staleness_assumptions(plan)]
    lines += ["", "| k | step (s) | RL steps/s | RL steps/h | vs on-policy | requests re-prefilled "
              "per server at a sync | bound by | a longest response spans (steps) |",
              "|---" * 8 + "|"]
    for r in staleness_rows(plan):
        k = f"**{r['k']}** (config)" if r["configured"] else str(r["k"])
        lines.append(f"| {k} | {r['step_s']:.1f} | {r['steps_per_s']:.3g} | "
                     f"{r['steps_per_s'] * 3600:.2f} | {r['speedup']:.2f}x | "
                     f"{r['in_flight']:.3g} | {r['bound_by']} | {_spans(r)} |")
    lines += ["", staleness_reading(plan)]
    for n, plans in (ranked or {}).items():
        lines += ["", f"The planner's best layouts on {n} nodes (`--nodes {n}`), RL steps/h:",
                  "", "| # | learner | rollout | " + " | ".join(
                      f"k={k}" for k in plan.staleness_levels) + " |",
                  "|---" * (3 + len(plan.staleness_levels)) + "|"]
        for i, p in enumerate(plans, 1):
            rates = " | ".join(f"{r['steps_per_s'] * 3600:.2f}" for r in staleness_rows(p))
            lines.append(f"| {i} | {layout_name(p)}, recompute={p.recompute} | "
                         f"{p.num_servers} x TP{p.server_tp} | {rates} |")
    return "\n".join(lines + ["", DOC_END])


def staleness_reading(plan: Plan) -> str:
    """One sentence on the rows: the speed-ups over on-policy, what bounds the fastest step, and
    whether a larger k adds anything."""
    rows = staleness_rows(plan)
    if len(rows) == 1:
        return "Reading: this rollout.engine / rollout.mode runs on-policy only."
    text = "Reading: RL steps/s over on-policy: " + ", ".join(
        f"k = {r['k']}: {r['speedup']:.2f}x" for r in rows[1:]) + "."
    fastest = min(rows, key=lambda r: r["step_s"])
    text += f" The fastest step is bound by {fastest['bound_by']}."
    rest = [r for r in rows if r["k"] >= 2]
    if rest:
        text += (" Every k >= 2 gives the same step: the model is deterministic and has no "
                 "variance for a larger k to absorb.")
        within = rest[0]["spans"] <= rest[0]["k"]
        text += (f" A longest response spans {rest[0]['spans']:.2f} steps with the servers kept "
                 f"full, " + ("within" if within else "beyond") + f" k = {rest[0]['k']}"
                 + ("." if within else ": its groups would be dropped as too old, a waste the "
                                       "model does not count."))
    return text


def write_doc_section(path: Path, text: str) -> None:
    """Replace the section of ``path`` between :data:`DOC_BEGIN` and :data:`DOC_END` (``text``
    carries both)."""
    try:
        doc = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--doc {path}: {exc.strerror or exc}") from exc
    if DOC_BEGIN not in doc or DOC_END not in doc:
        raise ConfigError(f"--doc {path}: no section marked {DOC_BEGIN!r} ... {DOC_END!r}")
    head, rest = doc.split(DOC_BEGIN, 1)
    path.write_text(head + text + rest.split(DOC_END, 1)[1])


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
        rows = staleness_rows(p)
        lines.append(
            f"  {i}. {verdict}: learner {nodes} node(s) {layout_name(p)}, recompute="
            f"{p.recompute}, {p.max_tokens_per_micro_batch} tokens/micro-batch; peak "
            f"{p.learner.peak_bytes / GB:.1f} GB{host}; rollout {p.num_servers} x "
            f"TP{p.server_tp}; step ~{p.step_s:.0f} s; RL steps/h at k="
            f"{'/'.join(str(r['k']) for r in rows)}: "
            f"{'/'.join(format(r['steps_per_s'] * 3600, '.2f') for r in rows)}")
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
                        "rollout_on_policy": plan.times.rollout_batch_s,
                        "weight_sync_floor": plan.times.weight_sync_floor_s},
            "steps_per_s_by_staleness": {str(r["k"]): r["steps_per_s"]
                                         for r in staleness_rows(plan)}}


def _gib(x: float) -> str:
    return f"{x / 2**30:7.2f} GiB"


def describe_host(host, title: str) -> str:
    """``gspo-plan --host``: each process kind's owned-memory peak, term by term."""
    lines = [title]
    for proc in [host.learner] + ([host.server] if host.server else []):
        lines.append(f"  {proc.name} x {proc.count}, peak at {proc.moment}:")
        lines += [f"    {term.name:<52s}{_gib(term.bytes)}" for term in proc.terms]
        lines.append(f"    {'= peak owned memory (RssAnon + RssShmem)':<52s}{_gib(proc.peak_bytes)}")
    lines.append(f"  {'all processes at their peaks':<54s}{_gib(host.total_bytes)} of "
                 f"{host.host_memory_bytes / 2**30:.2f} GiB: "
                 f"{'fits' if host.fits else 'DOES NOT FIT'}")
    return "\n".join(lines)


def host_as_dict(host) -> dict:
    """JSON-ready form of a ``HostPlan``."""
    def proc(p):
        return None if p is None else {
            "name": p.name, "count": p.count, "moment": p.moment, "peak_bytes": p.peak_bytes,
            "terms": [{"name": t.name, "bytes": t.bytes} for t in p.terms]}

    return {"learner": proc(host.learner), "server": proc(host.server),
            "host_memory_bytes": host.host_memory_bytes, "total_bytes": host.total_bytes,
            "fits": host.fits}
