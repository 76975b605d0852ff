"""A tiny Qwen3-MoE policy with a letters-and-digits tokenizer, for rollout tests and benchmarks.

The same model and tokenizer builders as the tiny CPU run (``tiny_task/``), with a wider
alphabet (free-text prompts such as ``"what is 1+1?"``) and longer positions. The model is a
real ``Qwen3MoeForCausalLM`` (random weights), so the embedded engine, the reference server and
the weight-sync transports run on the same code path as a real checkpoint, in well under a second
per batch on one CPU core.

    model, tok = build_tiny_policy(seed=0)
    save_tiny_policy("/tmp/tiny", seed=0)   # an HF directory the reference server can load
"""

from __future__ import annotations

import string
from typing import Tuple

CHARS = string.ascii_lowercase + string.digits + " +=?."
"""Alphabet of the test tokenizer (one token per character, after the special tokens)."""


def build_tiny_policy(seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                      num_experts: int = 4, moe_ffn_hidden_size: int = 64) -> Tuple[object, object]:
    """``(Qwen3MoeForCausalLM, tokenizer)`` with random weights drawn from ``seed`` (fp32)."""
    from gspo_megatron.tiny_task.model import TinyModelSpec, create_tiny_model
    from gspo_megatron.tiny_task.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(alphabet=CHARS, model_max_length=512)
    spec = TinyModelSpec(num_layers=num_layers, hidden_size=hidden_size,
                         head_dim=hidden_size // 4, num_experts=num_experts,
                         moe_intermediate_size=moe_ffn_hidden_size, max_position_embeddings=512)
    return create_tiny_model(tok, seed=seed, spec=spec), tok


def save_tiny_policy(path: str, seed: int = 0, **sizes) -> str:
    """Write a tiny policy (config, safetensors, tokenizer) to ``path``; returns ``path``."""
    from gspo_megatron.tiny_task.model import save_tiny_model

    model, tok = build_tiny_policy(seed=seed, **sizes)
    save_tiny_model(model, tok, path)
    return path
