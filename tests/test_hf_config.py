"""HF config.json <-> ModelConfig: sizes read exactly, transformers' defaults, clear refusals."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.config.schema import ModelConfig
from gspo_megatron.config.validate import ConfigError
from gspo_megatron.model.hf_config import (hf_config_from_model_config, model_config_from_hf,
                                           read_hf_config)
from tests.test_provider import HF_DENSE, HF_MOE


def test_moe_config_round_trips_and_keeps_runtime_choices():
    base = ModelConfig(transformer_impl="local", moe_aux_loss_coeff=1e-3, params_dtype="bf16")
    m = model_config_from_hf(HF_MOE, base=base)
    assert (m.arch, m.num_layers, m.hidden_size, m.num_query_groups, m.head_dim) == \
        ("qwen3_moe", 2, 32, 2, 16)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_norm_topk_prob) == \
        (4, 2, 24, True)
    assert m.transformer_impl == "local" and m.moe_aux_loss_coeff == 1e-3
    back = model_config_from_hf(hf_config_from_model_config(m), base=base)
    assert back == m


def test_defaults_follow_transformers(tmp_path):
    hf = {k: v for k, v in HF_DENSE.items() if k != "head_dim"}
    assert model_config_from_hf(hf).head_dim == 128  # Qwen3Config's default
    moe = {k: v for k, v in HF_MOE.items() if k not in ("head_dim", "norm_topk_prob")}
    m = model_config_from_hf(moe)
    assert m.head_dim == 32 // 4 and m.moe_norm_topk_prob is False
    (tmp_path / "config.json").write_text(json.dumps(HF_MOE))
    assert read_hf_config(tmp_path)["num_experts"] == 4


def test_unsupported_configs_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model_type 'llama' is not supported"):
        model_config_from_hf({**HF_DENSE, "model_type": "llama"})
    with pytest.raises(ConfigError, match="x.json: 'mlp_only_layers'"):
        model_config_from_hf({**HF_MOE, "mlp_only_layers": [0]}, source="x.json")
    with pytest.raises(ConfigError, match="missing key 'vocab_size'"):
        model_config_from_hf({k: v for k, v in HF_DENSE.items() if k != "vocab_size"})
    with pytest.raises(ConfigError, match="config.json not found"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_hf_config(tmp_path)
