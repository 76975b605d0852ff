"""BatchedSequentialMLP equals Megatron's SequentialMLP: outputs, input and weight gradients."""

from __future__ import annotations

import pytest

from tests.multiproc import run_on_ranks


CASES = [([3, 0, 5, 2], "float32", 1e-5), ([1, 7, 4, 4], "bfloat16", 3e-2)]


def _compare_all(rank: int) -> list:
    from gspo_megatron.config.schema import ParallelConfig
    from gspo_megatron.distributed.runtime import init_distributed

    init_distributed(ParallelConfig(), seed=1)
    return [_compare(counts, dtype) for counts, dtype, _ in CASES]


def _compare(counts, dtype_name: str) -> dict:
    import torch
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP

    from gspo_megatron.config.schema import ModelConfig, ParallelConfig
    from gspo_megatron.model.batched_experts import BatchedSequentialMLP
    from gspo_megatron.model.provider import build_transformer_config

    dtype = getattr(torch, dtype_name)
    model = ModelConfig(num_experts=len(counts), moe_ffn_hidden_size=24, hidden_size=32,
                        num_attention_heads=4, num_query_groups=2, head_dim=8,
                        params_dtype="bf16" if dtype == torch.bfloat16 else "fp32",
                        transformer_impl="local")
    config = build_transformer_config(model, ParallelConfig())
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=len(counts), moe_grouped_gemm=False, qk_layernorm=True,
        normalization="RMSNorm").submodules.mlp.submodules.experts.submodules
    pg = ProcessGroupCollection.use_mpu_process_groups()
    ref = SequentialMLP(len(counts), config, spec, pg_collection=pg)
    ours = BatchedSequentialMLP(len(counts), config, spec, pg_collection=pg)
    torch.manual_seed(0)
    with torch.no_grad():  # O(1) outputs, so the tolerances below mean something
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    ours.load_state_dict(ref.state_dict())
    assert ours._batchable()

    tokens = sum(counts)
    x = torch.randn(tokens, 32, dtype=dtype)
    probs = torch.rand(tokens)
    grad = torch.randn(tokens, 32, dtype=dtype)
    results = []
    for module in (ref, ours):
        xi = x.clone().requires_grad_(True)
        out, bias = module(xi, torch.tensor(counts), probs)
        out.backward(grad)
        weight_grads = [p.grad.float().clone() for p in module.parameters()]
        results.append((out.detach().float(), xi.grad.float(), weight_grads, bias))
    (o1, g1, w1, b1), (o2, g2, w2, b2) = results
    return {"out": float((o1 - o2).abs().max()), "grad_in": float((g1 - g2).abs().max()),
            "grad_w": max(float((a - b).abs().max()) for a, b in zip(w1, w2)),
            "scale": float(o1.abs().max()), "bias": (b1, b2)}


@pytest.mark.slow
def test_batched_experts_equal_the_sequential_loop():
    """fp32 with an expert that gets no token, and bf16 (Megatron's per-token scaling order)."""
    results = run_on_ranks(_compare_all, world_size=1, timeout_s=300)[0]
    for (counts, dtype, tol), out in zip(CASES, results):
        assert out["scale"] > 0.1
        assert out["bias"] == (None, None)
        assert out["out"] < tol and out["grad_in"] < tol and out["grad_w"] < tol, (dtype, out)
