"""A tiny Qwen3-MoE policy and a character-level tokenizer, for tests, benchmarks and CPU demos.

The model is a real ``Qwen3MoeForCausalLM`` (random weights), so the embedded engine, the
reference server and the weight-sync transports all run on the same code path as a real
checkpoint, in well under a second per batch on one CPU core.

    model, tok = build_tiny_policy(seed=0)
    save_tiny_policy("/tmp/tiny", seed=0)   # an HF directory the reference server can load
"""

from __future__ import annotations

import string
from typing import Tuple

import torch

CHARS = string.ascii_lowercase + string.digits + " +=?."
SPECIAL = ("<pad>", "<eos>")


def build_char_tokenizer():
    """A ``PreTrainedTokenizerFast`` over ``CHARS`` (one token per character) + pad/eos."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + tuple(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   model_input_names=["input_ids", "attention_mask"],
                                   padding_side="left")


def build_tiny_policy(seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                      num_experts: int = 4, moe_ffn_hidden_size: int = 64) -> Tuple[object, object]:
    """``(Qwen3MoeForCausalLM, tokenizer)`` with random weights drawn from ``seed`` (fp32)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = build_char_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=moe_ffn_hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        num_experts=num_experts, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=512, tie_word_embeddings=False, norm_topk_prob=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def save_tiny_policy(path: str, seed: int = 0, **sizes) -> str:
    """Write a tiny policy (config, safetensors, tokenizer) to ``path``; returns ``path``."""
    model, tok = build_tiny_policy(seed=seed, **sizes)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
