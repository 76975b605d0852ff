"""The routing-replay section of docs/paper_reproduction.md: GRPO without replay, with the learner's
routing (R2, the paper's Routing Replay) and with the rollout engine's (R3), once with an fp32
engine (the learner's own precision) and once with a bf16 engine, whose train / inference
mismatch is what R3 removes the routing part of.

The gap is ``rollout/learner_vs_engine_abs_logp``: the mean absolute difference per response
token between the learner's old-policy pass and the engine's log-probs of the same tokens, under
the same weights. Under R2 that pass routes by itself (the recording it makes is replayed only in
the training passes), so its gap is the no-replay gap; under R3 it routes every token as the
engine did. Verdict rules are ``paper_numbers``'s (``separation``, ``close``).
"""

from __future__ import annotations

import statistics
from typing import List, Optional

from gspo_megatron.experiments.paper_numbers import (CLOSE_REL, Reproduction, close, end_accuracy,
                                                     phase_mean, separation)

GAP, CLIP_TOKEN = "rollout/learner_vs_engine_abs_logp", "train/clip_frac_token"
MODES = (("off", "grpo"), ("R2: learner", "grpo_replay"), ("R3: rollout", "grpo_r3"))
ENGINES = (("fp32", ""), ("bf16", "_bf16"))
SGLANG_BYTES = 4 * 4 / 3
"""Bytes per expert id on the wire: SGLang's int32, base64-encoded."""


def _variant(base: str, suffix: str) -> str:
    return base + suffix


def _gap_cell(rep: Reproduction, variant: str) -> str:
    gaps = rep.per_seed(variant, phase_mean(GAP, rep.phase("run")))
    return f"{statistics.median(gaps):.2e} ({min(gaps):.1e}-{max(gaps):.1e})"


def _acc_cell(rep: Reproduction, variant: str) -> str:
    acc = rep.per_seed(variant, end_accuracy)
    return f"{statistics.median(acc) * 100:.1f}% ({min(acc) * 100:.1f}-{max(acc) * 100:.1f}%)"


def _table(rep: Reproduction) -> List[str]:
    lines = ["| replay | engine | learner vs engine abs logp per token | held-out acc. at the end "
             "| GRPO clipped tokens | s / step |", "|---|---|---|---|---|---|"]
    for label, base in MODES:
        for engine, suffix in ENGINES:
            v = _variant(base, suffix)
            if v not in rep.runs:
                continue
            clip = rep.phase_median(v, CLIP_TOKEN)
            step_s = rep.phase_median(v, "time/step_s")
            lines.append(f"| {label} | {engine} | {_gap_cell(rep, v)} | {_acc_cell(rep, v)} | "
                         f"{clip:.2e} | {step_s:.2f} |")
    return lines


def _gap(rep: Reproduction, variant: str) -> float:
    return rep.phase_median(variant, GAP)


def _gap_verdict(rep: Reproduction) -> str:
    """What R3 does to the bf16 engine's gap, by ``close``'s rule."""
    off, r3 = _gap(rep, "grpo_bf16"), _gap(rep, "grpo_r3_bf16")
    if close(off, r3):
        change = f"leaves it where it was (within {CLOSE_REL * 100:.0f}%)"
    elif r3 < off:
        change = f"cuts it to {r3 / off:.2f} of that"
    else:
        change = f"raises it {r3 / off:.2f}x"
    return (f"With the bf16 engine the learner and the engine disagree by {off:.2e} nats per "
            f"token without replay; R3 {change} ({r3:.2e}). That rest is the bf16 arithmetic "
            "itself, which no routing can remove. Under R2 the old-policy pass routes for "
            f"itself, so its gap ({_gap(rep, 'grpo_replay_bf16'):.2e}) is the no-replay one.")


def _accuracy_verdict(rep: Reproduction) -> str:
    parts = []
    for engine, suffix in ENGINES:
        plain, r3 = _variant("grpo", suffix), _variant("grpo_r3", suffix)
        if {plain, r3} <= set(rep.runs):
            sep = separation(rep.per_seed(r3, end_accuracy), rep.per_seed(plain, end_accuracy))
            parts.append(f"{engine} engine: GRPO + R3 vs GRPO {sep}")
    return "; ".join(parts)


def _missing(rep: Reproduction) -> Optional[str]:
    wanted = [_variant(base, suffix) for _, base in MODES for _, suffix in ENGINES]
    absent = [v for v in wanted if v not in rep.runs]
    return f"*Not measured here: needs the {', '.join(absent)} runs.*" if absent else None


def routing_replay(rep: Reproduction, doc) -> str:
    """The section: the gap table, what R3 changes, and what it costs."""
    title = "## Routing replay from the rollout engine (R3)"
    missing = _missing(rep)
    if missing:
        return f"{title}\n\n{missing}"
    m = rep.config.model
    per_token = 2 * m.moe_router_topk * m.num_layers
    qwen_wire = 48 * 8 * SGLANG_BYTES
    return "\n".join([
        title, "",
        "`algo.routing_replay=rollout`: the engine returns the experts it routed every token to "
        "(the embedded engine records them; SGLang with `return_routed_experts`), the samples carry "
        "them through batching, packing and the parallel layouts, and the learner's old-policy and "
        "training passes replay them through Megatron-Core's `RouterReplay`. GRPO (token ratios, "
        "pi_old from the learner), 3 ways: no replay, R2, R3; with the embedded engine in fp32 "
        "and in bf16 (`rollout.embedded_dtype`), the learner in fp32. Gap: the mean absolute "
        "difference per response token between the learner's pi_old and the engine's log-probs "
        "of the same tokens under the same weights (run mean per seed; median and seed range).",
        "", *_table(rep), "",
        _gap_verdict(rep) + f" With the fp32 engine both already agree to {_gap(rep, 'grpo'):.1e} "
        "nats (same arithmetic up to summation order), and R3 changes nothing there "
        f"({_gap(rep, 'grpo_r3'):.1e}). Held-out accuracy: {_accuracy_verdict(rep)}.",
        "",
        f"Cost: {per_token} bytes per token in the trainer here (int16, top-{m.moe_router_topk}, "
        f"{m.num_layers} layers); for Qwen3-30B-A3B (48 layers, top-8) 768 bytes per token kept "
        f"and {qwen_wire:.0f} on the wire from SGLang (int32, base64). The real SGLang 0.5.23 "
        "CPU engine cannot capture routed experts (`--enable-return-routed-experts` registers "
        "its host buffer with CUDA and the server dies at start: "
        "`tests/test_rollout_sglang_real_server.py`), so the SGLang path is tested against the "
        "reference server and the pinned wheel's schema, and the real server's answer without "
        "the capture is refused by name.",
    ])
