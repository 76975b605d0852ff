"""SGLang server memory: KV bytes per token (K/V heads replicated past TP), weights per GPU, the
KV pool at mem_fraction_static and the sequences that fit."""

from __future__ import annotations

import pytest

from gspo_megatron.planner.hardware import GB, Hardware, parse_memory
from gspo_megatron.planner.model_shape import ModelShape
from gspo_megatron.planner.rollout_memory import (estimate_rollout, kv_bytes_per_token,
                                                  rollout_server_weights)
from gspo_megatron.config import ConfigError

QWEN3_30B = ModelShape(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                       num_query_groups=4, head_dim=128, vocab_size=151936, num_experts=128,
                       moe_router_topk=8, moe_ffn_hidden_size=768)


def test_kv_bytes_per_token():
    # 48 layers x K and V x 128 x bf16, one KV head per rank from TP4 on (4 KV heads).
    assert kv_bytes_per_token(QWEN3_30B, tp=1) == 48 * 2 * 4 * 128 * 2
    assert kv_bytes_per_token(QWEN3_30B, tp=4) == 48 * 2 * 1 * 128 * 2
    assert kv_bytes_per_token(QWEN3_30B, tp=8) == kv_bytes_per_token(QWEN3_30B, tp=4)


def test_weights_and_kv_pool():
    assert rollout_server_weights(QWEN3_30B, 1) == 2 * QWEN3_30B.total_params()
    hw = Hardware(gpu_memory_bytes=80 * GB, reserved_bytes=4 * GB)
    r = estimate_rollout(QWEN3_30B, tp=4, mem_fraction_static=0.8, seq_len=9216, hw=hw)
    assert r.kv_cache_bytes == pytest.approx(0.8 * 76 * GB - r.weights_bytes)
    assert r.max_sequences == int(r.kv_cache_bytes // (48 * 2 * 128 * 2)) // 9216
    assert r.fits and r.max_sequences > 100
    small = estimate_rollout(QWEN3_30B, tp=1, mem_fraction_static=0.5, seq_len=9216, hw=hw)
    assert not small.fits  # 61 GB of weights > 0.5 x 76 GB


def test_parse_memory():
    assert parse_memory("80GB") == 80e9 and parse_memory("80") == 80e9
    assert parse_memory("141GiB") == 141 * 2 ** 30 and parse_memory(96) == 96e9
    with pytest.raises(ConfigError, match="--gpu-memory: cannot read 'lots'"):
        parse_memory("lots")
