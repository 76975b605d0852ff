"""Group-relative advantages (GSPO paper Eq. 6, Dr. GRPO) and zero-variance group handling.

Each prompt gets ``n`` sampled responses (a *group*). The advantage of response i is its reward
relative to the group:

* ``group_norm`` (paper Eq. 6): ``A_i = (r_i - mean(r)) / (std(r) + eps)``;
* ``group_mean`` (Dr. GRPO, arXiv 2503.20783): ``A_i = r_i - mean(r)``.

A group whose rewards are all equal (all solved or all failed) has zero advantage for every
response: it contributes no policy gradient, only noise in the normaliser. Such groups are
detected exactly (``max == min``), their advantages are set to exactly 0 (never NaN, even with
``eps = 0``), and they are reported, or dropped and replaced by new groups (DAPO's dynamic
sampling, arXiv 2503.14476) with :class:`DynamicSamplingBuffer`, which the rollout step
(``trainer/schedule/collect.py``) fills round by round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch

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


@dataclass
class DynamicSamplingBuffer:
    """Collects whole groups over generation rounds until a step has enough of them.

    Each round the caller generates :attr:`num_missing` groups, computes their advantages and
    zero-variance mask (:func:`compute_group_advantages`) and calls :meth:`add`; it stops when
    :attr:`is_full` or its rounds run out, then :meth:`take` returns at most
    ``num_groups_wanted`` groups. With ``drop_zero_variance`` (DAPO's dynamic sampling) groups
    whose rewards are all equal are discarded (:attr:`num_dropped`); without it every group is
    kept and one round fills the buffer. :attr:`num_zero_variance` counts the zero-variance
    groups seen either way, :attr:`num_seen` all groups.
    """

    num_groups_wanted: int
    drop_zero_variance: bool = True
    kept: List[Any] = field(default_factory=list)
    num_seen: int = 0
    num_zero_variance: int = 0
    num_dropped: int = 0

    def add(self, payloads: Sequence[Any], zero_variance_mask: torch.Tensor) -> None:
        """Add one payload per group, with the ``[num_groups]`` bool zero-variance mask."""
        flags = [bool(z) for z in zero_variance_mask.reshape(-1).tolist()]
        if len(flags) != len(payloads):
            raise ValueError(f"zero_variance_mask covers {len(flags)} groups but "
                             f"{len(payloads)} payloads were given (one payload per group)")
        self.num_seen += len(payloads)
        self.num_zero_variance += sum(flags)
        for payload, flat in zip(payloads, flags):
            if flat and self.drop_zero_variance:
                self.num_dropped += 1
            else:
                self.kept.append(payload)

    @property
    def num_missing(self) -> int:
        """Groups still wanted (0 once full)."""
        return max(self.num_groups_wanted - len(self.kept), 0)

    @property
    def is_full(self) -> bool:
        return self.num_missing == 0

    def take(self) -> List[Any]:
        """The first ``num_groups_wanted`` kept groups; surplus groups are discarded."""
        out, self.kept = self.kept[: self.num_groups_wanted], []
        return out
