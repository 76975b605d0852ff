"""The hub geometries: the project's production configs describe the same models, the parameter
counts are the published ones (30.5B and 235.1B at full depth; 3.7e9 and 7.5 GB for 235B at one
layer), transformers builds the same tensors, and only num_hidden_layers changes."""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from gspo_megatron.checkpoint.mapping import expected_hf_shapes
from gspo_megatron.model.hf_config import model_config_from_hf
from gspo_megatron.real_geometry.geometries import (GEOMETRIES, QWEN3_30B_A3B, geometry_config)

GEOMETRY_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                   "num_query_groups", "head_dim", "vocab_size", "max_position_embeddings",
                   "rope_theta", "rms_norm_eps", "tie_word_embeddings", "num_experts",
                   "moe_router_topk", "moe_ffn_hidden_size", "moe_norm_topk_prob")


def _num_params(config):
    return sum(torch.Size(s).numel() for s in expected_hf_shapes(model_config_from_hf(config)).values())


@pytest.mark.parametrize("name,yaml_file", [("30b", "configs/qwen3_30b_a3b_gspo.yaml"),
                                            ("235b", "configs/qwen3_235b_a22b_gspo.yaml")])
def test_production_config_describes_the_same_model(name, yaml_file):
    ours = yaml.safe_load(open(yaml_file))["model"]
    hub = model_config_from_hf(GEOMETRIES[name])
    assert {f: getattr(hub, f) for f in GEOMETRY_FIELDS} == {f: ours[f] for f in GEOMETRY_FIELDS}


def test_parameter_counts_are_the_published_ones():
    assert round(_num_params(GEOMETRIES["30b"]) / 1e9, 1) == 30.5
    assert round(_num_params(GEOMETRIES["235b"]) / 1e9, 1) == 235.1
    one_layer = _num_params(geometry_config("235b", 1))
    assert round(one_layer / 1e9, 1) == 3.7 and round(2 * one_layer / 1e9, 1) == 7.5


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_transformers_builds_the_same_tensors_at_the_real_widths(name):
    config = geometry_config(name, 1)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))
    assert ({k: tuple(v.shape) for k, v in model.state_dict().items()}
            == expected_hf_shapes(model_config_from_hf(config)))


def test_only_the_layer_count_changes():
    config = geometry_config("30b", 2)
    assert config == {**QWEN3_30B_A3B, "num_hidden_layers": 2}
    assert QWEN3_30B_A3B["num_hidden_layers"] == 48  # the original is not modified
    with pytest.raises(ValueError, match="unknown geometry '7b'"):
        geometry_config("7b", 1)
