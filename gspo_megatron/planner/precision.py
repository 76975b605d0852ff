"""Bytes per parameter and per activation element for a run's precision and optimizer options.

What the learner builds (``learner/optimizer.py``, Megatron-Core 0.16.1):

* weights in ``params_dtype`` (bf16 on GPU, fp32 on CPU);
* one contiguous **fp32 gradient buffer** per model chunk (``grad_reduce_in_fp32=True``), every
  parameter of the stage, not sharded (``distributed/param_and_grad_buffer.py``);
* the **distributed optimizer** shards, over DP x CP (dense) or expert-DP (experts): fp32 main
  weights when the weights are 16-bit (none when they are fp32: the model weights are the main
  weights, ``distrib_optimizer.py: _build_model_and_main_param_groups``) plus Adam's exp_avg and
  exp_avg_sq. Without it every rank holds the full state.
  ``use_precision_aware_optimizer`` keeps the main weights as 16-bit remainders of the bf16
  weights (``store_param_remainders``) and the moments in ``moments_dtype``;
  ``optimizer_cpu_offload`` moves main weights and moments (fp32, ``HybridDeviceOptimizer`` with
  ``param_update_in_fp32``) to host memory;
* FP8 (Transformer Engine): each FP8 linear weight is quantised once per step and the copy kept
  for all micro-batches, row-wise for the forward and column-wise (transposed) for the backward
  GEMM on Hopper: 2 bytes per FP8 weight. Layers kept in BF16 have none.

Megatron's own rule of thumb (``theoretical_memory_usage.py``): 18 bytes/param without the
distributed optimizer, ``6 + 12 / dp`` with it (bf16 weights, fp32 grads, fp32 main + Adam);
:func:`Precision.bytes_per_param` reproduces both (``tests/test_planner_precision.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter / activation element of one run's precision and optimizer."""

    param_bytes: int = 2
    grad_bytes: int = 4
    main_param_bytes: int = 4
    """Distributed-optimizer main weights per parameter (0 when the weights are fp32)."""
    moment_bytes: int = 8
    """exp_avg + exp_avg_sq per parameter."""
    offload_fraction: float = 0.0
    """Share of main weights + moments held in host memory."""
    distributed_optimizer: bool = True
    fp8_weight_bytes: int = 0
    """Bytes of FP8 weight copies per FP8 linear weight (0 without FP8)."""
    fp8_bf16_layers: int = 0
    """Leading + trailing transformer layers kept in BF16 (no FP8 copies)."""
    act_bytes: int = 2
    """Element size of activations (the weights' dtype)."""
    frozen: Tuple[str, ...] = ()
    """``optimizer.freeze`` groups: weights only, no gradient-buffer slot, no optimizer state."""

    @property
    def optimizer_bytes(self) -> int:
        """Main weights + moments per parameter, before sharding and offload."""
        return self.main_param_bytes + self.moment_bytes

    def bytes_per_param(self, shard_group: int) -> float:
        """GPU bytes per parameter: weights + grads + this rank's optimizer share."""
        share = 1.0 / shard_group if self.distributed_optimizer else 1.0
        return self.param_bytes + self.grad_bytes + \
            self.optimizer_bytes * (1.0 - self.offload_fraction) * share

    @classmethod
    def from_config(cls, cfg, on_gpu: bool = True) -> "Precision":
        """From a GSPOConfig; ``on_gpu`` resolves ``params_dtype: auto`` (bf16 on GPU)."""
        m, o = cfg.model, cfg.optimizer
        dtype = m.params_dtype if m.params_dtype != "auto" else ("bf16" if on_gpu else "fp32")
        param_bytes = 2 if dtype == "bf16" else 4
        if param_bytes == 4:
            main = 0
        elif o.precision_aware:
            main = 2  # 16-bit remainders (store_param_remainders, TE >= 2.1)
        else:
            main = 4
        if o.cpu_offload:
            main = 4  # HybridDeviceOptimizer keeps fp32 copies (param_update_in_fp32)
        moments = 4 if (o.precision_aware and o.moments_dtype == "bf16" and not o.cpu_offload) \
            else 8
        fp8 = m.fp8.enabled
        return cls(param_bytes=param_bytes, grad_bytes=4, main_param_bytes=main,
                   moment_bytes=moments,
                   offload_fraction=o.offload_fraction if o.cpu_offload else 0.0,
                   distributed_optimizer=o.use_distributed_optimizer,
                   fp8_weight_bytes=2 if fp8 else 0,
                   fp8_bf16_layers=(m.fp8.num_layers_at_start_in_bf16
                                    + m.fp8.num_layers_at_end_in_bf16) if fp8 else 0,
                   act_bytes=param_bytes, frozen=tuple(o.freeze))
