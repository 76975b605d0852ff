"""Group-relative advantages (GSPO paper Eq. 6, Dr. GRPO) and zero-variance group handling.

Each prompt gets ``n`` sampled responses (a *group*). The advantage of response i is its reward
relative to the group:

* ``group_norm`` (paper Eq. 6): ``A_i = (r_i - mean(r)) / (std(r) + eps)``;
* ``group_mean`` (Dr. GRPO, arXiv 2503.20783): ``A_i = r_i - mean(r)``.

A group whose rewards are all equal (all solved or all failed) has zero advantage for every
response: it contributes no policy gradient, only noise in the normaliser. Such groups are
detected exactly (``max == min``), their advantages are set to exactly 0 (never NaN, even with
``eps = 0``), and they are reported, dropped, or replaced by new groups (DAPO's dynamic sampling,
arXiv 2503.14476) with :class:`DynamicSamplingBuffer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from gspo_megatron.algorithms.metrics import metric_mean

ADVANTAGE_MODES = ("group_norm", "group_mean")


def _as_groups(rewards: torch.Tensor, group_size: Optional[int]) -> torch.Tensor:
    if rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size={group_size} disagrees with rewards shape "
                             f"{tuple(rewards.shape)} [num_groups, n]")
        return rewards
    if rewards.dim() != 1 or group_size is None:
        raise ValueError(f"rewards must be [num_groups, n], or flat [num_groups * n] with "
                         f"group_size; got shape {tuple(rewards.shape)}, group_size={group_size}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    return rewards.view(-1, group_size)


def _check_finite(groups: torch.Tensor) -> None:
    bad = ~torch.isfinite(groups)
    if bool(bad.any()):
        g, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"non-finite reward {groups[g, i].item()} in group {g}, sample {i} "
                         f"({int(bad.sum())} non-finite rewards in total); fix the reward function")


def compute_group_advantages(
    rewards: torch.Tensor,
    group_size: Optional[int] = None,
    mode: str = "group_norm",
    eps: float = 1e-6,
    *,
    unbiased_std: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Advantages (same shape as ``rewards``) and the ``[num_groups]`` zero-variance mask.

    Args:
        rewards: ``[num_groups, n]``, or flat ``[num_groups * n]`` (group-major) with ``group_size``.
        mode: ``group_norm`` or ``group_mean`` (see module docstring).
        eps: added to the standard deviation (``group_norm``).
        unbiased_std: Bessel-corrected std (some GRPO implementations); the paper's ``std`` of
            the group is the plain (population) one, the default here.
    Raises:
        ValueError: unknown mode, bad shape, or a NaN / Inf reward (named by group and sample).
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; expected one of {ADVANTAGE_MODES}")
    groups = _as_groups(rewards, group_size).to(torch.float32)
    _check_finite(groups)
    zero_var = groups.amax(dim=1) == groups.amin(dim=1)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if mode == "group_norm":
        if groups.shape[1] < 2:
            raise ValueError("group_norm advantages need >= 2 samples per group")
        std = groups.std(dim=1, keepdim=True, unbiased=unbiased_std)
        centred = centred / (std + eps)
    advantages = torch.where(zero_var.unsqueeze(1), torch.zeros_like(centred), centred)
    return advantages.view(rewards.shape), zero_var


def drop_zero_variance_groups(zero_variance_mask: torch.Tensor,
                              *per_group: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Keep only informative groups of each ``[num_groups, ...]`` tensor (DAPO dynamic sampling)."""
    keep = ~zero_variance_mask.bool()
    out = []
    for t in per_group:
        if t.shape[0] != keep.shape[0]:
            raise ValueError(f"tensor with leading size {t.shape[0]} cannot be filtered by a "
                             f"mask over {keep.shape[0]} groups")
        out.append(t[keep])
    return tuple(out)


def advantage_metrics(rewards: torch.Tensor, zero_variance_mask: torch.Tensor) -> Dict[str, torch.Tensor]:
    """``[sum, count]`` metrics of one batch: reward mean, in-group reward std, zero-variance
    group fraction (the groups that carry no gradient)."""
    groups = rewards.reshape(zero_variance_mask.shape[0], -1).to(torch.float64)
    return {
        "reward_mean": metric_mean(groups.flatten()),
        "reward_group_std_mean": metric_mean(groups.std(dim=1, unbiased=False)),
        "zero_variance_group_frac": metric_mean(zero_variance_mask.to(torch.float64)),
    }


@dataclass
class DynamicSamplingBuffer:
    """Collects informative groups over generation rounds until a step has enough of them.

    The loop generates a batch, calls :meth:`add` with each group's rewards and payload, and
    generates again (up to ``max_rounds`` extra rounds) while :attr:`is_full` is False; then
    :meth:`take` returns at most ``num_groups_wanted`` groups (fewer if the rounds ran out).
    :attr:`num_dropped` counts the zero-variance groups discarded, :attr:`num_seen` all groups.
    """

    num_groups_wanted: int
    kept: List[Any] = field(default_factory=list)
    num_seen: int = 0
    num_dropped: int = 0

    def add(self, rewards: torch.Tensor, payloads: Sequence[Any]) -> torch.Tensor:
        """Add ``[num_groups, n]`` rewards with one payload per group; returns the zero-var mask."""
        if rewards.dim() != 2 or rewards.shape[0] != len(payloads):
            raise ValueError(f"rewards {tuple(rewards.shape)} must be [num_groups, n] with one "
                             f"payload per group ({len(payloads)} given)")
        _check_finite(rewards.to(torch.float32))
        zero_var = rewards.amax(dim=1) == rewards.amin(dim=1)
        self.num_seen += len(payloads)
        self.num_dropped += int(zero_var.sum())
        self.kept.extend(p for p, z in zip(payloads, zero_var.tolist()) if not z)
        return zero_var

    @property
    def is_full(self) -> bool:
        return len(self.kept) >= self.num_groups_wanted

    def take(self) -> List[Any]:
        """The first ``num_groups_wanted`` informative groups; surplus groups are discarded."""
        out, self.kept = self.kept[: self.num_groups_wanted], []
        return out
