"""The random checkpoint writer, on a tiny geometry with the 30B's keys: transformers'
Qwen3MoeForCausalLM names and shapes, a correct sharded index, weights at the init scale,
byte-identical files for one seed, at most one shard in memory, and nothing left behind when a
write fails or the tokenizer does not fit the vocabulary."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from benchmarks.live_tensor_bytes import LiveTensorBytes
from gspo_megatron.checkpoint import hf_io
from gspo_megatron.checkpoint.hf_io import HFCheckpointError
from gspo_megatron.real_geometry import checkpoint_writer
from gspo_megatron.real_geometry.geometries import GENERATION_CONFIG
from tests.qwen3_assets import REAL_VOCAB, TINY, qwen3_tokenizer_dir, write_tiny  # noqa: F401


def _tensors_on_disk(model_dir):
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shapes = {}
    for name, shard in index["weight_map"].items():
        with safe_open(str(model_dir / shard), framework="pt") as f:
            shapes[name] = tuple(f.get_slice(name).get_shape())
    return index, shapes


def test_names_and_shapes_are_transformers_qwen3_moe(tmp_path):
    out = write_tiny(tmp_path / "m")
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    _, on_disk = _tensors_on_disk(out)
    assert on_disk == expected
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in on_disk  # one tensor per projection


def test_index_lists_every_tensor_in_hub_named_shards(tmp_path):
    out = write_tiny(tmp_path / "m", max_shard_bytes=40_000)
    index, shapes = _tensors_on_disk(out)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(2 * torch.Size(s).numel() for s in shapes.values())
    assert index["weight_map"]["model.embed_tokens.weight"] == shards[0]
    assert index["weight_map"]["lm_head.weight"] == shards[-1]
    assert json.loads((out / "config.json").read_text()) == TINY
    assert json.loads((out / "generation_config.json").read_text()) == GENERATION_CONFIG
    assert not list(tmp_path.glob("*.partial"))


def test_transformers_loads_it_in_bf16_at_the_init_scale(tmp_path):
    out = write_tiny(tmp_path / "m", vocab_size=4096)
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16)
    layer = model.model.layers[0]
    assert model.dtype == torch.bfloat16
    assert torch.equal(layer.self_attn.q_norm.weight, torch.ones(16, dtype=torch.bfloat16))
    embed = model.model.embed_tokens.weight.float()
    assert abs(embed.std().item() - TINY["initializer_range"]) < 1e-3
    assert abs(embed.mean().item()) < 1e-3
    assert not torch.equal(layer.mlp.experts[0].up_proj.weight, layer.mlp.experts[1].up_proj.weight)


def test_same_seed_same_bytes_and_layers_shared_across_depths(tmp_path):
    a, b = write_tiny(tmp_path / "a", seed=3), write_tiny(tmp_path / "b", seed=3)
    c = write_tiny(tmp_path / "c", seed=4)
    one_layer = write_tiny(tmp_path / "one", seed=3, num_hidden_layers=1)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    shard = files[2]  # the first shard: the embedding
    assert shard.startswith("model-00001") and (a / shard).read_bytes() != (c / shard).read_bytes()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(hf_io.HFCheckpointReader(a).get(name),
                       hf_io.HFCheckpointReader(one_layer).get(name))


def test_at_most_one_shard_and_one_tensor_are_alive(tmp_path):
    budget = 40_000
    largest = 2 * TINY["vocab_size"] * TINY["hidden_size"]  # the embedding, 131 kB
    with LiveTensorBytes() as probe:
        out = write_tiny(tmp_path / "m", max_shard_bytes=budget)
    total = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert probe.peak_bytes <= budget + largest
    assert probe.peak_bytes < total / 2


def test_tokenizer_larger_than_vocab_is_refused_before_writing(tmp_path, qwen3_tokenizer_dir):  # noqa: F811
    with pytest.raises(HFCheckpointError,
                       match=r"tokenizer.json: the tokenizer has 151669 tokens but the geometry's "
                             r"config.json: 'vocab_size' is 1024"):
        write_tiny(tmp_path / "m", tokenizer_dir=qwen3_tokenizer_dir)
    assert list(tmp_path.iterdir()) == []


def _load_logging(path):
    """AutoTokenizer of ``path`` and what transformers logged while loading it."""
    import io
    import logging

    from transformers import AutoTokenizer

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("transformers").addHandler(handler)
    try:
        return AutoTokenizer.from_pretrained(path), stream.getvalue()
    finally:
        logging.getLogger("transformers").removeHandler(handler)


def test_real_tokenizer_is_copied_and_loads_without_the_mistral_warning(
        tmp_path, qwen3_tokenizer_dir):  # noqa: F811
    out = write_tiny(tmp_path / "m", tokenizer_dir=qwen3_tokenizer_dir, vocab_size=REAL_VOCAB)
    assert (out / "tokenizer.json").read_bytes() == (qwen3_tokenizer_dir / "tokenizer.json").read_bytes()
    tok, logged = _load_logging(out)
    assert len(tok) == 151669 and "incorrect regex" not in logged
    assert tok.tokenize(" HelloWorld") == ["ĠHelloWorld"]  # Qwen2's own regex: one token
    # The warning is keyed on config.json's transformers_version alone: a newer one triggers it.
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "transformers_version": "4.57.6"}))
    _, logged = _load_logging(out)
    assert "incorrect regex" in logged


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def broken(cfg, init_std, seed):
        yield "model.embed_tokens.weight", torch.zeros(TINY["vocab_size"], TINY["hidden_size"],
                                                       dtype=torch.bfloat16)
        raise OSError("disk went away")

    monkeypatch.setattr(checkpoint_writer, "random_tensors", broken)
    with pytest.raises(OSError, match="disk went away"):
        write_tiny(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_kept_unless_overwritten(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        write_tiny(tmp_path / "m")
    assert (tmp_path / "m" / "keep").is_file()
