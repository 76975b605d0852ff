"""Megatron DDP wrapping, the (distributed) Adam optimizer, the LR schedule and a guarded step.

Also the two things the cold start before RL does to them: a stage at its own constant learning
rate (:func:`constant_learning_rate`) and forgetting Adam's state (:func:`reset_adam_state`).

Gradients live in Megatron's contiguous fp32 grad buffers (``DistributedDataParallel``); with
``use_distributed_optimizer`` the Adam state and fp32 master weights are sharded over the
data-parallel group. The step is :meth:`MegatronOptimizer.step` taken apart so that the global
gradient norm is known *before* anything is written: a non-finite norm skips the update
(grads are zeroed by the caller), which a plain ``step()`` without a loss scaler would not.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from gspo_megatron.config.schema import OptimizerConfig

log = logging.getLogger(__name__)


def wrap_ddp(chunks: List[torch.nn.Module], tf_config, use_distributed_optimizer: bool):
    """Wrap each model chunk in Megatron's DistributedDataParallel (fp32 grad buffers)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
        use_distributed_optimizer=use_distributed_optimizer, check_for_nan_in_grad=False,
        average_in_collective=False)
    wrapped = []
    for i, chunk in enumerate(chunks):
        # Bucketing only matters when overlapping communication; chunks after the first never
        # overlap in Megatron's schedules either.
        wrapped.append(DistributedDataParallel(config=tf_config, ddp_config=ddp_config,
                                               module=chunk, disable_bucketing=i > 0))
    return wrapped


_MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def optimizer_config_kwargs(cfg: OptimizerConfig, params_dtype: torch.dtype) -> dict:
    """Keyword arguments of Megatron-Core's ``OptimizerConfig`` for our optimizer section.

    Memory options follow megatron/core/optimizer/optimizer_config.py (0.16.1):
    ``use_precision_aware_optimizer`` with ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (TE FusedAdam;
    ``store_param_remainders`` stays at its default, True), and ``optimizer_cpu_offload`` /
    ``optimizer_offload_fraction`` / ``overlap_cpu_optimizer_d2h_h2d`` (``HybridDeviceOptimizer``
    in optimizer/cpu_offloading/hybrid_optimizer.py, which needs CUDA streams).
    """
    kwargs = dict(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=params_dtype == torch.bfloat16, fp16=False,
        params_dtype=params_dtype, use_distributed_optimizer=cfg.use_distributed_optimizer)
    if cfg.precision_aware:
        moments = _MOMENT_DTYPES[cfg.moments_dtype]
        kwargs.update(use_precision_aware_optimizer=True, exp_avg_dtype=moments,
                      exp_avg_sq_dtype=moments)
    if cfg.cpu_offload:
        kwargs.update(optimizer_cpu_offload=True, optimizer_offload_fraction=cfg.offload_fraction,
                      overlap_cpu_optimizer_d2h_h2d=True)
    return kwargs


def build_optimizer(cfg: OptimizerConfig, chunks, params_dtype: torch.dtype):
    """Adam (decoupled weight decay) over all chunks; returns Megatron's optimizer object."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    from gspo_megatron.config.validate import ConfigError

    if (cfg.precision_aware or cfg.cpu_offload) and not torch.cuda.is_available():
        key = "optimizer.precision_aware" if cfg.precision_aware else "optimizer.cpu_offload"
        raise ConfigError(f"{key}: needs GPUs (Transformer Engine's FusedAdam / CUDA streams); "
                          "this process has none")
    optimizer = get_megatron_optimizer(MegatronOptimizerConfig(**optimizer_config_kwargs(
        cfg, params_dtype)), chunks)
    _fuse_cpu_adam(optimizer)
    return optimizer


def _fuse_cpu_adam(optimizer) -> int:
    """Step torch's Adam with its fused CPU kernel; returns how many param groups changed.

    Without Transformer Engine or apex, Megatron falls back to ``torch.optim.AdamW`` built with
    the defaults (``megatron/core/optimizer/__init__.py``), which on CPU tensors is the
    per-tensor Python loop: Megatron's optimizer step took 25 ms, fused 11 ms, on the benchmark
    MoE of docs/performance.md (0.99 M parameters). torch's fused Adam runs on CPU since 2.4
    and reads ``group["fused"]`` at every step; its state (``step`` a float32 tensor on the
    parameter's device) is what a fresh fused Adam creates.
    GPU optimizers (TE / apex FusedAdam, or torch on CUDA) are left alone.
    """
    changed = 0
    for opt in _sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            on_cpu = all(p.device.type == "cpu" for p in group["params"])
            if on_cpu and not group.get("fused") and not group.get("differentiable"):
                group["fused"], group["foreach"] = True, False
                changed += 1
    return changed


def build_scheduler(cfg: OptimizerConfig, optimizer, total_steps: int):
    """Linear warm-up to ``lr``, then constant / linear / cosine decay to ``min_lr``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = max(total_steps, cfg.warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.warmup_steps > 0 else cfg.lr, max_lr=cfg.lr,
        min_lr=cfg.min_lr, lr_warmup_steps=cfg.warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=decay_steps, wd_incr_style="constant")


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@dataclass
class StepResult:
    updated: bool
    grad_norm: float


def guarded_step(optimizer, clip_grad: float, loss_finite: bool) -> StepResult:
    """Clip and step unless the loss or the global grad norm is non-finite.

    Every rank reaches the same decision: the grad norm is all-reduced over the model-parallel
    groups by ``get_grad_norm`` and ``loss_finite`` must already be agreed on by the caller.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not loss_finite or not math.isfinite(grad_norm):
        return StepResult(updated=False, grad_norm=grad_norm)
    if clip_grad > 0.0:
        for opt in _sub_optimizers(optimizer):
            params = opt.get_parameters()
            if params and not getattr(opt, "is_stub_optimizer", False):
                clip_grad_by_total_norm_fp32(params, max_norm=clip_grad, total_norm=grad_norm)
    updated = optimizer.step_with_ready_grads()
    return StepResult(updated=bool(updated), grad_norm=grad_norm)


def reset_adam_state(optimizer) -> int:
    """Forget Adam's moments and step counts, as if the optimizer were new; returns how many
    parameter states were dropped.

    Used between the cold-start SFT and RL: Adam's second moments, fitted to SFT's large
    gradients, decay with ``beta2`` over ~1/(1-beta2) steps and meanwhile shrink RL updates
    (both variants are compared on the tiny run in docs/tiny_cpu_run.md). torch's Adam re-creates the state lazily
    at the next step, exactly as for a fresh optimizer; the distributed optimizer's fp32 main
    parameters are kept.
    """
    dropped = 0
    for opt in _sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None or getattr(opt, "is_stub_optimizer", False):
            continue
        dropped += len(inner.state)
        inner.state.clear()
    return dropped


def current_lr(optimizer) -> Optional[float]:
    for group in optimizer.param_groups:
        return float(group["lr"])
    return None


@contextlib.contextmanager
def constant_learning_rate(optimizer, scheduler, lr: float):
    """Run a stage (the cold start) at its own constant lr, then give the RL schedule back
    untouched: its step count, warm-up and decay start after the stage.

    ``scheduler`` is Megatron's ``OptimizerParamScheduler``; per-group ``max_lr`` / ``min_lr``
    overrides (which it reads before its own values) are set for the stage and restored after.
    """
    groups = optimizer.param_groups
    saved = (scheduler.num_steps, scheduler.max_lr, scheduler.min_lr, scheduler.init_lr,
             [(g.get("max_lr"), g.get("min_lr")) for g in groups])
    scheduler.max_lr = scheduler.min_lr = scheduler.init_lr = lr
    for g in groups:
        g["max_lr"] = g["min_lr"] = g["lr"] = lr
    try:
        yield
    finally:
        scheduler.num_steps, scheduler.max_lr, scheduler.min_lr, scheduler.init_lr, per_group = saved
        for g, (max_lr, min_lr) in zip(groups, per_group):
            for key, value in (("max_lr", max_lr), ("min_lr", min_lr)):
                if value is None:
                    g.pop(key, None)
                else:
                    g[key] = value
        scheduler.step(increment=0)  # re-apply the schedule's lr for its current step
