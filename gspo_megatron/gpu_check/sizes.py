"""The two size sets of the kit: a Qwen3-30B-A3B slice for one H200, and tiny CPU sizes for CI.

The GPU slice keeps every layer shape of Qwen3-30B-A3B (its ``config.json``: hidden 2048, 128
experts top-8 with FFN 768, GQA 32/4 heads of dim 128, vocabulary 151,936, RoPE theta 1e6) and
only cuts the depth to 2-4 layers. With 2 layers it has 1.87e9 parameters (3.7 GB in bf16); the
learner with Adam and fp32 main weights needs ~18 bytes per parameter (~34 GB), the HF reference
models and the engine copy ~16 GB more: well inside one H200. The batches are sized so that the
whole kit, including pip installs on a bare machine, stays under 8 minutes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict

QWEN3_30B_A3B_HF_CONFIG: Dict[str, Any] = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
    router_aux_loss_coef=0.001, output_router_logits=False, initializer_range=0.02,
    bos_token_id=151643, eos_token_id=151645)
"""Hugging Face config.json of Qwen3-30B-A3B (48 layers; the kit keeps 2-4 of them)."""

TINY_HF_CONFIG: Dict[str, Any] = dict(
    QWEN3_30B_A3B_HF_CONFIG, vocab_size=160, hidden_size=64, intermediate_size=128,
    moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2)
"""The same architecture at CPU-test sizes (every part still there: GQA, QK-norm, top-k MoE)."""


@dataclass(frozen=True)
class KitSizes:
    """Everything that differs between a GPU run and the CPU dry run."""

    hf_config: Dict[str, Any] = field(default_factory=dict)
    """config.json of the model the kit builds (random weights, fixed seed)."""
    params_dtype: str = "bf16"
    """Learner and HF model dtype: ``bf16`` on GPU, ``fp32`` on CPU (the project's defaults)."""
    train_num_seqs: int = 16
    train_seq_len: int = 1024
    train_prompt_len: int = 256
    max_tokens_per_micro_batch: int = 4096
    num_warmup_steps: int = 1
    num_timed_steps: int = 3
    compare_num_seqs: int = 8
    """Sequences whose log-probs the learner and Hugging Face compute (check 2)."""
    compare_seq_len: int = 512
    compare_prompt_len: int = 128
    kernel_num_tokens: int = 16384
    """Tokens of the log-prob kernel memory check (check 3), always at vocabulary 151,936."""
    kernel_vocab: int = 151936
    kernel_dtype: str = "bf16"
    matmul_n: int = 8192
    """Square bf16 matmul that measures the device's peak (n^3 * 2 FLOPs each)."""
    matmul_iters: int = 10
    bucket_bytes: int = 512 * 1024 * 1024
    """Weight-sync bucket size (the config default)."""
    lr: float = 1e-4
    """Large enough that one Adam step moves bf16 weights (1e-6 would round away)."""


def gpu_sizes(num_layers: int = 2) -> KitSizes:
    """Qwen3-30B-A3B layer shapes, ``num_layers`` (2-4) layers, on one H200."""
    if not 1 <= num_layers <= 4:
        raise ValueError(f"--num-layers must be in 1..4 (one H200, 8 minutes); got {num_layers}")
    return KitSizes(hf_config=dict(QWEN3_30B_A3B_HF_CONFIG, num_hidden_layers=num_layers,
                                   torch_dtype="bfloat16"))


def cpu_sizes() -> KitSizes:
    """Tiny sizes: the whole dry run takes well under a minute on two CPU cores."""
    return replace(KitSizes(), hf_config=dict(TINY_HF_CONFIG, torch_dtype="float32"),
                   params_dtype="fp32", train_num_seqs=6, train_seq_len=24, train_prompt_len=8,
                   max_tokens_per_micro_batch=96, num_timed_steps=1, compare_num_seqs=4,
                   compare_seq_len=20, compare_prompt_len=6, kernel_num_tokens=256,
                   kernel_dtype="fp32", matmul_n=256, matmul_iters=3, bucket_bytes=64 * 1024,
                   lr=1e-3)
