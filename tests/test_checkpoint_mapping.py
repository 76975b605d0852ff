"""The HF <-> Megatron mapping without Megatron: canonical names for Transformer Engine and local
specs and all three expert layouts, GQA-grouped QKV fusion, gate/up TP slicing, vocab padding,
tied embeddings, and clear errors for unknown names."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.checkpoint import mapping
from gspo_megatron.config.schema import ModelConfig

CFG = ModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=8, num_attention_heads=4,
                  num_query_groups=2, head_dim=2, vocab_size=10, num_experts=4,
                  moe_ffn_hidden_size=6)


def _offset(i: int) -> int:
    return i + 10  # e.g. the second pipeline stage


@pytest.mark.parametrize("local,canonical", [
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",  # TE
     "decoder.layers.10.input_layernorm.weight"),
    ("decoder.layers.1.input_layernorm.weight", "decoder.layers.11.input_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight",  # TE dense
     "decoder.layers.10.pre_mlp_layernorm.weight"),
    ("decoder.layers.0.self_attention.q_layernorm.weight",
     "decoder.layers.10.self_attention.q_layernorm.weight"),
    ("decoder.layers.0.mlp.router.weight", "decoder.layers.10.mlp.router.weight"),
    ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",  # sequential
     "decoder.layers.10.mlp.experts.local_experts.3.linear_fc2.weight"),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight1",  # TE grouped GEMM
     "decoder.layers.10.mlp.experts.local_experts.3.linear_fc1.weight"),
    ("output_layer.weight", "output_layer.weight"),
])
def test_canonical_names(local, canonical):
    assert mapping.canonical_name(local, _offset, expert_offset=2) == canonical


def test_unknown_names_are_refused():
    with pytest.raises(mapping.MappingError, match="'decoder.layers.0.mlp.shared_expert.w'"):
        mapping.canonical_name("decoder.layers.0.mlp.shared_expert.w", _offset, 0)
    with pytest.raises(mapping.MappingError, match="unknown Megatron parameter 'foo.bias'"):
        mapping.canonical_name("foo.bias", _offset, 0)
    assert mapping.legacy_grouped_fc("decoder.layers.3.mlp.experts.weight2") == "linear_fc2"
    assert mapping.legacy_grouped_fc("decoder.layers.3.mlp.linear_fc2.weight") is None


def test_qkv_fusion_follows_gqa_groups():
    h, hd = CFG.hidden_size, CFG.head_dim
    q = torch.arange(4 * hd * h, dtype=torch.float32).reshape(4 * hd, h)
    k = -torch.arange(2 * hd * h, dtype=torch.float32).reshape(2 * hd, h) - 1
    v = k - 1000
    qkv = mapping.fuse_qkv(q, k, v, CFG)
    # group 0: q heads 0,1 then k head 0 then v head 0
    assert torch.equal(qkv[: 2 * hd], q[: 2 * hd])
    assert torch.equal(qkv[2 * hd: 3 * hd], k[:hd])
    assert torch.equal(qkv[3 * hd: 4 * hd], v[:hd])
    assert torch.equal(qkv[4 * hd: 6 * hd], q[2 * hd:])
    assert all(torch.equal(a, b) for a, b in zip(mapping.split_qkv(qkv, CFG), (q, k, v)))
    # a TP=2 slice of the fused tensor is exactly one query group
    assert torch.equal(mapping.shard_for_rank(qkv, mapping.shard_spec(
        "decoder.layers.0.self_attention.linear_qkv.weight"), 1, 2), qkv[4 * hd:])


def test_gate_up_slices_and_unshard_round_trip():
    name = mapping.expert_name(0, 3, "linear_fc1")
    spec = mapping.shard_spec(name)
    assert spec.glu and spec.expert and spec.dim == 0
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    full = mapping.hf_to_megatron(name, [gate, up], CFG, padded_vocab=0)
    parts = [mapping.shard_for_rank(full, spec, r, 2) for r in range(2)]
    assert torch.equal(parts[1], torch.cat([gate[3:], up[3:]]))
    assert torch.equal(mapping.unshard(parts, spec), full)
    pairs = mapping.megatron_to_hf(name, full, CFG)
    assert [n for n, _ in pairs] == ["model.layers.0.mlp.experts.3.gate_proj.weight",
                                     "model.layers.0.mlp.experts.3.up_proj.weight"]
    row = mapping.shard_spec("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight")
    assert row.dim == 1 and row.expert and not row.glu


def test_vocab_padding_and_tied_embeddings():
    emb = torch.randn(10, 8)
    full = mapping.hf_to_megatron("embedding.word_embeddings.weight", [emb], CFG, padded_vocab=16)
    assert full.shape == (16, 8) and torch.equal(full[10:], torch.zeros(6, 8))
    (name, back), = mapping.megatron_to_hf("embedding.word_embeddings.weight", full, CFG)
    assert name == "model.embed_tokens.weight" and torch.equal(back, emb)
    with pytest.raises(mapping.MappingError, match="exceeds the padded size"):
        mapping.pad_vocab(emb, 8)
    tied = ModelConfig(tie_word_embeddings=True)
    assert mapping.hf_names("output_layer.weight", tied) == ["model.embed_tokens.weight"]
    assert mapping.megatron_to_hf("output_layer.weight", full, tied) == []
    assert "output_layer.weight" not in mapping.canonical_names(tied)


def test_canonical_names_cover_every_hf_tensor_once():
    hf = [n for name in mapping.canonical_names(CFG) for n in mapping.hf_names(name, CFG)]
    assert len(hf) == len(set(hf)) and set(hf) == set(mapping.expected_hf_shapes(CFG))
