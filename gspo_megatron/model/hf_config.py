"""Read a Hugging Face Qwen3 / Qwen3-MoE ``config.json`` into our :class:`ModelConfig`.

Only what the Megatron model needs is read, and anything the Megatron Qwen3 layout cannot express
(attention biases, sliding windows, dense layers inside an MoE model, rope scaling) is refused
with the file and key named, rather than silently built into a different model.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Dict

from gspo_megatron.config.schema import ModelConfig
from gspo_megatron.config.validate import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


def as_model_config(model) -> ModelConfig:
    """Accept a ModelConfig dataclass, an OmegaConf node of one, or None (defaults)."""
    if model is None:
        return ModelConfig()
    if isinstance(model, ModelConfig):
        return model
    from omegaconf import OmegaConf

    return OmegaConf.to_object(model)


def read_hf_config(path: str | Path) -> Dict[str, Any]:
    """config.json as a dict; ``path`` is the file or the checkpoint directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: Hugging Face config.json not found") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None


def _default_head_dim(model_type: str, hidden: int, heads: int) -> int:
    """What transformers uses when config.json has no head_dim: 128 for Qwen3, else hidden/heads."""
    return 128 if model_type == "qwen3" else hidden // heads


def model_config_from_hf(hf: Dict[str, Any], base: ModelConfig | None = None,
                         source: str = "config.json") -> ModelConfig:
    """Sizes and architecture from an HF config; runtime choices (impl, dtype, FP8) from ``base``."""
    base = as_model_config(base)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{source}: model_type '{model_type}' is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")

    def need(key: str):
        if key not in hf:
            raise ConfigError(f"{source}: missing key '{key}' for model_type {model_type}")
        return hf[key]

    if hf.get("attention_bias"):
        raise ConfigError(f"{source}: 'attention_bias': true is not supported (Qwen3 has none)")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{source}: 'use_sliding_window': true is not supported")
    if hf.get("rope_scaling"):
        raise ConfigError(f"{source}: 'rope_scaling' is not supported yet")
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    values = dict(
        arch=model_type,
        num_layers=need("num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=need("intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or _default_head_dim(model_type, hidden, heads),
        vocab_size=need("vocab_size"),
        max_position_embeddings=need("max_position_embeddings"),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_layernorm=True,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        num_experts=0,
    )
    if model_type == "qwen3_moe":
        if hf.get("mlp_only_layers"):
            raise ConfigError(f"{source}: 'mlp_only_layers' (dense layers in an MoE model) "
                              "is not supported")
        if hf.get("decoder_sparse_step", 1) != 1:
            raise ConfigError(f"{source}: 'decoder_sparse_step' must be 1 (every layer MoE)")
        values.update(
            num_experts=need("num_experts"),
            moe_router_topk=need("num_experts_per_tok"),
            moe_ffn_hidden_size=need("moe_intermediate_size"),
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),  # transformers' default
        )
    known = {f.name for f in fields(ModelConfig)}
    assert set(values) <= known
    return replace(base, **values)


def hf_config_from_model_config(model: ModelConfig) -> Dict[str, Any]:
    """The inverse, for export: a config.json transformers builds the same model from."""
    hf: Dict[str, Any] = dict(
        model_type=model.arch,
        architectures=["Qwen3MoeForCausalLM" if model.arch == "qwen3_moe" else "Qwen3ForCausalLM"],
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        head_dim=model.head_dim,
        max_position_embeddings=model.max_position_embeddings,
        rope_theta=model.rope_theta,
        rms_norm_eps=model.rms_norm_eps,
        tie_word_embeddings=model.tie_word_embeddings,
        attention_bias=False,
        hidden_act="silu",
        torch_dtype="bfloat16" if model.params_dtype == "bf16" else "float32",
    )
    if model.arch == "qwen3_moe":
        hf.update(num_experts=model.num_experts, num_experts_per_tok=model.moe_router_topk,
                  moe_intermediate_size=model.moe_ffn_hidden_size,
                  norm_topk_prob=model.moe_norm_topk_prob, decoder_sparse_step=1,
                  mlp_only_layers=[], router_aux_loss_coef=model.moe_aux_loss_coeff)
    return hf
