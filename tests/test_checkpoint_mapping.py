"""The HF <-> Megatron mapping without Megatron: canonical names for Transformer Engine and local
specs and all three expert layouts, GQA-grouped QKV fusion, gate/up TP slicing, vocab padding,
tied embeddings, each rank's slice read from only its part of the HF tensors (equal to cutting
the full tensor, for every parameter and TP size), and clear errors for unknown names."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.checkpoint import mapping
from gspo_megatron.config.schema import ModelConfig

CFG = ModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=8, num_attention_heads=4,
                  num_query_groups=2, head_dim=2, vocab_size=10, num_experts=4,
                  moe_ffn_hidden_size=6)


class DictReader:
    """HF tensors from a dict, read the way ``hf_io.HFCheckpointReader`` reads them."""

    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, name):
        return self.tensors[name].clone()

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def get_slice(self, name, index):
        return self.tensors[name][index].clone()


def _cut(full, spec, rank, size):
    """The reference split: the full canonical tensor cut into ``size`` parts along the spec."""
    if spec.dim is None or size == 1:
        return full
    if spec.glu:
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    return full.chunk(size, dim=spec.dim)[rank]


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
    # a TP=2 slice of the fused tensor is exactly one query group, read from its rows of q, k, v
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    reader = DictReader({"model.layers.0.self_attn.q_proj.weight": q,
                         "model.layers.0.self_attn.k_proj.weight": k,
                         "model.layers.0.self_attn.v_proj.weight": v})
    assert torch.equal(mapping.local_from_hf(name, reader, CFG, mapping.shard_spec(name), 1, 2, 0),
                       qkv[4 * hd:])


def test_gate_up_slices_and_unshard_round_trip():
    name = mapping.expert_name(0, 3, "linear_fc1")
    spec = mapping.shard_spec(name)
    assert spec.glu and spec.expert and spec.dim == 0
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    full = mapping.hf_to_megatron(name, [gate, up], CFG, padded_vocab=0)
    reader = DictReader({"model.layers.0.mlp.experts.3.gate_proj.weight": gate,
                         "model.layers.0.mlp.experts.3.up_proj.weight": up})
    parts = [mapping.local_from_hf(name, reader, CFG, spec, r, 2, 0) for r in range(2)]
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


@pytest.mark.parametrize("size", [1, 2, 4])
def test_each_ranks_slice_read_from_its_part_equals_the_cut_full_tensor(size):
    cfg = ModelConfig(arch="qwen3_moe", num_layers=1, hidden_size=8, num_attention_heads=8,
                      num_query_groups=4, head_dim=2, vocab_size=10, num_experts=2,
                      moe_ffn_hidden_size=12)
    generator = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=generator)
          for n, s in mapping.expected_hf_shapes(cfg).items()}
    reader, padded = DictReader(hf), 16  # 4 rows per rank at size 4: the last rank is all padding
    for name in mapping.canonical_names(cfg):
        spec = mapping.shard_spec(name)
        sources = [hf[n] for n in mapping.hf_names(name, cfg)]
        full = mapping.hf_to_megatron(name, sources, cfg, padded)
        parts = [mapping.local_from_hf(name, reader, cfg, spec, r, size, padded)
                 for r in range(size)]
        assert all(torch.equal(p, _cut(full, spec, r, size)) for r, p in enumerate(parts)), name
        assert torch.equal(mapping.unshard(parts, spec) if spec.dim is not None else parts[0], full)


def test_unshard_of_parts_back_to_back_in_one_buffer_is_a_view():
    buffer = torch.arange(24.0)
    parts = list(buffer.view(6, 4).chunk(3))
    full = mapping.unshard(parts, mapping.ShardSpec(dim=0))
    assert torch.equal(full, buffer.view(6, 4)) and full.data_ptr() == buffer.data_ptr()
    apart = [torch.ones(2, 4), torch.zeros(2, 4)]  # separate storages: concatenated
    assert torch.equal(mapping.unshard(apart, mapping.ShardSpec(dim=0)), torch.cat(apart))


def test_a_split_that_is_not_even_is_refused():
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    with pytest.raises(mapping.MappingError, match="2 does not split into 4 equal parts"):
        mapping.local_from_hf(name, DictReader({}), CFG, mapping.shard_spec(name), 0, 4, 0)
