"""Rough times of one RL step (learner update, rollout generation, weight sync), and the RL step
against the rollout staleness ``k`` (``rollout.max_staleness``).

Meant to rank layouts and catch orders of magnitude, not to promise seconds. Every term is
*modelled* from first principles (FLOPs, HBM bytes, link bytes) and scaled by an *assumed*
efficiency, or is an *assumption* named as such; ``docs/planner.md`` says which is which.

* **learner**: model FLOPs (6 x active parameters per token, plus causal attention
  ``12 * layers * heads * head_dim * L / 2`` per token -- the MFU convention of
  ``benchmarks/bench_learner.py``), times 4/3 under full recompute (the forward runs twice), plus
  the forward-only log-prob pass when the learner recomputes old log-probs; divided by the
  learner GPUs' BF16 peak times an assumed MFU;
* **decode step** of a server running ``c`` sequences: bound by HBM bandwidth, it reads the
  server's weights once and each sequence's KV cache:
  ``l(c) = (W + c * ctx * kv) / (BW * DECODE_BANDWIDTH_EFFICIENCY)``. Every weight is read
  whatever ``c`` (an MoE step at low concurrency touches fewer experts, but the step's fixed
  latencies -- kernel launches, TP all-reduces -- are not modelled either);
* **one batch**, ``N`` sequences per server, ``C`` decoded at once (what the KV pool holds,
  capped by the client's concurrency), mean response ``m``, longest ``L``
  (:class:`ResponseLengths`):
  - throughput-bound ``T_gen = N * m * l(C) / C``: the servers full all the time;
  - on-policy ``T_batch = max(T_gen, T_admit + L * l(c_tail))``: the batch's last request is
    admitted after ``T_admit = (N - C) * m * l(C) / C``, it is a longest response (the batch's
    last wave of ``C`` holds ``truncated_frac * C`` of them) and needs ``L`` more decode steps at
    the concurrency left, ``c_tail = truncated_frac * C`` (at least 1);
  - kept full ``T_long = L * l(C)``: a longest response decoded while other requests keep the
    servers full (``k >= 2``); its group must end within k steps or it is dropped as too old;
  every sequence is read at the context ``ctx`` of half the longest sequence;
* **weight sync**: bf16 weights over the inter-node link, bytes / bandwidth, plus the servers'
  pause and resume around it (``ASSUMED_PAUSE_PER_SYNC_S``, every k: the sync always pauses);
* **re-prefill** (``k >= 2``): a request in flight at a sync is aborted and sent again as prompt +
  partial tokens, whose KV the servers recompute under the new weights (SGLang flushes its cache
  at an update): prefill FLOPs ``2 * active + 2 * layers * heads * head_dim * n`` per token of an
  ``n``-token context, at ``mfu`` of the servers' BF16 peak.

The step against k (:func:`step_seconds`), ``T_sync`` = weight sync + pause::

    k = 0    T_batch + T_learn + T_sync                    generate, then train, then sync
    k = 1    max(T_batch, T_learn) + T_sync                next batch (tail too) beside the update
    k >= 2   max(T_gen + X, T_learn) + T_sync              servers kept full; X: re-prefill

The model is deterministic: it sees the mean tail, not its variance, so every ``k >= 2`` gives
the same step; steps/s saturates once generation keeps up. A larger k absorbs variance (a batch
whose tail runs longer than usual) and keeps the longest groups from being dropped as too old:
:func:`longest_response_steps` says how many steps a longest response spans, which must stay
within k (the model does not count dropped groups' wasted generation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Sequence

from gspo_megatron.planner.hardware import Hardware
from gspo_megatron.planner.model_shape import ModelShape
from gspo_megatron.planner.rollout_memory import RolloutEstimate

DECODE_BANDWIDTH_EFFICIENCY = 0.6
"""Share of peak HBM bandwidth a decode step reaches (weights + KV reads). Assumed."""

ASSUMED_PAUSE_PER_SYNC_S = 0.1
"""ASSUMED, not measured: seconds per weight sync spent pausing the servers
(``/pause_generation {mode: abort}``, aborting what runs) and continuing them, on top of the
weight transfer. A placeholder for the pause the trainer logs as ``weight_sync/pause_s``, until
that is measured (on CPU against the real SGLang server first, then on the GPU kit)."""

STALENESS_LEVELS = (0, 1, 2, 4)
"""The values of ``rollout.max_staleness`` that ``gspo-plan`` tabulates."""


@dataclass(frozen=True)
class ResponseLengths:
    """What the times assume of one batch's responses (``plan.mean_response_frac``,
    ``plan.truncated_frac``): the longest response of a batch reaches the cap."""

    prompt_tokens: int
    """Per sequence (``data.max_prompt_tokens``)."""
    mean_tokens: float
    """Mean response length."""
    max_tokens: int
    """The cap, ``rollout.max_new_tokens``: the batch's longest response."""
    truncated_frac: float
    """Share of responses that run to the cap."""


@dataclass(frozen=True)
class StepTimes:
    """Rough seconds of one RL step's phases; :func:`step_seconds` composes them for a k."""

    learner_s: float
    rollout_s: float
    """Throughput-bound generation of one batch, the servers full all the time (``T_gen``)."""
    weight_sync_floor_s: float
    rollout_tokens_per_s: float
    """Generated tokens per second over all servers, at full concurrency."""
    rollout_batch_s: float = 0.0
    """On-policy: one batch from its first request to its longest response (``T_batch``)."""
    longest_response_s: float = 0.0
    """A longest response decoded while other requests keep the servers full (``T_long``)."""
    concurrency: float = 0.0
    """Sequences a server decodes at once (``C``)."""
    tail_concurrency: float = 0.0
    """Sequences a server still decodes during one batch's tail (``c_tail``)."""
    reprefill_per_request_s: float = 0.0
    """Re-prefilling one aborted request (prompt + a mean response) on every server at once."""
    pause_s: float = ASSUMED_PAUSE_PER_SYNC_S

    @property
    def sync_s(self) -> float:
        """The weight sync as every k pays it: the transfer floor plus the pause around it."""
        return self.weight_sync_floor_s + self.pause_s


def learner_flops_per_token(shape: ModelShape, seq_len: int, recompute: str) -> float:
    """Training FLOPs per token (forward + backward, + forward again under full recompute)."""
    attention = 12 * shape.num_layers * shape.num_attention_heads * shape.head_dim * seq_len / 2
    flops = 6 * shape.active_params() + attention
    return flops * (4 / 3 if recompute == "full" else 1.0)


def prefill_flops(shape: ModelShape, num_tokens: float) -> float:
    """Forward FLOPs of prefilling one ``num_tokens`` context (causal attention)."""
    attention = 2 * shape.num_layers * shape.num_attention_heads * shape.head_dim * num_tokens
    return num_tokens * (2 * shape.active_params() + attention)


def decode_step_s(rollout: RolloutEstimate, hw: Hardware, concurrency: float,
                  context_tokens: float) -> float:
    """One decode step of a server running ``concurrency`` sequences of ``context_tokens``."""
    read = rollout.weights_bytes + concurrency * context_tokens * rollout.kv_bytes_per_token
    return read / (hw.hbm_tb_per_s * 1e12 * DECODE_BANDWIDTH_EFFICIENCY)


def estimate_times(shape: ModelShape, *, hw: Hardware, learner_gpus: int, mfu: float,
                   recompute: str, tokens_per_step: float, num_seqs: int,
                   lengths: ResponseLengths, logprob_pass: bool, num_servers: int,
                   server_tp: int, rollout: RolloutEstimate, max_concurrency: int) -> StepTimes:
    """``tokens_per_step``: prompt + response tokens trained on per RL step; ``num_seqs``:
    sequences generated per step."""
    seq_len = lengths.prompt_tokens + lengths.max_tokens
    peak = learner_gpus * hw.bf16_tflops * 1e12 * mfu
    train = learner_flops_per_token(shape, seq_len, recompute) * tokens_per_step
    if logprob_pass:
        train += 2 * shape.active_params() * tokens_per_step
    learner_s = train / peak if peak > 0 else float("inf")
    sync_s = 2 * shape.total_params() / (hw.inter_node_gb_per_s * 1e9)
    concurrency = max(1, min(rollout.max_sequences, max_concurrency))
    if not rollout.fits or num_servers < 1:
        inf = float("inf")
        return StepTimes(learner_s=learner_s, rollout_s=inf, weight_sync_floor_s=sync_s,
                         rollout_tokens_per_s=0.0, rollout_batch_s=inf,
                         longest_response_s=inf, concurrency=concurrency,
                         tail_concurrency=1.0, reprefill_per_request_s=inf)
    per_server = num_seqs / num_servers
    full_step = decode_step_s(rollout, hw, concurrency, seq_len / 2)
    rollout_s = per_server * lengths.mean_tokens * full_step / concurrency
    batch_s, tail_concurrency = _on_policy_batch_s(rollout, hw, per_server, concurrency, lengths)
    server_flops = server_tp * hw.bf16_tflops * 1e12 * mfu
    partial = prefill_flops(shape, lengths.prompt_tokens + lengths.mean_tokens)
    return StepTimes(
        learner_s=learner_s, rollout_s=rollout_s, weight_sync_floor_s=sync_s,
        rollout_tokens_per_s=num_servers * concurrency / full_step, rollout_batch_s=batch_s,
        longest_response_s=lengths.max_tokens * full_step,
        concurrency=concurrency, tail_concurrency=tail_concurrency,
        reprefill_per_request_s=partial / server_flops)


def _on_policy_batch_s(rollout: RolloutEstimate, hw: Hardware, per_server: float,
                       concurrency: int, lengths: ResponseLengths):
    """(``T_batch``, ``c_tail``): one batch alone on the servers, ``per_server`` sequences each;
    ``concurrency`` is what a server could run, a batch smaller than it runs fewer."""
    c = max(1.0, min(float(concurrency), per_server))
    seq_len = lengths.prompt_tokens + lengths.max_tokens
    step = decode_step_s(rollout, hw, c, seq_len / 2)
    throughput_s = per_server * lengths.mean_tokens * step / c
    admit_s = max(0.0, per_server - c) * lengths.mean_tokens * step / c
    tail_c = min(c, max(1.0, lengths.truncated_frac * c))
    tail_step = decode_step_s(rollout, hw, tail_c, seq_len / 2)
    return max(throughput_s, admit_s + lengths.max_tokens * tail_step), tail_c


def requests_in_flight_at_sync(t: StepTimes, k: int) -> float:
    """Requests per server that a sync aborts and that must be re-prefilled: none for ``k <= 1``
    (the sync runs between batches); for ``k >= 2`` all ``C`` when generation is the bottleneck
    (the servers are full at every sync), the tail's ``c_tail`` when the learner is slower than
    the throughput-bound generation but not than the batch's tail, else none."""
    if k <= 1 or t.rollout_batch_s <= t.learner_s:
        return 0.0
    return t.concurrency if t.rollout_s >= t.learner_s else t.tail_concurrency


def step_seconds(t: StepTimes, k: int) -> float:
    """One RL step at staleness ``k`` (the module docstring's table)."""
    if k < 0:
        raise ValueError(f"staleness {k} must be >= 0")
    if k == 0:
        return t.rollout_batch_s + t.learner_s + t.sync_s
    if k == 1:
        return max(t.rollout_batch_s, t.learner_s) + t.sync_s
    reprefill = requests_in_flight_at_sync(t, k) * t.reprefill_per_request_s
    return max(t.rollout_s + reprefill, t.learner_s) + t.sync_s


def bound_by(t: StepTimes, k: int) -> str:
    """What sets the step at staleness ``k``: the term of the max that wins."""
    if k == 0:
        return "generation, then learner"
    if k == 1:
        return "generation incl. tail" if t.rollout_batch_s >= t.learner_s else "learner"
    reprefill = requests_in_flight_at_sync(t, k) * t.reprefill_per_request_s
    if t.rollout_s + reprefill < t.learner_s:
        return "learner"
    return "generation + re-prefill" if reprefill else "generation"


def longest_response_steps(t: StepTimes, k: int) -> float:
    """``k >= 2``: RL steps a longest response spans while the servers stay full; its group is
    dropped as too old when this exceeds k (0 for ``k <= 1``, which wait for the whole batch)."""
    return t.longest_response_s / step_seconds(t, k) if k >= 2 else 0.0


def steps_per_second(t: StepTimes, levels: Sequence[int] = STALENESS_LEVELS) -> Dict[int, float]:
    """RL steps per second at each staleness of ``levels``."""
    return {k: 1.0 / step_seconds(t, k) for k in levels}
