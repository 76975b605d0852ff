"""The importance correction against the rollout engine (``algo.tis``): one rule shared by the
losses (``loss_terms.tis_weights``) and by the trainer's check that a mini-batch keeps anything
(:func:`kept_fraction`), so the two agree (up to the rounding of a mean at the band's edge).

With ``delta_t = log pi_old(y_t) - log pi_rollout(y_t)`` (the learner's recomputation against
the engine's log-prob as sampled) the ratio is ``r_t = exp(delta_t)`` at token level and the
length-normalised ``r_i = exp(mean_t delta_t)`` at sequence level. The weight is

* ``truncate`` (TIS): ``w = min(r, C)``: every token or sequence trains, the ones the engine
  under-sampled relative to the learner at most C times as much;
* ``mask`` (masked IS, as ICEPOP at token level and sequence masking at sequence level):
  ``w = r`` inside ``[1/C, C]`` and 0 outside: a token or sequence whose two likelihoods
  disagree by more than a factor C is dropped from the gradient.

A masked unit still counts in the loss's normaliser (``G`` sequences, or the tokens of
``token_mean``), as in ICEPOP's objective: dropping a unit removes its gradient without
scaling up the others', so the step shrinks when the engine and learner disagree the most.
The derivations and the choice of default are in ``docs/algorithms.md``.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def weigh(ratio: torch.Tensor, mode: str, cap: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(weights, bitten)`` for ``ratio`` (any shape): the weight of each unit and whether the
    cap truncated it (``truncate``) or the band dropped it (``mask``)."""
    if mode == "truncate":
        bitten = ratio > cap
        return torch.clamp(ratio, max=cap), bitten
    if mode == "mask":
        inside = (ratio >= 1.0 / cap) & (ratio <= cap)
        return torch.where(inside, ratio, torch.zeros_like(ratio)), ~inside
    raise ValueError(f"algo.tis.mode={mode!r} has no weight; expected 'truncate' or 'mask'")


def kept_fraction(old_logprobs: Sequence[torch.Tensor], rollout_logprobs: Sequence[torch.Tensor],
                  mode: str, level: str, cap: float) -> float:
    """The fraction of a mini-batch's units (sequences or tokens, by ``level``) whose weight is
    not 0: 1.0 unless ``mode`` is ``mask``. 0.0 means the update would have no gradient at all
    (the trainer skips it and counts it rather than let Adam step on momentum alone)."""
    if mode != "mask":
        return 1.0
    deltas: List[torch.Tensor] = [(o.float() - r.float()) for o, r in
                                  zip(old_logprobs, rollout_logprobs)]
    if not deltas:
        return 0.0
    if level == "sequence":
        ratios = torch.exp(torch.stack([d.mean() for d in deltas]))
    else:
        ratios = torch.exp(torch.cat(deltas))
    weights, _ = weigh(ratios, mode, cap)
    return float((weights > 0).double().mean())


def describe(mode: str, level: str, cap: float, loss: str, staleness: int) -> Tuple[str, str]:
    """``(what runs, a warning or "")`` for the start-up log."""
    role = ("the decoupled objective's behaviour weight (rollout.max_staleness="
            f"{staleness}: staleness and engine mismatch)" if staleness >= 2
            else "the engine / learner mismatch")
    if mode == "off":
        text = ("importance correction off" + (" (the uncorrected ablation: rollout.max_staleness"
                                               f"={staleness} trains on stale samples unweighted)"
                                               if staleness >= 2 else ""))
    else:
        rule = "min(r, C)" if mode == "truncate" else "r inside [1/C, C], else 0"
        text = f"importance correction {mode} at {level} level, w = {rule}, C = {cap}: {role}"
    warning = ""
    if mode != "off" and level == "token" and loss in ("gspo", "gspo_token"):
        warning = (f"algo.tis.level=token with algo.loss={loss}: token weights inside GSPO's "
                   "sequence ratio make it GSPO-token with per-token weights, which "
                   "docs/algorithms.md advises against (use algo.tis.level=sequence or auto)")
    return text, warning
