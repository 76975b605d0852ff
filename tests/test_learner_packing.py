"""Token-balanced DP split and first-fit-decreasing micro-batch packing."""

from __future__ import annotations

import pytest

from gspo_megatron.learner.packing import pack_by_tokens, split_across_dp


def test_dp_split_balances_tokens_and_is_deterministic():
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    shares = split_across_dp(lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert sorted(i for s in shares for i in s) == list(range(8))
    assert abs(loads[0] - loads[1]) <= 1
    assert shares == split_across_dp(lengths, 2)


def test_packing_respects_the_token_budget_and_refuses_too_long_sequences():
    lengths = [5, 9, 3, 7, 2, 6]
    bins = pack_by_tokens(range(6), lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert bins == [[1], [2, 3], [4, 5], [0]]  # first-fit-decreasing: 9 | 7+3 | 6+2 | 5
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens.*max_tokens_per_micro_batch=8"):
        pack_by_tokens(range(6), lengths, 8)
