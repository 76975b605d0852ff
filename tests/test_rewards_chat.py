"""Chat-model rewards: the thinking block is removed before the answer is read (an unclosed one
means no answer), the answer is boxed / after a marker / the last number; brevity is a smooth
length reward that differs between random samples and cannot be gamed with an open <think>."""

from __future__ import annotations

import random

import pytest

from gspo_megatron.rewards import get_reward_fn


@pytest.mark.parametrize("response,expected", [
    ("46", 1.0),
    ("12+34=46", 1.0),
    ("The answer is 46.", 1.0),
    ("<think>\n12+34 is 45? no, 46\n</think>\n\nIt is \\boxed{46}", 1.0),
    ("<think>\nthe answer is 46\n</think>\n\nI am not sure: 45", 0.0),  # the reasoning is not read
    ("<think>\nthe answer is 46 but let me check", 0.0),              # cut off while thinking
    ("Total: 1,046", 0.0),
    ("forty-six", 0.0),
    ("", 0.0),
])
def test_final_number(response, expected):
    assert get_reward_fn("final_number")(response, "46", {"a": 12, "b": 34}) == expected


def test_final_number_reads_thousands_and_negatives():
    fn = get_reward_fn("final_number")
    assert fn("so 1,046", "1046", None) == 1.0 and fn("x = -3", "-3", None) == 1.0


def test_brevity_is_smooth_bounded_and_not_gamed_by_an_open_think():
    fn = get_reward_fn("brevity")
    assert fn("", "", None) == 1.0
    assert fn("x" * 64, "", None) == pytest.approx(0.5)
    assert fn("<think>" + "x" * 57, "", None) == pytest.approx(0.5)
    rng = random.Random(0)
    pieces = ["Ġthe", "ing", "的", " 1", "ĠHelloWorld", "x", "ĠQuadrilateral"]
    samples = ["".join(rng.choice(pieces) for _ in range(16)) for _ in range(8)]
    rewards = [fn(s, "46", None) for s in samples]
    assert all(0.0 < r < 1.0 for r in rewards) and len(set(rewards)) > 4  # signal for GSPO
