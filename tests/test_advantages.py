"""Group advantages (paper Eq. 6 and Dr. GRPO), zero-variance groups, dynamic sampling."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.algorithms.advantages import DynamicSamplingBuffer, compute_group_advantages


def test_group_norm_is_paper_eq6_per_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.4, 0.9, 0.5]])
    adv, zero_var = compute_group_advantages(rewards, mode="group_norm", eps=1e-6)
    for g in range(2):
        r = rewards[g]
        expected = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
        torch.testing.assert_close(adv[g], expected)
    assert zero_var.tolist() == [False, False]
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    unbiased, _ = compute_group_advantages(rewards, mode="group_norm", unbiased_std=True)
    torch.testing.assert_close(unbiased[1], (rewards[1] - rewards[1].mean()) / (rewards[1].std() + 1e-6))


def test_flat_rewards_with_group_size_and_group_mean_mode():
    flat = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    adv, zero_var = compute_group_advantages(flat, group_size=3, mode="group_mean")
    assert adv.shape == flat.shape
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])
    assert zero_var.tolist() == [False, True]


def test_zero_variance_groups_get_exact_zeros_never_nan():
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    for mode in ("group_norm", "group_mean"):
        adv, zero_var = compute_group_advantages(rewards, mode=mode, eps=0.0)
        assert bool(torch.isfinite(adv).all())
        assert bool((adv[:2] == 0).all()) and bool((adv[2] != 0).all())
        assert zero_var.tolist() == [True, True, False]


def test_non_finite_rewards_and_bad_shapes_raise_clear_errors():
    rewards = torch.tensor([[0.0, 1.0], [float("nan"), 1.0]])
    with pytest.raises(ValueError, match="non-finite reward nan in group 1, sample 0"):
        compute_group_advantages(rewards)
    with pytest.raises(ValueError, match="non-finite reward inf in group 0, sample 1"):
        compute_group_advantages(torch.tensor([0.0, float("inf")]), group_size=2)
    with pytest.raises(ValueError, match="cannot be split into groups of 4"):
        compute_group_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="unknown advantage mode 'median'"):
        compute_group_advantages(torch.zeros(2, 2), mode="median")


def test_dynamic_sampling_buffer_refills_until_full():
    buf = DynamicSamplingBuffer(num_groups_wanted=3)
    _, zero_var = compute_group_advantages(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]))
    buf.add(["a", "b", "c"], zero_var)
    assert not buf.is_full and buf.num_missing == 2 and buf.num_dropped == 2
    buf.add(["d", "e", "f"], torch.tensor([False, False, False]))
    assert buf.is_full and buf.num_missing == 0 and buf.take() == ["b", "d", "e"]
    assert (buf.num_seen, buf.num_zero_variance, buf.num_dropped, buf.kept) == (6, 2, 2, [])
    with pytest.raises(ValueError, match="one payload per group"):
        buf.add(["x"], torch.tensor([False, True]))


def test_without_dropping_the_buffer_keeps_flat_groups_and_counts_them():
    buf = DynamicSamplingBuffer(num_groups_wanted=2, drop_zero_variance=False)
    buf.add(["a", "b"], torch.tensor([True, False]))
    assert buf.is_full and buf.take() == ["a", "b"]
    assert (buf.num_zero_variance, buf.num_dropped) == (1, 0)
