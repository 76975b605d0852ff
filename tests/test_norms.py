"""SequenceParallelRMSNorm: Hugging Face Qwen3RMSNorm numerics and the SP gradient marker."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gspo_megatron.model.norms import SequenceParallelRMSNorm


def test_matches_transformers_qwen3_rmsnorm_and_marks_sp_weights():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    x = torch.randn(5, 3, 16) * 3
    cfg = SimpleNamespace(params_dtype=torch.float32, sequence_parallel=True)
    ours = SequenceParallelRMSNorm(cfg, 16, eps=1e-5)
    ref = Qwen3RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        w = torch.rand(16) + 0.5
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    assert ours.weight.sequence_parallel is True
    plain = SequenceParallelRMSNorm(SimpleNamespace(params_dtype=torch.float32,
                                                    sequence_parallel=False), 16)
    assert plain.weight.sequence_parallel is False


def test_bf16_input_is_normalised_in_fp32():
    cfg = SimpleNamespace(params_dtype=torch.bfloat16, sequence_parallel=False)
    norm = SequenceParallelRMSNorm(cfg, 8)
    x = (torch.randn(4, 8) * 1e3).to(torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    rms = y.float().pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones(4), atol=2e-2)
