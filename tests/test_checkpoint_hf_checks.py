"""A checkpoint whose config.json disagrees with its tensors is refused naming config.json and the
key (head_dim, vocab_size, num_experts, ...) with the tensor that shows it; a missing shard names
the index and the shard; a tokenizer larger than vocab_size names both files. Tiny geometry."""

from __future__ import annotations

import json
import re

import pytest

from gspo_megatron.checkpoint.convert import model_config_for_hf_dir
from gspo_megatron.checkpoint.hf_checks import check_tokenizer_fits, open_validated
from gspo_megatron.checkpoint.hf_io import HFCheckpointError
from tests.qwen3_assets import write_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("hf") / "m")


def _copy_with(src, dst, **config):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def _open(d):
    return open_validated(d, model_config_for_hf_dir(d))


def test_a_matching_checkpoint_passes(tiny_dir):
    reader, unused = _open(tiny_dir)
    assert unused == [] and len(reader.weight_map) == 3 + 2 * (9 + 4 * 3)


@pytest.mark.parametrize("key,value,found,tensor", [
    ("head_dim", 32, 16, "model.layers.0.self_attn.q_norm.weight"),
    ("vocab_size", 2048, 1024, "model.embed_tokens.weight"),
    ("hidden_size", 96, 64, "model.embed_tokens.weight"),
    ("num_attention_heads", 8, 4, "model.layers.0.self_attn.q_proj.weight"),
    ("num_key_value_heads", 1, 2, "model.layers.0.self_attn.k_proj.weight"),
    ("num_experts", 8, 4, "model.layers.0.mlp.gate.weight"),
    ("moe_intermediate_size", 48, 32, "model.layers.0.mlp.experts.0.gate_proj.weight"),
])
def test_config_key_that_disagrees_is_named(tiny_dir, tmp_path, key, value, found, tensor):
    d = _copy_with(tiny_dir, tmp_path / "m", **{key: value})
    with pytest.raises(HFCheckpointError) as err:
        _open(d)
    message = str(err.value)
    assert message.startswith(f"{d / 'config.json'}: '{key}' is {value} but the checkpoint's "
                              f"tensors hold {found} ({d}/model-000")
    assert f"'{tensor}' has shape [" in message


def test_fewer_expert_tensors_than_num_experts_is_named(tiny_dir, tmp_path):
    d = _copy_with(tiny_dir, tmp_path / "m")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if not re.search(r"\.experts\.[23]\.", k)}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError,
                       match=r"config.json: 'num_experts' is 4 but the checkpoint's tensors hold 2 "
                             r"\(.* has layer 0's experts 0..1\)"):
        _open(d)


def test_fewer_layers_than_num_hidden_layers_is_named(tiny_dir, tmp_path):
    d = _copy_with(tiny_dir, tmp_path / "m", num_hidden_layers=3)
    with pytest.raises(HFCheckpointError,
                       match="config.json: 'num_hidden_layers' is 3 but the checkpoint's tensors hold 2"):
        _open(d)


def test_missing_shard_names_the_index_and_the_shard(tiny_dir, tmp_path):
    d = _copy_with(tiny_dir, tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(HFCheckpointError,
                       match=re.escape(f"{shard}: shard listed in model.safetensors.index.json "
                                       "is missing (it holds 'model.")):
        _open(d)


def test_tokenizer_larger_than_vocab_names_both_files(tmp_path):
    check_tokenizer_fits(1024, 1024, "tok.json", "config.json")
    with pytest.raises(HFCheckpointError,
                       match=r"^tok.json: the tokenizer has 1030 tokens but config.json: "
                             r"'vocab_size' is 1024; ids 1024..1029 have no embedding row$"):
        check_tokenizer_fits(1030, 1024, "tok.json", "config.json")
