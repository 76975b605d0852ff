"""Pieces shared by the policy losses: input checks, per-sequence means, TIS weights, penalties,
and the metrics every loss reports.

Kept apart from ``losses.py`` so that each registered loss reads as its paper equation.
All per-token tensors are ``[num_tokens]`` in the flat layout of :class:`PolicyLossInputs`.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from gspo_megatron.algorithms import correction
from gspo_megatron.algorithms.lag_diagnostics import lag_clip_metrics
from gspo_megatron.algorithms.length_diagnostics import length_diagnostics
from gspo_megatron.algorithms.logprobs import sequence_sums
from gspo_megatron.algorithms.metrics import metric_max, metric_mean, metric_min, metric_rows
from gspo_megatron.algorithms.types import PolicyLossInputs

Metrics = Dict[str, torch.Tensor]


def cp_size(inputs: PolicyLossInputs) -> int:
    group = inputs.cp_group
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def validate_inputs(inputs: PolicyLossInputs, cfg) -> None:
    """Shapes, normalisers, finiteness of the given (non-learner) inputs, and config needs."""
    n = inputs.logprobs.shape
    named = {"old_logprobs": inputs.old_logprobs, "advantages": inputs.advantages,
             "seq_index": inputs.seq_index, "entropy": inputs.entropy,
             "ref_logprobs": inputs.ref_logprobs, "rollout_logprobs": inputs.rollout_logprobs,
             "token_lag": inputs.token_lag}
    if inputs.logprobs.dim() != 1:
        raise ValueError(f"PolicyLossInputs.logprobs must be 1-D [num_tokens], got {tuple(n)}")
    for name, t in named.items():
        if t is not None and t.shape != n:
            raise ValueError(f"PolicyLossInputs.{name} has shape {tuple(t.shape)}, expected {tuple(n)}")
    if inputs.seq_token_counts.shape != (inputs.num_seqs,):
        raise ValueError(f"PolicyLossInputs.seq_token_counts has shape "
                         f"{tuple(inputs.seq_token_counts.shape)}, expected ({inputs.num_seqs},)")
    if inputs.global_num_seqs < 1 or inputs.global_num_tokens < 1:
        raise ValueError(f"global_num_seqs={inputs.global_num_seqs} and global_num_tokens="
                         f"{inputs.global_num_tokens} must be >= 1")
    _check_counts(inputs)
    _check_token_lag(inputs.token_lag)
    for name in ("old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs"):
        t = named[name]
        if t is not None and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).nonzero()[0])
            raise ValueError(f"PolicyLossInputs.{name} is not finite at token {bad} "
                             f"(value {t[bad].item()}, sequence {int(inputs.seq_index[bad])})")
    if cfg.kl_coef > 0 and inputs.ref_logprobs is None:
        raise ValueError("algo.kl_coef > 0 needs PolicyLossInputs.ref_logprobs")
    if cfg.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError("algo.entropy_coef > 0 needs PolicyLossInputs.entropy")
    if cfg.tis.mode not in ("off", "truncate", "mask") or (
            cfg.tis.mode != "off" and cfg.tis.level not in ("token", "sequence")):
        raise ValueError(f"algo.tis.mode={cfg.tis.mode!r}, algo.tis.level={cfg.tis.level!r}: "
                         "expected off / truncate / mask and token / sequence (an 'auto' is "
                         "resolved against the run's rollout.max_staleness when the config is "
                         "loaded: config.schema.resolve_correction)")
    if cfg.tis.mode != "off" and inputs.rollout_logprobs is None:
        raise ValueError(f"algo.tis.mode={cfg.tis.mode} needs PolicyLossInputs.rollout_logprobs "
                         "(the engine's log-probs of the sampled tokens)")


def _check_counts(inputs: PolicyLossInputs) -> None:
    counts = inputs.seq_token_counts
    idx = inputs.seq_index
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= inputs.num_seqs):
        raise ValueError(f"seq_index must lie in [0, {inputs.num_seqs}); got "
                         f"[{int(idx.min())}, {int(idx.max())}]")
    if counts.numel() and int(counts.min()) < 1:
        raise ValueError(f"sequence {int(counts.argmin())} has seq_token_counts "
                         f"{int(counts.min())}; every sequence needs >= 1 response token")
    local = torch.bincount(idx, minlength=inputs.num_seqs)
    bad = (local != counts) if cp_size(inputs) == 1 else (local > counts)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"sequence {i} has {int(local[i])} tokens here but seq_token_counts "
                         f"says {int(counts[i])}")


def _check_token_lag(lag: Optional[torch.Tensor]) -> None:
    if lag is None:
        return
    if lag.dtype.is_floating_point or lag.dtype.is_complex or lag.dtype == torch.bool:
        raise ValueError(f"PolicyLossInputs.token_lag must hold integers (int64), got {lag.dtype}")
    if lag.numel() and int(lag.min()) < 0:
        bad = int((lag < 0).nonzero()[0])
        raise ValueError(f"PolicyLossInputs.token_lag is {int(lag[bad])} at token {bad}; a lag "
                         "(learner version minus the token's version) is >= 0")


def seq_mean(values: torch.Tensor, inputs: PolicyLossInputs, over_cp: bool = True) -> torch.Tensor:
    """``[num_seqs]`` per-sequence ``sum / full length`` (the full length counts all CP ranks)."""
    group = inputs.cp_group if over_cp else None
    sums = sequence_sums(values, inputs.seq_index, inputs.num_seqs, group)
    return sums / inputs.seq_token_counts.to(sums.dtype)


def sequence_max(values: torch.Tensor, inputs: PolicyLossInputs) -> torch.Tensor:
    """``[num_seqs]`` per-sequence max of non-negative per-token ``values`` (detached; a
    sequence without tokens here gives 0), over the CP group."""
    out = torch.zeros(inputs.num_seqs, dtype=values.dtype, device=values.device)
    out = out.scatter_reduce(0, inputs.seq_index, values.detach(), reduce="amax")
    if cp_size(inputs) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=inputs.cp_group)
    return out


def sequence_advantages(inputs: PolicyLossInputs) -> torch.Tensor:
    """``[num_seqs]`` advantage of each sequence; refuses per-token advantages (use gspo_token)."""
    adv = seq_mean(inputs.advantages.detach(), inputs)
    spread = (inputs.advantages - adv[inputs.seq_index]).abs()
    if spread.numel() and float(spread.max()) > 1e-5 * (1.0 + float(adv.abs().max())):
        i = int(inputs.seq_index[spread.argmax()])
        raise ValueError(f"advantages vary within sequence {i}; the sequence-level 'gspo' loss "
                         "needs one advantage per sequence (use 'gspo_token' for per-token ones)")
    return adv


def tis_weights(inputs: PolicyLossInputs, cfg) -> Tuple[Optional[torch.Tensor], Metrics]:
    """The importance correction's weight per token (detached; ``algorithms/correction.py``),
    or None when ``algo.tis.mode=off``.

    Sequence level uses the length-normalised ratio ``exp(mean_t(old - rollout))`` (as GSPO's
    Eq. 7 does): ``exp(sum)`` would collapse toward 0 or explode on long responses, and its
    metrics are means over sequences (each sequence once, whatever its length).
    With stale rollouts ``old`` is the proximal policy and ``rollout`` the behaviour policy (each
    token's own weight version), and this is the decoupled objective's behaviour weight
    (``docs/algorithms.md``, "Stale rollouts").
    """
    if cfg.tis.mode == "off":
        return None, {}
    delta = (inputs.old_logprobs - inputs.rollout_logprobs).detach().float()
    if cfg.tis.level == "sequence":
        per_seq, bitten = correction.weigh(torch.exp(seq_mean(delta, inputs)), cfg.tis.mode,
                                           cfg.tis.cap)
        weights = per_seq[inputs.seq_index]
        reported = per_seq  # every CP rank holds the same [num_seqs] values: the mean is kept
    else:
        weights, bitten = correction.weigh(torch.exp(delta), cfg.tis.mode, cfg.tis.cap)
        reported = weights
    name = "tis_truncated_frac" if cfg.tis.mode == "truncate" else "tis_masked_frac"
    return weights, {"tis_weight_mean": metric_mean(reported), name: metric_mean(bitten.double())}


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL from ``log_ratio = log(q / p)`` with samples from p."""
    return torch.exp(log_ratio) - log_ratio - 1.0


def penalty_per_token(inputs: PolicyLossInputs, cfg) -> Optional[torch.Tensor]:
    """``kl_coef * k3(ref || policy) - entropy_coef * H`` per token (differentiable), or None."""
    terms = []
    if cfg.kl_coef > 0:
        terms.append(cfg.kl_coef * k3(inputs.ref_logprobs - inputs.logprobs))
    if cfg.entropy_coef > 0:
        terms.append(-cfg.entropy_coef * inputs.entropy)
    return sum(terms) if terms else None


def common_metrics(inputs: PolicyLossInputs) -> Metrics:
    """KL(old || new), entropy, reference KL and the engine-vs-learner mismatch.

    ``approx_kl`` estimates KL(pi_old || pi_theta) per token from tokens sampled by pi_old:
    k3 with ``log(pi_theta / pi_old)``, i.e. ``exp(l) - 1 - l`` (unbiased, >= 0).
    The mismatch compares the learner's ``old_logprobs`` with the engine's ``rollout_logprobs``
    (``delta_t = old_t - rollout_t``; on-policy the same weights in two engines, with stale
    rollouts also the lag) per token and per sequence: ``|delta|`` (token mean and max), the
    sequence's ``|mean_t delta_t|`` (mean and max over sequences), the per-sequence mean and max
    of ``|delta_t|`` averaged over sequences (verl's diagnostics), and two estimates from the
    engine's samples: ``mismatch_kl``, k3 of KL(pi_rollout || pi_old) per token, and
    ``mismatch_chi2_token`` / ``mismatch_chi2_seq``, ``E[(r - 1)^2]`` of the token ratio and of
    the length-normalised sequence ratio (the variance an importance weight adds).
    """
    log_ratio = (inputs.logprobs - inputs.old_logprobs).detach()
    out: Metrics = {"approx_kl": metric_mean(k3(log_ratio))}
    if inputs.entropy is not None:
        out["entropy"] = metric_mean(inputs.entropy)
    if inputs.ref_logprobs is not None:
        out["kl_ref"] = metric_mean(k3(inputs.ref_logprobs - inputs.logprobs.detach()))
    if inputs.rollout_logprobs is not None:
        delta = (inputs.old_logprobs - inputs.rollout_logprobs).detach().float()
        seq_delta = seq_mean(delta, inputs)
        per_seq = seq_delta.abs()
        out.update(mismatch_token_abs_mean=metric_mean(delta.abs()),
                   mismatch_token_abs_max=metric_max(delta.abs()),
                   mismatch_seq_abs_mean=metric_mean(per_seq),
                   mismatch_seq_abs_max=metric_max(per_seq),
                   mismatch_seq_token_abs_mean=metric_mean(seq_mean(delta.abs(), inputs)),
                   mismatch_seq_token_abs_max_mean=metric_mean(
                       sequence_max(delta.abs(), inputs)),
                   mismatch_kl=metric_mean(k3(delta)),
                   mismatch_chi2_token=metric_mean(torch.expm1(delta) ** 2),
                   mismatch_chi2_seq=metric_mean(torch.expm1(seq_delta) ** 2))
    return out


def clip_metrics(low_tok: torch.Tensor, high_tok: torch.Tensor, inputs: PolicyLossInputs,
                 ratio: torch.Tensor, seq_log_ratio: torch.Tensor, cfg) -> Metrics:
    """Clipped fractions (tokens whose gradient clipping removed, low / high side separately;
    sequences with any such token), the min / mean / max of the clipped ratio, the same by
    response length with the sequence log-ratios ``[num_seqs]`` (``length_diagnostics.py``),
    and by policy lag when ``inputs.token_lag`` is given (``lag_diagnostics.py``)."""
    clipped = (low_tok | high_tok).double()
    per_seq = sequence_sums(clipped, inputs.seq_index, inputs.num_seqs, inputs.cp_group) > 0
    ratio = ratio.detach().double()
    num_tokens, num_seqs = float(clipped.numel()), float(per_seq.numel())
    sums = torch.stack([low_tok.double().sum(), high_tok.double().sum(), clipped.sum(),
                        per_seq.double().sum(), ratio.sum()])
    counts = torch.tensor([num_tokens, num_tokens, num_tokens, num_seqs, float(ratio.numel())],
                          dtype=torch.float64, device=sums.device)
    out = metric_rows(["clip_frac_token_low", "clip_frac_token_high", "clip_frac_token",
                       "clip_frac_seq", "ratio_mean"], sums, counts)
    out.update(ratio_min=metric_min(ratio), ratio_max=metric_max(ratio))
    out.update(length_diagnostics(seq_log_ratio, per_seq, clipped > 0, inputs.seq_token_counts,
                                  inputs.seq_index, cfg.diagnostics))
    if inputs.token_lag is not None:
        out.update(lag_clip_metrics(clipped > 0, per_seq, inputs.token_lag, inputs.seq_index,
                                    inputs.cp_group))
    return out
