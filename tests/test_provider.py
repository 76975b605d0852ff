"""Model provider: HF config -> Megatron model with transformers' exact parameter count, and the
GPU (Transformer Engine, FP8, grouped GEMM, alltoall) config mapping, checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.config.schema import FP8Config, ModelConfig, ParallelConfig
from gspo_megatron.config.validate import ConfigError
from gspo_megatron.model.hf_config import model_config_from_hf
from gspo_megatron.model.provider import (padded_vocab_size, resolve_params_dtype,
                                          resolve_transformer_impl, transformer_config_kwargs)
from tests.multiproc import run_on_ranks

HF_MOE = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
              tie_word_embeddings=False)
HF_DENSE = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=128, tie_word_embeddings=True)


def _count(rank: int, configs: dict) -> dict:
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.model.provider import build_gpt_model

    init_distributed(ParallelConfig(), seed=0)
    base = ModelConfig(transformer_impl="local", params_dtype="fp32",
                       make_vocab_size_divisible_by=1)
    out = {}
    for name, hf in configs.items():
        model = build_gpt_model(model_config_from_hf(hf, base=base), ParallelConfig())
        # Tied embeddings: the output layer reuses the embedding weight (counted once).
        out[name] = sum(p.numel() for p in model.parameters())
    return out


def _transformers_count(hf: dict) -> int:
    from transformers import Qwen3Config, Qwen3MoeConfig, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    cls, cfg_cls = ((Qwen3MoeForCausalLM, Qwen3MoeConfig) if hf["model_type"] == "qwen3_moe"
                    else (Qwen3ForCausalLM, Qwen3Config))
    kwargs = {k: v for k, v in hf.items() if k != "model_type"}
    return cls(cfg_cls(**kwargs)).num_parameters()


@pytest.mark.slow
def test_parameter_count_equals_transformers_for_moe_and_dense_tied():
    megatron = run_on_ranks(_count, world_size=1, configs={"moe": HF_MOE, "dense": HF_DENSE})[0]
    assert megatron["moe"] == _transformers_count(HF_MOE)
    assert megatron["dense"] == _transformers_count(HF_DENSE)


def _moe_model(**kw) -> ModelConfig:
    return model_config_from_hf(HF_MOE, base=ModelConfig(**kw))


def test_cpu_mapping_of_a_qwen3_moe():
    kw = transformer_config_kwargs(_moe_model(transformer_impl="local", moe_aux_loss_coeff=1e-3),
                                   ParallelConfig(tp=2, sp=True, ep=2), on_gpu=False)
    assert (kw["num_query_groups"], kw["kv_channels"], kw["qk_layernorm"]) == (2, 16, True)
    assert kw["normalization"] == "RMSNorm" and kw["layernorm_epsilon"] == 1e-6
    assert kw["gated_linear_unit"] and kw["activation_func"] is torch.nn.functional.silu
    assert not kw["add_bias_linear"] and not kw["add_qkv_bias"]
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (4, 2, 24)
    assert kw["moe_router_pre_softmax"] is False  # norm_topk_prob: softmax over the top-k
    assert kw["moe_router_dtype"] == "fp32" and kw["moe_expert_capacity_factor"] is None
    assert kw["moe_router_load_balancing_type"] == "aux_loss" and kw["moe_aux_loss_coeff"] == 1e-3
    assert kw["params_dtype"] == torch.float32 and kw["use_cpu_initialization"]
    assert kw["sequence_parallel"] and kw["tensor_model_parallel_size"] == 2
    assert not kw["bias_activation_fusion"] and not kw["apply_rope_fusion"]
    assert "fp8" not in kw


def test_gpu_mapping_selects_te_fp8_grouped_gemm_and_alltoall():
    model = _moe_model(moe_grouped_gemm=True, moe_token_dispatcher="alltoall",
                       fp8=FP8Config(enabled=True, format="hybrid", recipe="tensorwise",
                                     num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1))
    assert resolve_transformer_impl(model, on_gpu=True) == "transformer_engine"
    assert resolve_transformer_impl(model, on_gpu=False) == "local"
    assert resolve_params_dtype(model, on_gpu=True) == torch.bfloat16
    kw = transformer_config_kwargs(model, ParallelConfig(tp=4, sp=True, ep=8), on_gpu=True)
    assert kw["params_dtype"] == torch.bfloat16 and kw["bf16"] and not kw["use_cpu_initialization"]
    assert kw["fp8"] == "hybrid" and kw["fp8_recipe"] == "tensorwise"
    assert kw["first_last_layers_bf16"] and kw["num_layers_at_start_in_bf16"] == 1
    assert kw["num_layers_at_end_in_bf16"] == 1
    assert kw["moe_grouped_gemm"] and kw["moe_token_dispatcher_type"] == "alltoall"
    assert kw["moe_permute_fusion"] and kw["bias_activation_fusion"] and kw["apply_rope_fusion"]
    assert kw["expert_model_parallel_size"] == 8


def test_fp8_refusals_name_the_key():
    delayed = _moe_model(fp8=FP8Config(enabled=True, recipe="delayed"))
    with pytest.raises(ConfigError, match="model.fp8.recipe: 'delayed'"):
        transformer_config_kwargs(delayed, ParallelConfig(), on_gpu=True)
    ok = transformer_config_kwargs(
        _moe_model(fp8=FP8Config(enabled=True, recipe="delayed", num_layers_at_start_in_bf16=0,
                                 num_layers_at_end_in_bf16=0)), ParallelConfig(), on_gpu=True)
    assert ok["first_last_layers_bf16"] is False and ok["fp8_recipe"] == "delayed"
    with pytest.raises(ConfigError, match="model.fp8.enabled: FP8 needs Transformer Engine"):
        transformer_config_kwargs(_moe_model(fp8=FP8Config(enabled=True, recipe="tensorwise")),
                                  ParallelConfig(), on_gpu=False)


def test_alltoall_dispatcher_without_a_gpu_is_refused_with_its_key():
    """Megatron-Core's all-to-all dispatcher creates a CUDA stream when built: on CPU the model
    would fail deep inside Megatron ("torch.cuda.Stream requires CUDA support")."""
    with pytest.raises(ConfigError, match="model.moe_token_dispatcher: 'alltoall' needs CUDA"):
        transformer_config_kwargs(_moe_model(moe_token_dispatcher="alltoall"), ParallelConfig(),
                                  on_gpu=False)
    kw = transformer_config_kwargs(_moe_model(), ParallelConfig(), on_gpu=False)
    assert kw["moe_token_dispatcher_type"] == "allgather"


def test_vocab_padding_and_a_real_dense_transformer_config():
    assert padded_vocab_size(151936, 128, 1) == 151936  # Qwen3: 1187 * 128
    assert padded_vocab_size(151936, 128, 4) == 152064  # next multiple of 512
    assert padded_vocab_size(50, 8, 2) == 64
    from gspo_megatron.model.provider import build_transformer_config

    dense = model_config_from_hf(HF_DENSE, base=ModelConfig(params_dtype="fp32"))
    cfg = build_transformer_config(dense, ParallelConfig(), on_gpu=False)
    assert cfg.num_moe_experts is None and cfg.kv_channels == 8 and cfg.ffn_hidden_size == 48


def test_moe_router_runs_without_transformer_engine_in_a_fresh_interpreter():
    """Megatron 0.16.1 leaves ``te_general_gemm`` undefined without TE (NameError in the router);
    building a local MoE layer spec defines it, with no CPU compatibility layer applied."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        import megatron.core.transformer.moe.moe_utils as mu
        from gspo_megatron.config.schema import ModelConfig, ParallelConfig
        from gspo_megatron.distributed.cpu_compat import cpu_compat_applied
        from gspo_megatron.distributed.ports import free_port
        from gspo_megatron.model.provider import build_layer_spec, build_transformer_config
        x, w = torch.randn(3, 4), torch.randn(2, 4)
        try:
            mu.router_gating_linear(x, w, None, torch.float32)
            raise SystemExit("megatron defines te_general_gemm now: drop the workaround")
        except NameError:
            pass
        import torch.distributed as dist
        from megatron.core import parallel_state
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % free_port(),
                                rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        model = ModelConfig(transformer_impl="local", params_dtype="fp32", num_layers=2)
        build_layer_spec(model, build_transformer_config(model, ParallelConfig(), on_gpu=False))
        assert not cpu_compat_applied()
        out = mu.router_gating_linear(x, w, None, torch.float32)
        torch.testing.assert_close(out, x @ w.t())
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
