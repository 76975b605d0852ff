"""Supervised (cold-start) loss under the policy-loss contract: token NLL over response tokens.

``loss = -(1/T) sum_t log pi(y_t)`` with ``T = global_num_tokens`` (all response tokens of the
mini-batch, all micro-batches and data-parallel ranks), so the summed gradients of all
micro-batches are the gradient of the mini-batch token mean, as for the policy losses
(``algorithms/types.py``). Advantages and old log-probs are ignored. Use it with
``learner.train_step(batch, sft_loss, temperature=1.0)``: supervised targets are scored under the
untempered policy.
"""

from __future__ import annotations

import math

from gspo_megatron.algorithms.metrics import metric_mean
from gspo_megatron.algorithms.types import LossOutput, PolicyLossInputs


def sft_loss(inputs: PolicyLossInputs, cfg=None) -> LossOutput:
    """Mean negative log-likelihood of the response tokens over the whole mini-batch."""
    if inputs.global_num_tokens <= 0:
        raise ValueError("sft_loss: global_num_tokens must be > 0 (a mini-batch without "
                         "response tokens has nothing to fit)")
    nll = -inputs.logprobs
    loss = nll.sum() / inputs.global_num_tokens
    metrics = {"sft_nll": metric_mean(nll)}
    if inputs.entropy is not None:
        metrics["entropy"] = metric_mean(inputs.entropy)
    return LossOutput(loss=loss, metrics=metrics)


def perplexity(mean_nll: float) -> float:
    """``exp(mean NLL)``, saturating instead of overflowing."""
    return math.exp(min(mean_nll, 700.0))
