"""GroupedMatmulSequentialMLP against Megatron-Core's own SequentialMLP, on the same parameters."""

from __future__ import annotations

import torch

from tests.multiproc import run_on_ranks


def _experts(config_overrides: dict, ffn: int = 16):
    """Megatron's SequentialMLP and ours with the same weights (one-rank Megatron state)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP

    from gspo_megatron.config.schema import ModelConfig, ParallelConfig
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.model.grouped_experts import GroupedMatmulSequentialMLP
    from gspo_megatron.model.provider import build_transformer_config

    init_distributed(ParallelConfig(), seed=3)
    model = ModelConfig(num_experts=4, moe_ffn_hidden_size=ffn, hidden_size=32,
                        num_attention_heads=4, num_query_groups=2, head_dim=8,
                        params_dtype="fp32", transformer_impl="local")
    config = build_transformer_config(model, ParallelConfig(), on_gpu=False)
    for key, value in config_overrides.items():  # TransformerConfig fields the schema fixes
        setattr(config, key, value)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm",
    ).submodules.mlp.submodules.experts.submodules
    pg = ProcessGroupCollection.use_mpu_process_groups()
    theirs = SequentialMLP(4, config, spec, pg_collection=pg)
    ours = GroupedMatmulSequentialMLP(4, config, spec, pg_collection=pg)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _fwd_bwd(module, x, counts, probs, grad_out):
    for p in module.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    out, bias = module(x, counts, probs)
    out.backward(grad_out)
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return out.detach(), bias, x.grad, probs.grad, grads


def _compare_on_one_rank(rank, config_overrides, counts, ffn=16):
    theirs, ours = _experts(config_overrides, ffn)
    g = torch.Generator().manual_seed(11)
    counts = torch.tensor(counts)
    tokens = int(counts.sum())
    x, probs = torch.randn(tokens, 32, generator=g), torch.rand(tokens, generator=g)
    grad_out = torch.randn(tokens, 32, generator=g)
    calls = []
    real = torch._grouped_mm

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    torch._grouped_mm = counting
    try:
        mine = _fwd_bwd(ours, x, counts, probs, grad_out)
    finally:
        torch._grouped_mm = real
    ref = _fwd_bwd(theirs, x, counts, probs, grad_out)
    return {"calls": len(calls), "ours": mine, "theirs": ref,
            "names": sorted(n for n, _ in ours.named_parameters())}


def _assert_bitwise_equal(res):
    out, bias, dx, dprobs, grads = res["ours"]
    r_out, r_bias, r_dx, r_dprobs, r_grads = res["theirs"]
    assert bias is None and r_bias is None
    assert torch.equal(out, r_out) and torch.equal(dx, r_dx) and torch.equal(dprobs, r_dprobs)
    assert grads.keys() == r_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], r_grads[name]), name


def test_grouped_experts_equal_megatrons_loop_bit_for_bit_including_an_empty_expert():
    """Outputs and the gradients of the input, the routing probabilities and every expert weight
    are exactly SequentialMLP's (one thread, as ``run_on_ranks`` sets); the parameters keep
    SequentialMLP's names (checkpoints, the HF mapping and weight sync are unchanged)."""
    res = run_on_ranks(_compare_on_one_rank, world_size=1, config_overrides={},
                       counts=[5, 0, 9, 3])[0]
    assert res["calls"] == 2  # fc1 and fc2, each one grouped GEMM over the four experts
    _assert_bitwise_equal(res)
    assert "local_experts.3.linear_fc2.weight" in res["names"] and len(res["names"]) == 8


def test_a_batch_with_no_tokens_at_all():
    res = run_on_ranks(_compare_on_one_rank, world_size=1, config_overrides={},
                       counts=[0, 0, 0, 0])[0]
    assert res["calls"] == 2 and res["ours"][0].shape == (0, 32)
    _assert_bitwise_equal(res)


def test_expert_widths_the_cpu_grouped_gemm_refuses_run_megatrons_loop():
    """torch's CPU ``_grouped_mm`` needs rows of a multiple of 16 bytes: an expert width of 6
    fp32 values would fail inside torch ("strides should be multiple of 16 bytes")."""
    res = run_on_ranks(_compare_on_one_rank, world_size=1, config_overrides={},
                       counts=[3, 1, 0, 2], ffn=6)[0]
    assert res["calls"] == 0
    _assert_bitwise_equal(res)


def test_configurations_outside_the_grouped_path_run_megatrons_loop():
    """Routing probabilities applied to the input (top-1) are not covered: the parent's
    per-expert loop runs, same results."""
    res = run_on_ranks(_compare_on_one_rank, world_size=1,
                       config_overrides={"moe_router_topk": 1, "moe_apply_probs_on_input": True},
                       counts=[2, 4, 1, 6])[0]
    assert res["calls"] == 0
    _assert_bitwise_equal(res)


def _local_spec_experts(rank):
    from gspo_megatron.config.schema import ModelConfig, ParallelConfig
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.model.provider import build_layer_spec, build_transformer_config

    init_distributed(ParallelConfig(), seed=3)
    model = ModelConfig(transformer_impl="local", params_dtype="fp32", num_layers=2)
    spec = build_layer_spec(model, build_transformer_config(model, ParallelConfig(),
                                                            on_gpu=False))
    experts = spec.layer_specs[0].submodules.mlp.submodules.experts.module
    return f"{experts.__module__}.{experts.__qualname__}"


def test_the_local_moe_spec_uses_the_grouped_experts():
    assert run_on_ranks(_local_spec_experts, world_size=1) == [
        "gspo_megatron.model.grouped_experts.GroupedMatmulSequentialMLP"]
