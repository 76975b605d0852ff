"""Rollouts and supervised examples as the learner's :class:`SequenceBatch`, and mini-batches.

A rollout batch is split into ``batch.num_mini_batches`` mini-batches along whole prompt groups
where the group count allows it (so a group's samples update together, as in the paper), else
into equal runs of sequences; each mini-batch is one optimizer step.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable, List, Optional, Sequence

import torch

from gspo_megatron.config.schema import routing_replay_mode
from gspo_megatron.data.sft import build_sft_examples
from gspo_megatron.learner.batch import SequenceBatch
from gspo_megatron.learner.routing import moe_routing_layout
from gspo_megatron.rollout.routed_experts import RoutingShape, check_sample_routing
from gspo_megatron.rollout.types import Sample, check_sample_logprobs
from gspo_megatron.trainer.schedule.collect import ScoredRollout


def rollout_routing_shape(cfg) -> Optional[RoutingShape]:
    """With ``algo.routing_replay=rollout`` (R3), what every sample's routed experts must fit
    (the learner's model); None otherwise."""
    if routing_replay_mode(cfg.algo) != "rollout":
        return None
    return RoutingShape(*moe_routing_layout(cfg.model))


def token_lags(samples: Sequence[Sample], lag_of: Callable[[int], int]) -> List[List[int]]:
    """Per sample, per response token: ``lag_of(version)``, the RL steps between the weights
    that generated the token and the update it trains (``PolicyLossInputs.token_lag``).
    Versions are ``Sample.token_versions`` (a partial rollout spans several), else the sample's
    one ``weight_version``. ValueError naming the sample when it carries no version, a wrong
    number of them, or one the learner has not reached (a negative lag)."""
    out = []
    for s in samples:
        versions = s.token_versions
        if versions is None and s.weight_version is not None:
            versions = [int(s.weight_version)] * len(s.response_token_ids)
        if versions is None or len(versions) != len(s.response_token_ids):
            got = "no weight version" if versions is None else f"{len(versions)} token_versions"
            raise ValueError(f"sample {s.key} has {got} for {len(s.response_token_ids)} response "
                             "tokens; the lag metrics need the weight version of every token")
        lags = [lag_of(int(v)) for v in versions]
        if lags and min(lags) < 0:
            raise ValueError(f"sample {s.key} has a token of weight version {max(versions)}, "
                             "newer than the weights being trained")
        out.append(lags)
    return out


def rollout_to_sequence_batch(rollout: ScoredRollout,
                              routing_shape: Optional[RoutingShape] = None) -> SequenceBatch:
    """Engine log-probs serve as both ``rollout_logprobs`` and the default ``old_logprobs``.
    ``routing_shape`` (R3): every sample's routed experts, checked against it, come along; so do
    the rollout's token lags (asynchronous rollouts, :func:`token_lags`), as int64 tensors."""
    for s in rollout.samples:
        check_sample_logprobs(s)  # MalformedLogprobs naming the sample, not a shape error later
    engine_lp = [torch.tensor(s.response_logprobs, dtype=torch.float32) for s in rollout.samples]
    routing = None
    if routing_shape is not None:
        routing = [check_sample_routing(s, routing_shape) for s in rollout.samples]
    lags = None
    if rollout.token_lags is not None:
        lags = [torch.tensor(t, dtype=torch.int64) for t in rollout.token_lags]
    return SequenceBatch(
        token_ids=[list(s.prompt_token_ids) + list(s.response_token_ids) for s in rollout.samples],
        prompt_lens=[len(s.prompt_token_ids) for s in rollout.samples],
        advantages=list(rollout.advantages),
        old_logprobs=engine_lp,
        rollout_logprobs=engine_lp,
        routed_experts=routing,
        token_lags=lags,
    )


def with_old_logprobs(batch: SequenceBatch, old_logprobs: Sequence[torch.Tensor]) -> SequenceBatch:
    return replace(batch, old_logprobs=[t.detach().float() for t in old_logprobs])


def take_sequences(batch: SequenceBatch, idx: List[int]) -> SequenceBatch:
    """The sequences ``idx`` of ``batch``, in that order, with all their fields (every field of
    a SequenceBatch is a list with one entry per sequence, so a new one comes along too)."""
    pick = (lambda xs: None if xs is None else [xs[i] for i in idx])
    return SequenceBatch(**{f.name: pick(getattr(batch, f.name)) for f in fields(SequenceBatch)})


def split_mini_batches(batch: SequenceBatch, num_mini_batches: int,
                       group_size: int = 1) -> List[SequenceBatch]:
    """Consecutive, near-equal mini-batches; whole groups of ``group_size`` when they divide."""
    n = len(batch)
    unit = group_size if group_size > 1 and (n // group_size) % num_mini_batches == 0 else 1
    units = n // unit
    if units < num_mini_batches:
        raise ValueError(f"cannot split {n} sequences into {num_mini_batches} mini-batches")
    bounds = [round(k * units / num_mini_batches) * unit for k in range(num_mini_batches + 1)]
    return [take_sequences(batch, list(range(bounds[k], bounds[k + 1]))) for k in range(num_mini_batches)]


def sft_batch(records, tokenizer) -> SequenceBatch:
    """Prompt + reference answer + eos; the loss covers the answer and eos only."""
    examples = build_sft_examples(records, tokenizer)
    prompt_lens = [ex.loss_mask.index(1) for ex in examples]
    return SequenceBatch(token_ids=[list(ex.token_ids) for ex in examples], prompt_lens=prompt_lens,
                         advantages=[1.0] * len(examples))
