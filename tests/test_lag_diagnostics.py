"""Clip fractions by policy lag: fixed bucket names, per-token and per-sequence (oldest token)
buckets computed by hand, empty buckets left out after the exact reduction, every loss reporting
them, and the checks on ``PolicyLossInputs.token_lag``."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.algorithms.lag_diagnostics import LAG_BUCKETS, lag_clip_metrics
from gspo_megatron.algorithms.losses import get_policy_loss
from gspo_megatron.algorithms.metrics import accumulate_metrics, metrics_to_floats
from gspo_megatron.algorithms.types import PolicyLossInputs
from gspo_megatron.config.schema import AlgorithmConfig, TISConfig

OFF = TISConfig(mode="off")


NAMES = {f"clip_frac_{level}_{b}" for level in ("token", "seq") for b in LAG_BUCKETS}


def _case():
    """Sequences (tokens: lag, clipped): 0: (0,n) (0,y) (1,n); 1: (2,y) (2,y); 2: (7,n);
    3: (1,n) (0,n). No token has lag 3; sequence 0's oldest token has lag 1."""
    lag = torch.tensor([0, 0, 1, 2, 2, 7, 1, 0])
    clipped = torch.tensor([0, 1, 0, 1, 1, 0, 0, 0], dtype=torch.bool)
    seq_index = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    seq_clipped = torch.tensor([True, True, False, False])
    return clipped, seq_clipped, lag, seq_index


def test_buckets_by_token_and_by_the_oldest_token_of_each_sequence():
    out = lag_clip_metrics(*_case())
    assert set(out) == NAMES
    m = metrics_to_floats(out)
    assert m == pytest.approx({
        "clip_frac_token_lag0": 1 / 3, "clip_frac_token_lag1": 0.0, "clip_frac_token_lag2": 1.0,
        "clip_frac_token_lag4plus": 0.0,
        # max lag per sequence: 1, 2, 7, 1
        "clip_frac_seq_lag1": 1 / 2, "clip_frac_seq_lag2": 1.0, "clip_frac_seq_lag4plus": 0.0})
    # Empty buckets are [0, 0]: present on every rank, left out of the logged values.
    assert out["clip_frac_token_lag3"].tolist() == [0.0, 0.0]
    assert out["clip_frac_seq_lag0"].tolist() == [0.0, 0.0]


def test_micro_batches_reduce_exactly_and_an_empty_one_adds_nothing():
    clipped, seq_clipped, lag, seq_index = _case()
    whole = metrics_to_floats(lag_clip_metrics(clipped, seq_clipped, lag, seq_index))
    totals: dict = {}
    for tokens, seqs in ((slice(0, 5), slice(0, 2)), (slice(5, 8), slice(2, 4)),
                         (slice(0, 0), slice(0, 0))):
        local = seq_index[tokens] - (seq_index[tokens].min() if tokens.stop else 0)
        accumulate_metrics(totals, lag_clip_metrics(clipped[tokens], seq_clipped[seqs],
                                                    lag[tokens], local))
    assert metrics_to_floats(totals) == whole


def _loss_inputs(lag) -> PolicyLossInputs:
    old = torch.full((6,), -1.0)
    logp = (old + torch.tensor([0.3, 0.3, 0.0, 0.0, -0.3, 0.0])).requires_grad_()
    seq_index = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0])
    return PolicyLossInputs(logprobs=logp, old_logprobs=old, advantages=adv, seq_index=seq_index,
                            num_seqs=3, seq_token_counts=torch.tensor([2, 2, 2]),
                            global_num_seqs=3, global_num_tokens=6, token_lag=lag)


@pytest.mark.parametrize("loss", ["gspo", "gspo_token", "grpo"])
def test_every_loss_reports_the_lag_buckets_of_its_clip_decisions(loss):
    cfg = AlgorithmConfig(tis=OFF, loss=loss, clip_eps_low=0.1, clip_eps_high=0.1)
    out = get_policy_loss(loss)(_loss_inputs(torch.tensor([3, 3, 0, 0, 9, 5])), cfg)
    m = metrics_to_floats(out.metrics)
    assert NAMES <= set(out.metrics)
    # Sequence 0 (lag 3) is clipped high, sequence 2 (lags 9, 5) clipped low only through its
    # first token under GRPO (the second is on-policy), sequence 1 (lag 0) not at all.
    assert m["clip_frac_token_lag3"] == 1.0 and m["clip_frac_seq_lag3"] == 1.0
    assert m["clip_frac_token_lag0"] == 0.0 and m["clip_frac_seq_lag0"] == 0.0
    assert m["clip_frac_token_lag4plus"] == (0.5 if loss == "grpo" else 1.0)
    assert m["clip_frac_seq_lag4plus"] == 1.0
    assert "clip_frac_token_lag1" not in m and "clip_frac_seq_lag2" not in m
    without = get_policy_loss(loss)(_loss_inputs(None), cfg)
    assert not NAMES & set(without.metrics)  # only asked for with lags


def test_token_lag_is_checked():
    loss = get_policy_loss("gspo")
    with pytest.raises(ValueError, match="token_lag has shape \\(5,\\), expected \\(6,\\)"):
        loss(_loss_inputs(torch.zeros(5, dtype=torch.int64)), AlgorithmConfig(tis=OFF))
    with pytest.raises(ValueError, match="token_lag must hold integers.*float32"):
        loss(_loss_inputs(torch.zeros(6)), AlgorithmConfig(tis=OFF))
    with pytest.raises(ValueError, match="token_lag is -1 at token 4.*>= 0"):
        loss(_loss_inputs(torch.tensor([0, 0, 0, 0, -1, 0])), AlgorithmConfig(tis=OFF))
