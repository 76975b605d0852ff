"""Registered losses: GSPO (arXiv 2507.18071), GSPO-token and GRPO, chosen by ``algo.loss``, and
the supervised cold-start loss ``sft`` under the same contract.

    loss_fn = get_policy_loss(cfg.loss)          # the only place the name is looked at
    out = loss_fn(PolicyLossInputs(...), cfg)    # cfg: config.schema.AlgorithmConfig
    out.loss.backward()

Notation: G sequences (``global_num_seqs``), response y_i of |y_i| tokens, per-token log-ratio
``l_t = log pi(y_t) - log pi_old(y_t)``, clip range ``[1 - eps_low, 1 + eps_high]``.

* ``gspo`` (Eqs. 5, 7): ``s_i = exp(mean_t l_t)``;
  ``loss = -(1/G) sum_i min(s_i A_i, clip(s_i) A_i)``. Gradient (Eq. 10, unclipped):
  ``(1/G) sum_i s_i A_i (1/|y_i|) sum_t grad log pi(y_t)`` -- each token weighted equally.
* ``gspo_token`` (Eqs. 13-17): ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]``;
  ``loss = -(1/G) sum_i (1/|y_i|) sum_t min(s_i,t A_i,t, clip(s_i,t) A_i,t)``; identical to
  ``gspo`` (value, clipping, gradient) when ``A_i,t = A_i``.
* ``grpo``: ``r_t = exp(l_t)``, per-token ``min(r_t A_t, clip(r_t) A_t)``, averaged over all
  tokens (``token_mean``, DAPO) or per sequence then over sequences (``seq_mean_token_mean``).

* ``sft`` (the cold start before RL, ``trainer.num_sft_steps``): token NLL
  ``loss = -(1/T) sum_t log pi(y_t)`` over the response tokens, ``T = global_num_tokens``;
  advantages and old log-probs are ignored, and the loop scores it at temperature 1.0.

Options for the policy losses: a k3 KL penalty to the reference policy (``kl_coef``), an entropy bonus
(``entropy_coef``), both aggregated like the policy term, and the importance correction against
the engine (``tis``: ``min(r, C)`` truncated, or ``r`` masked to ``[1/C, C]``, with
``r = pi_old / pi_rollout`` per token or per sequence, ``algorithms/correction.py``) multiplying
the policy term's gradient of each token.

Stale rollouts (``rollout.max_staleness``): ``old_logprobs`` are the proximal policy's (the
learner's weights before this update) and ``rollout_logprobs`` the behaviour policy's (each token's
own weight version), so ``tis`` is the behaviour weight of the decoupled objective; at sequence
level ``gspo`` is exactly ``-(1/G) sum_i w_i min(s_i A_i, clip(s_i) A_i)`` with
``w_i = min(exp(mean_t(old_t - rollout_t)), C)`` in value and gradient (``docs/algorithms.md``).

Normalisation: the loss divides by the global mini-batch count (``global_num_seqs`` or
``global_num_tokens``), so summing the gradients of all micro-batches and ranks gives the
mini-batch gradient. Under context parallelism the loss *value* on each CP rank is that rank's
share (the shares add up to the objective) and its gradient is exact for the rank's own tokens.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from gspo_megatron.algorithms import loss_terms as terms
from gspo_megatron.algorithms.metrics import metric_mean
from gspo_megatron.algorithms.types import LossOutput, PolicyLossInputs

LossFn = Callable[[PolicyLossInputs, "AlgorithmConfig"], LossOutput]  # noqa: F821
_REGISTRY: Dict[str, LossFn] = {}


def register_policy_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: make ``fn(inputs, cfg) -> LossOutput`` selectable as ``algo.loss=name``."""
    def wrap(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"policy loss {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn
    return wrap


def get_policy_loss(name: str) -> LossFn:
    """The loss registered as ``name``; ValueError naming the registered ones otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy loss algo.loss={name!r}; registered: "
                         f"{', '.join(registered_policy_losses())}")
    return _REGISTRY[name]


def registered_policy_losses() -> Tuple[str, ...]:
    """Sorted names of every registered loss."""
    return tuple(sorted(_REGISTRY))


def _clip_masks(ratio: torch.Tensor, adv: torch.Tensor, cfg) -> Tuple[torch.Tensor, torch.Tensor]:
    """Where ``min(ratio*A, clip(ratio)*A)`` takes the constant branch, i.e. the gradient is cut."""
    ratio = ratio.detach()
    low = (adv < 0) & (ratio < 1.0 - cfg.clip_eps_low)
    high = (adv > 0) & (ratio > 1.0 + cfg.clip_eps_high)
    return low, high


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, cfg) -> torch.Tensor:
    """``min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` (PPO's pessimistic bound)."""
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    return torch.minimum(ratio * adv, clipped * adv)


def _tis_grad_path(values: torch.Tensor, weights) -> torch.Tensor:
    """``values`` unchanged in value, with each token's gradient multiplied by its TIS weight."""
    if weights is None:
        return values
    return values.detach() + weights * (values - values.detach())


def _seq_mean_token_mean(per_token: torch.Tensor, inputs: PolicyLossInputs) -> torch.Tensor:
    """``sum_i (1/|y_i|) sum_t x_t`` over this rank's tokens (divided by G by the caller)."""
    return (per_token / inputs.seq_token_counts.to(per_token.dtype)[inputs.seq_index]).sum()


def _finish(policy_sum: torch.Tensor, inputs: PolicyLossInputs, cfg, normaliser: int,
            aggregate: Callable[[torch.Tensor], torch.Tensor], metrics: dict) -> LossOutput:
    """Add the KL / entropy penalties (aggregated like the policy term) and normalise."""
    penalty = terms.penalty_per_token(inputs, cfg)
    total = policy_sum if penalty is None else policy_sum + aggregate(penalty)
    metrics.update(terms.common_metrics(inputs))
    return LossOutput(loss=total / normaliser, metrics=metrics)


@register_policy_loss("gspo")
def gspo_loss(inputs: PolicyLossInputs, cfg) -> LossOutput:
    """Sequence-level clipped objective with ``s_i = exp(mean_t l_t)`` (paper Eqs. 5-7, 10)."""
    terms.validate_inputs(inputs, cfg)
    adv = terms.sequence_advantages(inputs)
    weights, metrics = terms.tis_weights(inputs, cfg)
    log_ratio = inputs.logprobs.float() - inputs.old_logprobs.float()
    # Eq. 7 as a mean, never a sum: exp(sum) would vanish / explode with the response length.
    seq_log_ratio = terms.seq_mean(_tis_grad_path(log_ratio, weights), inputs)
    ratio = torch.exp(seq_log_ratio)
    per_seq = -_clipped_objective(ratio, adv, cfg)
    # Metric: the whole sequence's (TIS-weighted) value on every CP rank, so the [sum, count]
    # reduction over CP ranks gives the same mean as one rank.
    full_share = 1.0 if weights is None else terms.seq_mean(weights, inputs)
    metrics["pg_loss"] = metric_mean(per_seq.detach() * full_share)
    if weights is not None or terms.cp_size(inputs) > 1:
        # Value scaled to this rank's share (its tokens' fraction, TIS-weighted), so values sum
        # over CP ranks to the objective and match gspo_token; the gradient is left untouched.
        share = terms.seq_mean(torch.ones_like(log_ratio) if weights is None else weights,
                               inputs, over_cp=False)
        per_seq = per_seq - per_seq.detach() + share * per_seq.detach()
    low, high = _clip_masks(ratio, adv, cfg)
    metrics.update(terms.clip_metrics(low[inputs.seq_index], high[inputs.seq_index], inputs, ratio,
                                      seq_log_ratio, cfg))
    return _finish(per_seq.sum(), inputs, cfg, inputs.global_num_seqs,
                   lambda x: _seq_mean_token_mean(x, inputs), metrics)


@register_policy_loss("gspo_token")
def gspo_token_loss(inputs: PolicyLossInputs, cfg) -> LossOutput:
    """GSPO-token: ``s_i,t = sg[s_i] pi(y_t) / sg[pi(y_t)]`` with per-token advantages (Eq. 13-17)."""
    terms.validate_inputs(inputs, cfg)
    weights, metrics = terms.tis_weights(inputs, cfg)
    logp = inputs.logprobs.float()
    seq_log_ratio = terms.seq_mean((logp - inputs.old_logprobs.float()).detach(), inputs)
    seq_ratio = torch.exp(seq_log_ratio)
    ratio = seq_ratio[inputs.seq_index] * torch.exp(logp - logp.detach())
    adv = inputs.advantages.float()
    per_token = -_clipped_objective(ratio, adv, cfg)
    if weights is not None:
        per_token = per_token * weights
    low, high = _clip_masks(ratio, adv, cfg)
    metrics.update(terms.clip_metrics(low, high, inputs, seq_ratio, seq_log_ratio, cfg))
    aggregate = lambda x: _seq_mean_token_mean(x, inputs)  # noqa: E731
    metrics["pg_loss"] = metric_mean(terms.seq_mean(per_token.detach(), inputs))
    return _finish(aggregate(per_token), inputs, cfg, inputs.global_num_seqs, aggregate, metrics)


@register_policy_loss("grpo")
def grpo_loss(inputs: PolicyLossInputs, cfg) -> LossOutput:
    """Token-level ratios ``r_t = exp(l_t)`` with asymmetric clipping (DAPO clip-higher)."""
    terms.validate_inputs(inputs, cfg)
    weights, metrics = terms.tis_weights(inputs, cfg)
    log_ratio = inputs.logprobs.float() - inputs.old_logprobs.float()
    ratio = torch.exp(log_ratio)
    adv = inputs.advantages.float()
    per_token = -_clipped_objective(ratio, adv, cfg)
    if weights is not None:
        per_token = per_token * weights
    if cfg.grpo_aggregation == "token_mean":
        aggregate, normaliser = (lambda x: x.sum()), inputs.global_num_tokens
    elif cfg.grpo_aggregation == "seq_mean_token_mean":
        aggregate, normaliser = (lambda x: _seq_mean_token_mean(x, inputs)), inputs.global_num_seqs
    else:
        raise ValueError(f"algo.grpo_aggregation={cfg.grpo_aggregation!r}; expected "
                         "'token_mean' or 'seq_mean_token_mean'")
    low, high = _clip_masks(ratio, adv, cfg)
    # The sequence log-ratio is only a diagnostic here (GRPO clips tokens).
    metrics.update(terms.clip_metrics(low, high, inputs, ratio,
                                      terms.seq_mean(log_ratio.detach(), inputs), cfg))
    metrics["pg_loss"] = metric_mean(per_token)
    return _finish(aggregate(per_token), inputs, cfg, normaliser, aggregate, metrics)


@register_policy_loss("sft")
def sft_loss(inputs: PolicyLossInputs, cfg=None) -> LossOutput:
    """Mean negative log-likelihood of the response tokens over the whole mini-batch.

    Dividing by ``global_num_tokens`` (all micro-batches and data-parallel ranks) makes the summed
    micro-batch gradients the gradient of the mini-batch token mean, as for the policy losses.
    """
    if inputs.global_num_tokens <= 0:
        raise ValueError("sft_loss: global_num_tokens must be > 0 (a mini-batch without "
                         "response tokens has nothing to fit)")
    nll = -inputs.logprobs
    metrics = {"sft_nll": metric_mean(nll)}
    if inputs.entropy is not None:
        metrics["entropy"] = metric_mean(inputs.entropy)
    return LossOutput(loss=nll.sum() / inputs.global_num_tokens, metrics=metrics)
