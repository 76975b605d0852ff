"""Rollouts as the learner's SequenceBatch: every token's policy lag from the samples' weight
versions (a partial rollout spans several), and mini-batches that keep every per-sequence field."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.rollout.types import Sample
from gspo_megatron.trainer.batching import (rollout_to_sequence_batch, split_mini_batches,
                                            take_sequences, token_lags)
from gspo_megatron.trainer.schedule.collect import ScoredRollout


def _sample(index: int, versions, prompt=(1, 2)) -> Sample:
    n = len(versions) if versions is not None else 3
    return Sample(prompt_id="p", sample_index=index, prompt_token_ids=list(prompt),
                  response_token_ids=list(range(3, 3 + n)), response_logprobs=[-0.5] * n,
                  finish_reason="stop", latency_s=0.0, token_versions=versions)


STEP_OF = {5: 1, 6: 2, 7: 3}
"""Weight version (optimizer steps) -> RL steps trained when it was synced (2 updates per step
from version 5 on, as with ``batch.num_mini_batches=2``)."""


def lag_to(trained: int):
    return lambda version: trained - STEP_OF[version]


def test_token_lags_of_whole_and_partial_rollouts():
    samples = [_sample(0, [7, 7, 7]), _sample(1, [5, 5, 6, 7, 7]), _sample(2, [7])]
    assert token_lags(samples, lag_to(3)) == [[0, 0, 0], [2, 2, 1, 0, 0], [0]]
    one = _sample(3, None)  # an engine without per-token versions: its one weight version
    one.weight_version = "6"
    assert token_lags([one], lag_to(3)) == [[1, 1, 1]]


def test_token_lags_refuse_what_cannot_be_a_lag():
    with pytest.raises(ValueError, match=r"sample \('p', 0\) has no weight version for 3"):
        token_lags([_sample(0, None)], lag_to(3))
    bad = _sample(1, [4, 4])
    bad.response_token_ids.append(9)
    with pytest.raises(ValueError, match=r"sample \('p', 1\) has 2 token_versions for 3"):
        token_lags([bad], lag_to(3))
    with pytest.raises(ValueError, match=r"sample \('p', 2\) has a token of weight version 7, "
                                         r"newer than the weights being trained"):
        token_lags([_sample(2, [6, 7])], lag_to(2))


def test_rollout_batch_carries_lags_through_mini_batches():
    samples = [_sample(i, [3 - i % 2] * (2 + i)) for i in range(4)]
    rollout = ScoredRollout(samples=samples, rewards=[0.0] * 4, advantages=[1.0, -1.0, 0.5, 0.0])
    assert rollout_to_sequence_batch(rollout).token_lags is None  # on-policy: not asked for
    rollout.token_lags = [[3 - v for v in s.token_versions] for s in samples]
    batch = rollout_to_sequence_batch(rollout)
    assert all(t.dtype == torch.int64 for t in batch.token_lags)
    assert [t.tolist() for t in batch.token_lags] == [[0, 0], [1, 1, 1], [0] * 4, [1] * 5]
    minis = split_mini_batches(batch, 2)
    assert [t.tolist() for t in minis[1].token_lags] == [[0] * 4, [1] * 5]
    picked = take_sequences(batch, [3, 0])
    assert [t.tolist() for t in picked.token_lags] == [[1] * 5, [0, 0]]
    assert picked.advantages == [0.0, 1.0] and picked.rollout_logprobs[0].numel() == 5


def test_an_engine_without_a_log_prob_per_token_is_named_before_the_loss():
    """Issue 51, bad input: a correction (or pi_old = the engine's) needs one finite log-prob per
    response token; a short or non-finite list is refused with the sample's key, not a shape
    error deep in the loss."""
    from gspo_megatron.rollout.types import MalformedLogprobs

    short = _sample(0, [1, 1, 1])
    short.response_logprobs = []
    rollout = ScoredRollout(samples=[_sample(1, [1, 1]), short], rewards=[0.0, 1.0],
                            advantages=[0.0, 0.0])
    with pytest.raises(MalformedLogprobs, match=r"sample \('p', 0\): the engine returned 0 "
                                                r"log-probs for 3 response tokens") as refused:
        rollout_to_sequence_batch(rollout)
    import logging

    from gspo_megatron.cli.train import EXIT_ROLLOUT, _exit_code
    assert _exit_code(refused.value, None, logging.getLogger("test")) == EXIT_ROLLOUT
    nan = _sample(2, [1, 1, 1])
    nan.response_logprobs = [-0.1, float("nan"), float("-inf")]
    with pytest.raises(MalformedLogprobs, match=r"sample \('p', 2\): the engine's log-prob of "
                                                r"response token 1 is nan \(2 not finite\)"):
        rollout_to_sequence_batch(ScoredRollout(samples=[nan], rewards=[0.0], advantages=[0.0]))
