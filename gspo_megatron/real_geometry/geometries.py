"""The hub's config.json and generation_config.json of Qwen3-30B-A3B and Qwen3-235B-A22B.

Copied key for key from the Hugging Face hub (``Qwen/Qwen3-30B-A3B``, ``Qwen/Qwen3-235B-A22B``)
so that a checkpoint written from them has every width of the real model: only
``num_hidden_layers`` changes (1 or 2 layers fit a CPU machine; every layer of a Qwen3-MoE is the
same, so one layer already holds every tensor shape of the real model). ``max_window_layers``
keeps the hub's value: with ``use_sliding_window`` false transformers never reads it.

The 235B geometry is for the checkpoint tools (convert, export, reshard): at 1 layer it is
3.7e9 parameters, 7.5 GB in bf16, too big for a CPU learner but the real shapes to stream.
"""

from __future__ import annotations

import copy
from typing import Any, Dict

QWEN3_30B_A3B: Dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_235B_A22B: Dict[str, Any] = {
    **QWEN3_30B_A3B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 94,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 64,
    "num_hidden_layers": 94,
}

GENERATION_CONFIG: Dict[str, Any] = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}
"""Both models ship the same generation config (the thinking mode's sampling settings)."""

GEOMETRIES: Dict[str, Dict[str, Any]] = {"30b": QWEN3_30B_A3B, "235b": QWEN3_235B_A22B}


def geometry_config(name: str, num_layers: int) -> Dict[str, Any]:
    """The hub config.json of geometry ``name`` (``30b`` or ``235b``) with ``num_layers`` layers."""
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry '{name}' (known: {', '.join(GEOMETRIES)})")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    config = copy.deepcopy(GEOMETRIES[name])
    config["num_hidden_layers"] = num_layers
    return config
