"""Megatron's SequentialMLP with the expert loop replaced by two batched matmuls (local spec).

Without Transformer Engine (CPU), Megatron's MoE layer runs its experts one after the other
(``megatron/core/transformer/moe/experts.py``, ``SequentialMLP.forward``): per expert two linear
autograd functions, an activation and a scaling, forward and backward. With small experts and
few tokens per expert, that per-call overhead dominates the layer (profile in
docs/performance.md). :class:`BatchedSequentialMLP` keeps the same modules and parameters
(``local_experts.<i>.linear_fc1/linear_fc2``: checkpoints, the HF mapping and weight sync are
unchanged) and computes every expert at once: tokens, already grouped by expert by the
dispatcher, are placed in a zero-padded ``[E, C, H]`` block (C = most tokens of one expert),
then ``bmm`` with the stacked fc1 weights, gated SiLU, the routing probability (applied before
fc2, as ``MLP.forward`` does with ``per_token_scale``), ``bmm`` with the stacked fc2 weights.
Gradients reach each expert's parameter through the stack, so Megatron's DDP hooks see them as
usual.

It covers the configuration this project builds (gated SiLU, no bias, no FP8, expert TP 1);
anything else runs the parent's loop unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP


class BatchedSequentialMLP(SequentialMLP):
    """SequentialMLP whose forward batches the experts (same parameters, same math)."""

    def _batchable(self) -> bool:
        c = self.config
        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        return (self.num_local_experts > 1 and tp_size == 1 and not c.fp8
                and not getattr(c, "fp4", None) and not c.add_bias_linear and c.gated_linear_unit
                and c.activation_func is F.silu and not c.bias_activation_fusion
                and not c.use_te_activation_func and c.activation_func_clamp_value is None
                and c.glu_linear_offset == 0.0 and not c.moe_apply_probs_on_input)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """Tokens ``[T, H]`` grouped by expert (``tokens_per_expert`` [E]) -> outputs ``[T, H]``."""
        if not self._batchable():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        counts = tokens_per_expert.to(device="cpu", dtype=torch.long)
        num_experts, capacity = len(counts), int(counts.max()) if len(counts) else 0
        if capacity == 0:
            return x * 0.0, None
        # slot of token t in the padded block: expert * capacity + rank of t within its expert
        expert_of = torch.repeat_interleave(torch.arange(num_experts), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot = (expert_of * capacity + torch.arange(len(expert_of)) - starts[expert_of]).to(x.device)
        rows = num_experts * capacity
        padded = x.new_zeros((rows, x.shape[-1])).index_copy(0, slot, x)
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2I, H]
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, H, I]
        h = torch.bmm(padded.view(num_experts, capacity, -1), fc1.transpose(1, 2))
        gate, linear = torch.chunk(h, 2, dim=-1)
        probs = permuted_probs.new_zeros(rows).index_copy(0, slot, permuted_probs)
        act = ((F.silu(gate) * linear) * probs.view(num_experts, capacity, 1)).to(h.dtype)
        out = torch.bmm(act, fc2.transpose(1, 2)).reshape(rows, -1)
        return out.index_select(0, slot), None
