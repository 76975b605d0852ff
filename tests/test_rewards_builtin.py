"""Built-in rewards: math_verify on real cases, exact_match, format, tiny_addition, tiny_repeat."""

from __future__ import annotations

import pytest

from gspo_megatron.rewards import get_reward_fn


@pytest.mark.parametrize("response,answer,expected", [
    (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"$x = 3/4$", r"\frac{3}{4}", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{7}", "8", 0.0),
    ("I do not know", "5", 0.0),
])
def test_math_verify(response, answer, expected):
    assert get_reward_fn("math_verify")(response, answer, None) == expected


def test_math_verify_unparseable_reference_raises():
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        get_reward_fn("math_verify")(r"\boxed{1}", "", None)


@pytest.mark.parametrize("response,answer,expected", [
    (r"thinking... \boxed{1,000}", "1000", 1.0),
    ("Final Answer: $42$.", "42", 1.0),
    ("#### 7\nmore text", r"\boxed{7}", 1.0),
    ("46", "46", 1.0),
    ("the answer is 45", "46", 0.0),
    ("", "", 0.0),
])
def test_exact_match(response, answer, expected):
    assert get_reward_fn("exact_match")(response, answer, None) == expected


@pytest.mark.parametrize("response,expected", [
    (r"reasoning, then \boxed{x+1}", 1.0),
    (r"\boxed{}", 0.0),
    (r"\boxed{1} and \boxed{2}", 0.0),
    (r"\boxed{1", 0.0),
    ("42", 0.0),
])
def test_format(response, expected):
    assert get_reward_fn("format")(response, "", None) == expected


def test_tiny_addition_counts_only_the_digits_before_eos():
    from gspo_megatron.rewards.builtin import addition_reward

    assert get_reward_fn("tiny_addition") is addition_reward
    assert addition_reward("46", "46") == 1.0
    assert addition_reward(" 46 ", "46") == 1.0
    assert addition_reward("46<eos>12", "46") == 1.0
    assert addition_reward("461", "46") == 0.0
    assert addition_reward("4", "46") == 0.0
    assert addition_reward("", "46") == 0.0
    assert addition_reward("4 6", "46") == 0.0
    assert addition_reward("+46", "46") == 0.0


def test_tiny_repeat_is_exact_before_eos():
    from gspo_megatron.rewards.builtin import repeat_reward

    answer = "7" * 12
    assert get_reward_fn("tiny_repeat") is repeat_reward
    assert repeat_reward(answer, answer) == 1.0
    assert repeat_reward(answer + "<eos>", answer) == 1.0
    assert repeat_reward(answer + "<eos>777*3=", answer) == 1.0   # text after eos is not read
    assert repeat_reward("7" * 11, answer) == 0.0                 # cut short (truncated)
    assert repeat_reward("7" * 13, answer) == 0.0                 # one too many
    assert repeat_reward("7" * 41, answer) == 0.0                 # ran to max_new_tokens
    assert repeat_reward("7" * 11 + "1", answer) == 0.0           # a wrong digit
    assert repeat_reward("777777 777777", answer) == 0.0
    assert repeat_reward("", answer) == 0.0 and repeat_reward("<eos>" + answer, answer) == 0.0
    assert repeat_reward("5", "5") == 1.0
