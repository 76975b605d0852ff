"""Measured matmul peak of the device, and the model FLOPs of a batch, for model TFLOP/s and MFU.

Model FLOPs count the work the model needs, not what the kernels did (no recomputation, no
padding): 2 FLOPs per multiply-add of every matmul a token passes through -- attention
projections, the router, its top-k experts (SwiGLU: three matrices), the output layer -- plus
causal attention (``Q K^T`` and ``A V`` over the ``t + 1`` positions a token at position ``t``
sees). A training step costs 3x the forward pass (the backward computes gradients for inputs and
weights). The peak is a square matmul in the run's dtype, timed in the same process right before
the model, so the ratio (MFU) is free of the machine's day-to-day variation.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from gspo_megatron.config.schema import ModelConfig

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, n: int, iters: int,
                       warmup: int = 3) -> float:
    """TFLOP/s of ``n x n @ n x n`` matmuls (mean over ``iters`` after ``warmup``)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(warmup):
        torch.matmul(a, b)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    synchronize(device)
    return 2.0 * n ** 3 * iters / (time.perf_counter() - start) / 1e12


def matmul_flops_per_token(m: ModelConfig) -> float:
    """Forward FLOPs of one token's matmuls (attention excluded), summed over all layers."""
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    attn_proj = h * (q + 2 * kv) + q * h
    if m.num_experts > 0:
        mlp = h * m.num_experts + m.moe_router_topk * 3 * h * m.moe_ffn_hidden_size
    else:
        mlp = 3 * h * m.ffn_hidden_size
    return 2.0 * (m.num_layers * (attn_proj + mlp) + h * m.vocab_size)


def attention_flops(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of causal attention scores and weighted sums for one sequence."""
    pairs = seq_len * (seq_len + 1) / 2
    return m.num_layers * 2 * (2.0 * m.num_attention_heads * m.head_dim * pairs)


def forward_flops(m: ModelConfig, seq_lens: Sequence[int]) -> float:
    """Model FLOPs of one forward pass over sequences of these lengths."""
    return sum(matmul_flops_per_token(m) * s + attention_flops(m, s) for s in seq_lens)


def train_step_flops(m: ModelConfig, seq_lens: Sequence[int]) -> float:
    """Forward + backward: 3x the forward pass."""
    return 3.0 * forward_flops(m, seq_lens)
