"""Tests of the weight-sync prediction (benchmarks/sync_model.py)."""

import doctest
from dataclasses import replace

import pytest

from benchmarks import sync_model
from benchmarks.sync_model import QWEN3_30B_A3B, Hardware, LearnerLayout, predict, tensor_counts
from gspo_megatron.checkpoint import mapping
from gspo_megatron.config.schema import ModelConfig
from gspo_megatron.tiny_task.model import build_tiny_policy


def test_param_count_matches_a_real_hf_model():
    model, _ = build_tiny_policy(hidden_size=64, num_layers=2, num_experts=4, moe_ffn_hidden_size=64)
    c = model.config
    shape = replace(QWEN3_30B_A3B, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                    num_experts=c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size,
                    moe_router_topk=c.num_experts_per_tok, ffn_hidden_size=c.intermediate_size,
                    num_attention_heads=c.num_attention_heads,
                    num_query_groups=c.num_key_value_heads, head_dim=c.head_dim,
                    vocab_size=c.vocab_size, tie_word_embeddings=c.tie_word_embeddings)
    assert shape.total_params() == sum(p.numel() for p in model.parameters())
    assert QWEN3_30B_A3B.total_params() == 30_532_122_624  # Qwen3-30B-A3B's safetensors


def test_tensor_counts_match_the_mapping():
    cfg = ModelConfig(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                      head_dim=128, vocab_size=151936, num_experts=128, moe_ffn_hidden_size=768,
                      qk_layernorm=True, tie_word_embeddings=False)
    n = tensor_counts(QWEN3_30B_A3B)
    assert n["canonical"] == len(mapping.canonical_names(cfg)) == 12627
    assert n["hf"] == len(mapping.expected_hf_shapes(cfg)) == 18867  # the issue's ~18.9k


def test_production_prediction():
    p = predict()
    assert 60.5e9 < p["bytes"] < 61.5e9 and p["floor"] == pytest.approx(p["bytes"] / 50e9)
    assert p["buckets"] == 57 and p["staged_collectives"] == 57  # TP2: one gather per bucket
    assert p["old_collectives"] == pytest.approx(98 + 12288 * 7 / 8)
    assert p["floor"] < p["staged"] < p["old"]
    free = replace(Hardware(), collective_latency_s=0, python_per_tensor_s=0, http_round_trip_s=0,
                   nvlink_gb_per_s=1e9)
    assert predict(hw=free)["staged"] == pytest.approx(p["floor"], rel=1e-3)  # only the link left
    spread = predict(layout=LearnerLayout(tp=1, ep=16, etp=1))  # EP over two nodes: gather on the link
    assert spread["staged_gather"] > p["staged_gather"] * 5


def test_docstring_examples():
    assert doctest.testmod(sync_model).failed == 0
