"""RMSNorm for the local (non-Transformer-Engine) layer spec that also works with sequence parallelism.

Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel=True``, which makes TP + MoE (where
Megatron requires SP) impossible without Transformer Engine. Under SP each tensor-parallel rank
normalises its own slice of the sequence, so the norm itself needs no communication; only the
weight's gradient is partial on every rank. Marking the weight ``sequence_parallel`` tells
Megatron's ``finalize_model_grads`` to all-reduce it over the TP group, exactly as it does for
Transformer Engine norms. Numerics match Hugging Face's Qwen3RMSNorm (computed in fp32).
"""

from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.Module):
    """``y = weight * x / sqrt(mean(x^2) + eps)`` with the Megatron norm constructor signature."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> same shape and dtype."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
