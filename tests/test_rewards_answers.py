"""Final-answer extraction and normalisation used by exact_match and format."""

from __future__ import annotations

import pytest

from gspo_megatron.rewards.answers import extract_final_answer, extract_last_boxed, normalize_answer


def test_last_boxed_with_nested_braces():
    text = r"first \boxed{1} then \boxed{\frac{1}{2}} end"
    assert extract_last_boxed(text) == r"\frac{1}{2}"
    assert extract_last_boxed(r"\fbox{3}") == "3"
    assert extract_last_boxed(r"unclosed \boxed{1") is None
    assert extract_last_boxed("nothing") is None


@pytest.mark.parametrize("text,expected", [
    (r"so \boxed{12}", "12"),
    ("work...\n#### 7\nextra", "7"),
    ("Final answer: 5", "5"),
    ("The answer is 9.", "9."),
    ("  46 ", "  46 "),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize("raw,expected", [
    ("$42$.", "42"), ("1,000", "1000"), (r"\text{Yes}", "yes"), ("  a   b ", "a b"), ("3.5", "3.5"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected
