"""Rough times of one RL step: learner update, rollout generation, weight sync.

Meant to rank layouts and catch orders of magnitude, not to promise seconds:

* **learner**: model FLOPs (6 x active parameters per token, plus causal attention
  ``12 * layers * heads * head_dim * L / 2`` per token -- the MFU convention of
  ``benchmarks/bench_learner.py``), times 4/3 under full recompute (the forward runs twice), plus
  the forward-only log-prob pass when the learner recomputes old log-probs; divided by the
  learner GPUs' BF16 peak times an assumed MFU;
* **rollout**: decoding is bound by HBM bandwidth: every step reads the server's weights once
  and each running sequence's KV cache; the batch is what the KV pool holds (capped by the
  client's concurrency);
* **weight sync**: bf16 weights over the inter-node link; the floor is bytes / bandwidth
  (``benchmarks/sync_model.py`` adds per-bucket and gather costs on top of the same floor).
"""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.planner.hardware import Hardware
from gspo_megatron.planner.model_shape import ModelShape
from gspo_megatron.planner.rollout_memory import RolloutEstimate

DECODE_BANDWIDTH_EFFICIENCY = 0.6
"""Share of peak HBM bandwidth a decode step reaches (weights + KV reads)."""


@dataclass(frozen=True)
class StepTimes:
    """Rough seconds of one RL step's phases."""

    learner_s: float
    rollout_s: float
    weight_sync_floor_s: float
    rollout_tokens_per_s: float
    """Generated tokens per second over all servers."""


def learner_flops_per_token(shape: ModelShape, seq_len: int, recompute: str) -> float:
    """Training FLOPs per token (forward + backward, + forward again under full recompute)."""
    attention = 12 * shape.num_layers * shape.num_attention_heads * shape.head_dim * seq_len / 2
    flops = 6 * shape.active_params() + attention
    return flops * (4 / 3 if recompute == "full" else 1.0)


def estimate_times(shape: ModelShape, *, hw: Hardware, learner_gpus: int, mfu: float,
                   recompute: str, tokens_per_step: float, generated_per_step: float,
                   seq_len: int, logprob_pass: bool, num_servers: int,
                   rollout: RolloutEstimate, max_concurrency: int) -> StepTimes:
    """``tokens_per_step``: prompt + response tokens trained on per RL step;
    ``generated_per_step``: response tokens generated."""
    peak = learner_gpus * hw.bf16_tflops * 1e12 * mfu
    train = learner_flops_per_token(shape, seq_len, recompute) * tokens_per_step
    if logprob_pass:
        train += 2 * shape.active_params() * tokens_per_step
    learner_s = train / peak if peak > 0 else float("inf")

    batch = max(1, min(rollout.max_sequences, max_concurrency))
    kv_read = batch * (seq_len / 2) * rollout.kv_bytes_per_token
    step_s = (rollout.weights_bytes + kv_read) / (hw.hbm_tb_per_s * 1e12 *
                                                   DECODE_BANDWIDTH_EFFICIENCY)
    per_server = batch / step_s if rollout.fits else 0.0
    total = per_server * num_servers
    rollout_s = generated_per_step / total if total > 0 else float("inf")
    sync_bytes = 2 * shape.total_params()
    return StepTimes(learner_s=learner_s, rollout_s=rollout_s,
                     weight_sync_floor_s=sync_bytes / (hw.inter_node_gb_per_s * 1e9),
                     rollout_tokens_per_s=total)
