"""Build a Megatron-Core ``GPTModel`` for Qwen3 / Qwen3-MoE from our typed model config.

Qwen3 in Megatron terms: RMSNorm (pre-norm), QK RMSNorm per head, GQA, SwiGLU without biases,
RoPE (non-interleaved halves, like HF's ``rotate_half``), untied output layer unless
``tie_word_embeddings``. Qwen3-MoE replaces every MLP by routed experts: softmax over the
router logits, top-k, renormalised when ``norm_topk_prob`` -- which is Megatron's
``moe_router_pre_softmax=False`` (softmax of the top-k logits), and no shared expert.

Layer specs: Transformer Engine modules on GPU, Megatron's local modules on CPU with
:class:`SequenceParallelRMSNorm` so that TP + SP (needed for TP with MoE) runs there too.
Context parallelism: TE's attention does it on GPU (``cp_comm_type``, default ``p2p``); the local
spec gets :class:`ContextParallelDotProductAttention` and a CPU-safe CP slice of RoPE
(``model/context_parallel_attention.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from gspo_megatron.config.schema import ModelConfig, ParallelConfig
from gspo_megatron.config.validate import ConfigError
from gspo_megatron.model.norms import SequenceParallelRMSNorm

log = logging.getLogger(__name__)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the embedding so each TP rank holds an equal, aligned slice."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def resolve_model_config(model) -> ModelConfig:
    """The typed model config; sizes come from ``hf_path``'s config.json when it is set."""
    from gspo_megatron.model.hf_config import as_model_config, model_config_from_hf, read_hf_config

    model = as_model_config(model)
    if model.hf_path:
        source = str(Path(model.hf_path) / "config.json")
        return model_config_from_hf(read_hf_config(model.hf_path), base=model, source=source)
    return model


def resolve_transformer_impl(model: ModelConfig, on_gpu: Optional[bool] = None) -> str:
    """``transformer_engine`` or ``local``; ``auto`` picks TE exactly when a GPU is present."""
    if model.transformer_impl != "auto":
        return model.transformer_impl
    return "transformer_engine" if _on_gpu(on_gpu) else "local"


def resolve_params_dtype(model: ModelConfig, on_gpu: Optional[bool] = None) -> torch.dtype:
    """bf16 on GPU, fp32 on CPU unless the config says otherwise."""
    if model.params_dtype == "auto":
        return torch.bfloat16 if _on_gpu(on_gpu) else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[model.params_dtype]


def _on_gpu(on_gpu: Optional[bool]) -> bool:
    return torch.cuda.is_available() if on_gpu is None else on_gpu


def _fp8_kwargs(model: ModelConfig) -> dict:
    """FP8 through Transformer Engine: format, scaling recipe, leading/trailing BF16 layers."""
    fp8 = model.fp8
    keep_bf16 = fp8.num_layers_at_start_in_bf16 > 0 or fp8.num_layers_at_end_in_bf16 > 0
    if keep_bf16 and fp8.recipe == "delayed":
        raise ConfigError("model.fp8.recipe: 'delayed' scaling cannot keep the first/last layers "
                          "in BF16 (Megatron refuses it); set model.fp8.num_layers_at_start_in_bf16"
                          " and num_layers_at_end_in_bf16 to 0 or use tensorwise/blockwise/mxfp8")
    kwargs = dict(fp8=fp8.format, fp8_recipe=fp8.recipe, first_last_layers_bf16=keep_bf16)
    if keep_bf16:
        kwargs.update(num_layers_at_start_in_bf16=fp8.num_layers_at_start_in_bf16,
                      num_layers_at_end_in_bf16=fp8.num_layers_at_end_in_bf16)
    return kwargs


def _moe_kwargs(model: ModelConfig, on_gpu: bool) -> dict:
    """Qwen3-MoE routing: softmax, top-k (renormalised when norm_topk_prob), dropless."""
    if model.moe_token_dispatcher == "alltoall" and not on_gpu:
        # megatron/core/transformer/moe/token_dispatcher.py (0.16.1): MoEAlltoAllTokenDispatcher
        # creates a torch.cuda.Stream when it is built, whatever the expert-parallel size.
        raise ConfigError("model.moe_token_dispatcher: 'alltoall' needs CUDA (Megatron-Core's "
                          "all-to-all dispatcher creates a CUDA stream); use 'allgather' on CPU")
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_pre_softmax=not model.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_dtype=None if model.moe_router_dtype == "none" else model.moe_router_dtype,
        moe_token_dispatcher_type=model.moe_token_dispatcher,
        moe_grouped_gemm=model.moe_grouped_gemm,
        moe_expert_capacity_factor=None,  # dropless: every token reaches its top-k experts
        moe_shared_expert_intermediate_size=None,
        moe_permute_fusion=on_gpu and model.moe_token_dispatcher == "alltoall",
        # A RouterReplay per router (moe/router.py): inert until the learner sets an action, it
        # lets routing replay and the expert-volatility metric record / replay the top-k.
        moe_enable_routing_replay=True,
    )


def transformer_config_kwargs(model: ModelConfig, parallel: ParallelConfig,
                              on_gpu: Optional[bool] = None) -> dict:
    """The keyword arguments of Megatron's ``TransformerConfig`` for this model and layout.

    ``on_gpu`` defaults to "is there a GPU"; tests pass ``True`` to check the GPU mapping here.
    """
    on_gpu = _on_gpu(on_gpu)
    impl = resolve_transformer_impl(model, on_gpu)
    kwargs = dict(**_architecture_kwargs(model), **_parallel_kwargs(parallel, on_gpu),
                  **_precision_and_kernel_kwargs(model, impl, on_gpu))
    if parallel.cp > 1 and impl == "transformer_engine":
        kwargs.update(cp_comm_type=cp_comm_type(parallel))
    if model.num_experts > 0:
        kwargs.update(_moe_kwargs(model, on_gpu))
    if model.recompute != "none":
        kwargs.update(recompute_granularity=model.recompute,
                      recompute_method="uniform" if model.recompute == "full" else None,
                      recompute_num_layers=1 if model.recompute == "full" else None)
    if model.fp8.enabled:
        if impl != "transformer_engine":
            raise ConfigError("model.fp8.enabled: FP8 needs Transformer Engine "
                              "(model.transformer_impl=transformer_engine, on a GPU)")
        kwargs.update(_fp8_kwargs(model))
    return kwargs


def _architecture_kwargs(model: ModelConfig) -> dict:
    """Qwen3's shapes: GQA, head dim, RMSNorm, QK-norm, SwiGLU without biases, no dropout."""
    return dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
    )


def _parallel_kwargs(parallel: ParallelConfig, on_gpu: bool) -> dict:
    """The TP / PP / VPP / CP / SP / EP / ETP layout and how pipeline stages talk."""
    return dict(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        # Uneven stages: Megatron computes every stage's layer count and global layer offset
        # from these two (transformer_block.get_num_layers_to_build,
        # transformer_layer.get_transformer_layer_offset); conversion, export and resharding
        # read the global index back from each layer's layer_number.
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_pipeline_stage,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        # gloo matches p2p messages between two ranks in posting order only; Megatron's batched
        # p2p then swaps activations and gradients under interleaved PP=2 (both directions carry
        # both). The unbatched path puts the two directions on different groups.
        batch_p2p_comm=on_gpu,
    )


def _precision_and_kernel_kwargs(model: ModelConfig, impl: str, on_gpu: bool) -> dict:
    """Parameter dtype, where weights are initialised, and which fused kernels may run."""
    dtype = resolve_params_dtype(model, on_gpu)
    fused = on_gpu and impl == "transformer_engine"
    return dict(
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        # Fusions need CUDA kernels (apex / TE); the local path computes the same thing unfused.
        bias_activation_fusion=fused,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=fused,
        apply_rope_fusion=fused,
        gradient_accumulation_fusion=False,
    )


def cp_comm_type(parallel: ParallelConfig) -> str:
    """TE's context-parallel communication (``parallel.cp_comm_type``, default ``p2p``)."""
    return parallel.cp_comm_type or "p2p"


def build_transformer_config(model: ModelConfig, parallel: ParallelConfig,
                             on_gpu: Optional[bool] = None):
    """Map the model and parallel configs onto Megatron's ``TransformerConfig``."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**transformer_config_kwargs(model, parallel, on_gpu))


def allow_moe_without_transformer_engine() -> None:
    """Let Megatron's MoE router run where Transformer Engine does not import (GPU or CPU).

    megatron-core 0.16.1 ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` inside its
    TE ``try`` block and leaves the name undefined without TE; ``RouterGatingLinearFunction``
    then tests ``te_general_gemm is not None`` and every MoE forward raises NameError. ``None``
    is the value that selects its plain ``torch.mm`` branch. (The CPU compatibility layer does
    the same on CPU; this covers a GPU without TE, e.g. tools/gpu_check.py on a bare image.)
    """
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_layer_spec(model: ModelConfig, config, vp_stage: Optional[int] = None):
    """Transformer Engine spec on GPU, local spec with SP-capable norms elsewhere."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    num_experts = model.num_experts or None
    if num_experts:
        allow_moe_without_transformer_engine()
    if resolve_transformer_impl(model) == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=model.moe_grouped_gemm,
            qk_layernorm=model.qk_layernorm)
    layer = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=model.moe_grouped_gemm,
        qk_layernorm=model.qk_layernorm, normalization="RMSNorm")
    sub = layer.submodules
    sub.input_layernorm = SequenceParallelRMSNorm
    sub.pre_mlp_layernorm = SequenceParallelRMSNorm
    if num_experts and not model.moe_grouped_gemm:  # same parameters, one grouped GEMM on CPU
        from gspo_megatron.model.grouped_experts import GroupedMatmulSequentialMLP

        sub.mlp.submodules.experts.module = GroupedMatmulSequentialMLP
    attn = sub.self_attention.submodules
    if config.context_parallel_size > 1:
        from gspo_megatron.model.context_parallel_attention import (
            ContextParallelDotProductAttention,
        )

        attn.core_attention = ContextParallelDotProductAttention
    if model.qk_layernorm:
        attn.q_layernorm = SequenceParallelRMSNorm
        attn.k_layernorm = SequenceParallelRMSNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers,
                                      layer_norm=SequenceParallelRMSNorm)


def build_gpt_model(model: ModelConfig, parallel: ParallelConfig, *,
                    pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                    vp_stage: Optional[int] = None, config=None):
    """One model chunk for this rank's pipeline stage. Needs Megatron parallel state."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = config or build_transformer_config(model, parallel)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None,
                                                             vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None,
                                                             vp_stage=vp_stage)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(model, config, vp_stage=vp_stage),
        vocab_size=padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by,
                                     parallel.tp),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(model.rope_theta),
        vp_stage=vp_stage,
    )
    if config.context_parallel_size > 1 and resolve_transformer_impl(model) == "local" \
            and getattr(gpt, "rotary_pos_emb", None) is not None:
        from gspo_megatron.model.context_parallel_attention import LoadBalancedRotaryEmbedding

        LoadBalancedRotaryEmbedding.adopt(gpt.rotary_pos_emb)
    mark_expert_params(gpt)
    return gpt


def mark_expert_params(module) -> int:
    """Reduce every routed expert's gradient over the expert-data-parallel group.

    Megatron marks expert weights ``allreduce=False`` (expert-DP reduction) only when EP > 1;
    with EP = 1 they join the dense DP buffers. But with TP > 1, SP and ETP = 1 each TP rank
    feeds the (replicated) experts only its own sequence shard, so their gradients are partial
    and must also be summed over the TP peers -- which are exactly the extra members of the
    expert-DP group. Marking them always is correct in every layout (where ETP = TP the two
    groups coincide) and keeps replicated experts identical on every rank.
    """
    count = 0
    for name, param in module.named_parameters():
        if ".experts." in name:
            param.allreduce = False
            count += 1
    return count
