"""Create the tiny Hugging Face Qwen3-MoE of the CPU demo and save it as an HF directory.

The sizes (2 layers, hidden 64, 4 heads / 2 KV heads of dim 16, 4 experts top-2 with
intermediate 64, untied embeddings, 128 positions, rope theta 1e4) keep a forward+backward over
a whole rollout batch well under a second on one CPU core, while still exercising every part of
the real architecture (QK-norm, GQA, routed experts) that the Megatron mapping must get right.

:func:`build_tiny_policy` is the same model over a letters-and-digits tokenizer
(``vocab.TEXT_ALPHABET``) with longer positions and adjustable sizes: the policy the rollout and
weight-sync tests and benchmarks run through the embedded engine, the reference server and the
transports, on the same code path as a real checkpoint.

    model, tok = build_tiny_policy(seed=0)
    save_tiny_model(model, tok, "/tmp/tiny")   # an HF directory the reference server can load
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen3MoeConfig, Qwen3MoeForCausalLM

from gspo_megatron.tiny_task.tokenizer import build_char_tokenizer
from gspo_megatron.tiny_task.vocab import TEXT_ALPHABET


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture of the tiny model (Hugging Face Qwen3-MoE names in the comments)."""

    num_layers: int = 2  # num_hidden_layers
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


def tiny_qwen3_moe_config(tokenizer: PreTrainedTokenizerBase,
                          spec: TinyModelSpec = TinyModelSpec()) -> Qwen3MoeConfig:
    """The HF config; vocabulary and special-token ids come from ``tokenizer``."""
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.moe_intermediate_size * 2,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=0.0,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )


def create_tiny_model(tokenizer: PreTrainedTokenizerBase, seed: int = 0,
                      spec: TinyModelSpec = TinyModelSpec()) -> Qwen3MoeForCausalLM:
    """A randomly initialised tiny Qwen3-MoE (deterministic for a given ``seed``)."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config(tokenizer, spec))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=8)
    return model.eval()


def build_tiny_policy(seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                      num_experts: int = 4, moe_ffn_hidden_size: int = 64,
                      ) -> Tuple[Qwen3MoeForCausalLM, PreTrainedTokenizerBase]:
    """``(model, tokenizer)``: a free-text tiny policy, random weights drawn from ``seed`` (fp32)."""
    tok = build_char_tokenizer(alphabet=TEXT_ALPHABET, model_max_length=512)
    spec = TinyModelSpec(num_layers=num_layers, hidden_size=hidden_size,
                         head_dim=hidden_size // 4, num_experts=num_experts,
                         moe_intermediate_size=moe_ffn_hidden_size, max_position_embeddings=512)
    return create_tiny_model(tok, seed=seed, spec=spec), tok


def save_tiny_model(model: Qwen3MoeForCausalLM, tokenizer: PreTrainedTokenizerBase,
                    out_dir: Path) -> Path:
    """Save weights (safetensors), config, generation config and tokenizer to ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
