"""SFT loss: token-mean NLL over the whole mini-batch, split-invariant, with exact metrics."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.algorithms.metrics import accumulate_metrics, metrics_to_floats
from gspo_megatron.algorithms.types import PolicyLossInputs
from gspo_megatron.learner.sft_loss import perplexity, sft_loss


def _inputs(lp: torch.Tensor, seq_index: torch.Tensor, total_tokens: int) -> PolicyLossInputs:
    num_seqs = int(seq_index.max()) + 1
    return PolicyLossInputs(logprobs=lp, old_logprobs=lp.detach(), advantages=torch.zeros_like(lp),
                            seq_index=seq_index, num_seqs=num_seqs,
                            seq_token_counts=torch.bincount(seq_index, minlength=num_seqs),
                            global_num_seqs=3, global_num_tokens=total_tokens)


def test_split_micro_batches_sum_to_the_whole_batch_loss_and_gradient():
    lp = -torch.rand(10, dtype=torch.float64) * 3
    whole_lp = lp.clone().requires_grad_(True)
    whole = sft_loss(_inputs(whole_lp, torch.tensor([0] * 4 + [1] * 3 + [2] * 3), 10))
    whole.loss.backward()
    parts_lp = lp.clone().requires_grad_(True)
    a = sft_loss(_inputs(parts_lp[:4], torch.zeros(4, dtype=torch.int64), 10))
    b = sft_loss(_inputs(parts_lp[4:], torch.tensor([0] * 3 + [1] * 3), 10))
    (a.loss + b.loss).backward()
    assert float(whole.loss) == pytest.approx(float(-lp.mean()))
    assert float(a.loss + b.loss) == pytest.approx(float(whole.loss))
    assert torch.allclose(parts_lp.grad, whole_lp.grad)
    assert torch.allclose(whole_lp.grad, torch.full((10,), -0.1, dtype=torch.float64))
    merged = metrics_to_floats(accumulate_metrics(accumulate_metrics({}, a.metrics), b.metrics))
    assert merged["sft_nll"] == pytest.approx(float(-lp.mean()))


def test_empty_mini_batch_is_refused_and_perplexity_saturates():
    with pytest.raises(ValueError, match="global_num_tokens must be > 0"):
        sft_loss(_inputs(torch.zeros(1), torch.zeros(1, dtype=torch.int64), 0))
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert math.isfinite(perplexity(1e6))
