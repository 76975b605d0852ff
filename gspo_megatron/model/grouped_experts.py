"""Megatron's SequentialMLP with its per-expert loop done as two grouped matmuls (CPU, local spec).

Without Transformer Engine (CPU), Megatron-Core's MoE layer runs its experts one after the other
(megatron-core 0.16.1, ``megatron/core/transformer/moe/experts.py``, ``SequentialMLP.forward``):
per expert a split, two linear autograd functions (``tensor_parallel/layers.py``,
``LinearWithGradAccumulationAndAsyncCommunication``), the activation and the routing scale
(``transformer/mlp.py``, ``MLP.forward``), forward and backward. With small experts and few
tokens each, that per-call Python is most of the layer's time (docs/performance.md).

:class:`GroupedMatmulSequentialMLP` keeps SequentialMLP's modules and parameters
(``local_experts.<i>.linear_fc1/linear_fc2``: checkpoints, the HF mapping, weight sync and
Megatron's DDP gradient hooks see exactly what they see with SequentialMLP) and computes all
experts at once with ``torch._grouped_mm`` over the stacked weights: the dispatcher has already
grouped the tokens by expert, so the group offsets are the cumulative ``tokens_per_expert``.
The activation mirrors ``MLP.forward``'s unfused branch expression for expression. On CPU the
grouped matmul is the same per-group GEMM, so with one thread outputs and gradients are bitwise
those of the loop (``tests/test_grouped_experts.py`` checks it against Megatron's own
SequentialMLP). With several threads torch may split an element-wise kernel (SiLU) over one
large tensor at other points than over the per-expert pieces, and its vectorised and scalar
code paths can differ in the last bit, so a value may differ by one rounding there.

Whatever the grouped path does not cover runs the parent's loop unchanged: tensors off the CPU
(the GPU path uses Transformer Engine's grouped experts), other dtypes than fp32, sizes that are
not multiples of 4 (CPU ``_grouped_mm`` needs 16-byte rows), expert tensor parallelism,
FP8/FP4, biases, fused or TE activations, deferred weight gradients, recomputed MoE activations.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


def grouped_mm_available() -> bool:
    """``torch._grouped_mm`` is private API; without it every call takes the parent's loop."""
    return callable(getattr(torch, "_grouped_mm", None))


def _groupable_tensors(x: torch.Tensor, fc1_weight: torch.Tensor, gated: bool) -> bool:
    """What torch 2.13's CPU ``_grouped_mm`` takes: fp32 here (it refuses fp64, and bf16 / fp16
    need other layouts), and rows of a multiple of 16 bytes ("strides should be multiple of 16
    bytes"): the hidden size and the expert width multiples of 4."""
    hidden, width = fc1_weight.shape[-1], fc1_weight.shape[0]
    activated = width // 2 if gated else width  # fc2's input width
    return (x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32
            and fc1_weight.dtype == torch.float32
            and all(size % 4 == 0 for size in (hidden, width, activated)))


class GroupedMatmulSequentialMLP(SequentialMLP):
    """SequentialMLP whose forward groups the experts' GEMMs (same parameters, same math)."""

    def _groupable_config(self) -> bool:
        c = self.config
        etp = self.tp_group.size() if self.tp_group is not None else 1
        recomputed = set(getattr(c, "recompute_modules", None) or ())
        return (self.num_local_experts > 1 and etp == 1 and grouped_mm_available()
                and not c.fp8 and not getattr(c, "fp4", None) and not c.add_bias_linear
                and not c.bias_activation_fusion and not c.use_te_activation_func
                and not c.moe_apply_probs_on_input and not c.gradient_accumulation_fusion
                and not getattr(c, "delay_wgrad_compute", False)
                and not getattr(c, "cpu_offloading", False) and "moe_act" not in recomputed)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """Tokens ``[T, H]`` grouped by expert (``tokens_per_expert`` [E]) -> ``([T, H], None)``."""
        x = permuted_local_hidden_states
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]
        gated = self.config.gated_linear_unit
        if not (self._groupable_config() and _groupable_tensors(x, fc1[0], gated)):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = x.contiguous()  # 16-byte rows (checked above) with unit column stride
        offsets = torch.cumsum(tokens_per_expert.to(device="cpu", dtype=torch.int64), 0)
        offsets = offsets.to(torch.int32)
        fc1_weights = torch.stack(fc1)  # [E, ffn (x2 gated), H]
        fc2_weights = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])
        intermediate = torch._grouped_mm(x, fc1_weights.transpose(1, 2), offs=offsets)
        intermediate = self._activation(intermediate)
        original_dtype = intermediate.dtype  # MLP.forward: the routing scale, back to the dtype
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(original_dtype)
        output = torch._grouped_mm(intermediate, fc2_weights.transpose(1, 2), offs=offsets)
        return output, None

    def _activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        """``MLP.forward``'s unfused activation (megatron-core 0.16.1 ``transformer/mlp.py``)."""
        c = self.config
        if not c.gated_linear_unit:
            return c.activation_func(intermediate)
        x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)
        if (val := c.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return c.activation_func(x_glu) * (x_linear + c.glu_linear_offset)
