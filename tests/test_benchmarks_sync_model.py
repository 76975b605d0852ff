"""Tests of the weight-sync calculator (weight_sync/estimate.py)."""

import doctest

import pytest

from gspo_megatron.rollout.tiny_model import build_tiny_policy
from gspo_megatron.weight_sync import estimate
from gspo_megatron.weight_sync.estimate import QWEN3_30B_A3B, estimate_broadcast, qwen3_moe_num_params


def test_param_count_matches_a_real_hf_model():
    model, _ = build_tiny_policy(hidden_size=64, num_layers=2, num_experts=4, moe_ffn_hidden_size=64)
    c = model.config
    n = qwen3_moe_num_params(c.hidden_size, c.num_hidden_layers, c.num_experts, c.moe_intermediate_size,
                             c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size)
    assert n == sum(p.numel() for p in model.parameters())


def test_qwen3_30b_a3b_floor():
    num_bytes = qwen3_moe_num_params(**QWEN3_30B_A3B) * 2
    assert 60.5e9 < num_bytes < 61.5e9  # ~30.5B parameters in bf16
    e = estimate_broadcast(num_bytes, link_gb_per_s=50)
    assert e.floor_s == pytest.approx(num_bytes / 50e9)
    assert e.estimate_s > e.floor_s and e.num_buckets == 114
    with pytest.raises(ValueError):
        estimate_broadcast(1, 0)


def test_docstring_examples():
    assert doctest.testmod(estimate).failed == 0
