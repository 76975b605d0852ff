"""The local context-parallel attention on 2 gloo ranks equals Megatron's single-process local
attention: outputs and the gradients of queries, keys and values (GQA, batch of 2 rows); the
CP slice of RoPE equals the full table at this rank's positions; the provider puts the module in
the local spec when cp > 1 and passes ``cp_comm_type`` to Transformer Engine's config."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_on_ranks

SEQ, BATCH, HEADS, GROUPS, DIM = 8, 2, 4, 2, 8


def _config(cp: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, kv_channels=DIM, context_parallel_size=cp,
                             attention_dropout=0.0, hidden_dropout=0.0,
                             use_cpu_initialization=True, masked_softmax_fusion=False)


def _worker(rank: int) -> dict:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from gspo_megatron.config.schema import ParallelConfig
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.distributed.context_parallel import (load_balanced_causal_mask,
                                                            load_balanced_indices)
    from gspo_megatron.model.context_parallel_attention import (ContextParallelDotProductAttention,
                                                                LoadBalancedRotaryEmbedding)

    init_distributed(ParallelConfig(cp=2), seed=1)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen)
    k = torch.randn(SEQ, BATCH, GROUPS, DIM, generator=gen)
    v = torch.randn(SEQ, BATCH, GROUPS, DIM, generator=gen)
    upstream = torch.randn(SEQ, BATCH, HEADS * DIM, generator=gen)

    ref_attn = DotProductAttention(_config(1), 1, AttnMaskType.causal, "self")
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)
    ref_out = ref_attn(*full, causal)
    ref_out.backward(upstream)

    idx = load_balanced_indices(SEQ, 2, rank)
    out = {}
    given = load_balanced_causal_mask(SEQ, 2, rank)
    for name, mask in (("built_mask", None), ("given_mask", given)):
        attn = ContextParallelDotProductAttention(_config(2), 1, AttnMaskType.causal, "self")
        local = [t[idx].clone().requires_grad_() for t in (q, k, v)]
        got = attn(*local, mask)
        got.backward(upstream[idx])
        out[name] = {"out": float((got - ref_out.detach()[idx]).abs().max()),
                     **{f"d{n}": float((loc.grad - ref.grad[idx]).abs().max())
                        for n, loc, ref in zip("qkv", local, full)}}
    out["grad_scale"] = float(full[1].grad.abs().max())
    try:
        ContextParallelDotProductAttention(_config(2), 1, AttnMaskType.causal, "self",
                                           cp_comm_type="p2p")
        out["p2p_refused"] = False
    except ValueError as exc:
        out["p2p_refused"] = "only all-gathers" in str(exc)

    from gspo_megatron.model.provider import build_layer_spec, build_transformer_config
    from tests.test_learner_learner import tiny_cfg

    cfg = tiny_cfg(cp=2)
    spec = build_layer_spec(cfg.model, build_transformer_config(cfg.model, cfg.parallel))
    core = spec.layer_specs[0].submodules.self_attention.submodules.core_attention
    out["spec_core_attention"] = core.__name__

    rope = RotaryEmbedding(kv_channels=DIM, rotary_percent=1.0, use_cpu_initialization=True)
    table = rope.get_emb(SEQ)
    LoadBalancedRotaryEmbedding.adopt(rope)
    out["rope"] = float((rope(SEQ) - table[idx]).abs().max())
    out["rope_shape"] = tuple(rope(SEQ).shape)
    return out


@pytest.mark.slow
def test_cp2_attention_matches_single_process_local_attention():
    for rank, res in enumerate(run_on_ranks(_worker, world_size=2, timeout_s=300)):
        assert res["p2p_refused"], rank
        assert res["spec_core_attention"] == "ContextParallelDotProductAttention"
        assert res["grad_scale"] > 1e-3
        assert res["rope"] == 0.0 and res["rope_shape"] == (SEQ // 2, 1, 1, DIM)
        for name in ("built_mask", "given_mask"):
            for key, diff in res[name].items():
                assert diff < 1e-5, (rank, name, key, diff)


def test_transformer_engine_mapping_passes_the_cp_communication_type():
    from gspo_megatron.model.provider import transformer_config_kwargs
    from tests.test_learner_learner import tiny_cfg

    cfg = tiny_cfg(cp=2)
    cfg.model.transformer_impl = "transformer_engine"
    gpu = transformer_config_kwargs(cfg.model, cfg.parallel, on_gpu=True)
    assert gpu["context_parallel_size"] == 2 and gpu["cp_comm_type"] == "p2p"
    cfg.model.transformer_impl = "local"
    cpu = transformer_config_kwargs(cfg.model, cfg.parallel, on_gpu=False)
    assert cpu["context_parallel_size"] == 2 and "cp_comm_type" not in cpu
