"""``algorithms/correction.py``: the weight rules at their edges, the trainer's kept fraction
(the same rule on per-sequence lists), and the start-up description. The losses' use of the
weights is checked against a float64 reference in ``test_losses_staleness.py``."""

import math

import pytest
import torch

from gspo_megatron.algorithms.correction import describe, kept_fraction, weigh


def test_truncate_caps_from_above_only_and_says_where_it_bit():
    ratio = torch.tensor([0.01, 0.5, 1.0, 2.0, 2.0001, 50.0])
    weights, bitten = weigh(ratio, "truncate", 2.0)
    assert weights.tolist() == pytest.approx([0.01, 0.5, 1.0, 2.0, 2.0, 2.0])
    assert bitten.tolist() == [False, False, False, False, True, True]


def test_mask_keeps_the_ratio_inside_the_band_and_drops_the_rest():
    ratio = torch.tensor([0.49, 0.5, 0.9, 1.0, 1.7, 2.0, 2.01, 1e6])
    weights, bitten = weigh(ratio, "mask", 2.0)
    assert weights.tolist() == pytest.approx([0.0, 0.5, 0.9, 1.0, 1.7, 2.0, 0.0, 0.0])
    assert bitten.tolist() == [True, False, False, False, False, False, True, True]


def test_off_has_no_weight_to_give():
    with pytest.raises(ValueError, match="has no weight"):
        weigh(torch.ones(2), "off", 2.0)


def _lists(deltas):
    """(old, rollout) per sequence with ``old - rollout = delta``."""
    old = [torch.zeros(len(d)) for d in deltas]
    return old, [o - torch.tensor(d) for o, d in zip(old, deltas)]


def test_kept_fraction_at_sequence_level_uses_the_length_normalised_ratio():
    # sequence means: 0.0 (kept), log 3 (dropped at C = 2), (1.0 - 1.0) / 2 = 0 (kept although
    # each token alone is outside the band)
    old, rollout = _lists([[0.0, 0.0], [math.log(3)], [1.0, -1.0]])
    assert kept_fraction(old, rollout, "mask", "sequence", 2.0) == pytest.approx(2 / 3)
    assert kept_fraction(old, rollout, "mask", "token", 2.0) == pytest.approx(2 / 5)
    assert kept_fraction(old, rollout, "truncate", "sequence", 2.0) == 1.0


def test_kept_fraction_is_zero_when_the_mask_drops_everything():
    old, rollout = _lists([[1.0, 1.0], [-1.0]])
    assert kept_fraction(old, rollout, "mask", "sequence", 2.0) == 0.0
    assert kept_fraction(old, rollout, "mask", "token", 2.0) == 0.0
    assert kept_fraction([], [], "mask", "sequence", 2.0) == 0.0


def test_describe_names_the_role_and_warns_of_token_weights_in_gspo():
    text, warning = describe("truncate", "sequence", 2.0, "gspo", staleness=4)
    assert "truncate at sequence level" in text and "behaviour weight" in text and not warning
    text, warning = describe("off", "sequence", 2.0, "gspo", staleness=4)
    assert "uncorrected ablation" in text and not warning
    assert "ablation" not in describe("off", "sequence", 2.0, "gspo", staleness=0)[0]
    _, warning = describe("mask", "token", 2.0, "gspo", staleness=0)
    assert "advises against" in warning and "algo.tis.level=sequence" in warning
    assert describe("mask", "token", 2.0, "grpo", staleness=0)[1] == ""
