"""Context-parallel core attention for Megatron's *local* layer spec (CPU, gloo), and its RoPE.

Megatron-Core 0.16.1 implements context parallelism (CP) only inside Transformer Engine's
attention; its local ``DotProductAttention`` asserts ``context_parallel_size == 1``. This module
is the local-spec replacement used when ``cp > 1``, with the same constructor and ``forward``
signature:

1. Each CP rank holds the load-balanced chunks ``r`` and ``2 * cp - 1 - r`` of every row
   (``distributed/context_parallel.py``). Keys and values are all-gathered over the CP group
   along the sequence dimension with Megatron's autograd-aware gather (forward all-gather,
   backward reduce-scatter of the gradient: each rank's keys get the sum of every rank's
   queries' grads).
2. This rank's queries attend to all gathered keys with a causal mask on *global* positions
   (``key_pos > query_pos`` is masked); the learner passes that mask
   (``MicroBatch.causal_block_mask``), and it is rebuilt here when none is given. Padding sits at
   the end of a row, after every real query, so it is never attended to.
3. GQA repeats the key/value heads like the local attention; softmax in fp32.

It is the plain all-gather form of CP (what TE calls ``cp_comm_type="all_gather"``): memory for
keys/values is that of the full row, scores are ``[S / cp, S]`` per rank. It exists so CP can be
built, run and checked against a single process on CPU; on GPU Transformer Engine's attention
(ring / all-gather / a2a, THD) is used instead.

:class:`LoadBalancedRotaryEmbedding` slices the RoPE table with the same indices. Megatron's own
slicing (``get_pos_emb_on_this_cp_rank``) builds its index with ``pin_memory=True``, which needs
CUDA; the result is identical.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from gspo_megatron.distributed.context_parallel import (load_balanced_causal_mask,
                                                       load_balanced_indices)


def _megatron_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class ContextParallelDotProductAttention(_megatron_base()):
    """Core attention ``[sq, b, np, hn] x [sk, b, ng, hn] -> [sq, b, np * hn]`` over a CP group."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None) -> None:
        from megatron.core import parallel_state
        from megatron.core.utils import divide

        super().__init__(config=config)
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by the local "
                             "context-parallel attention")
        if config.window_size is not None:
            raise ValueError("sliding-window attention is not supported by the local "
                             "context-parallel attention")
        if cp_comm_type not in (None, "all_gather"):
            raise ValueError(f"cp_comm_type={cp_comm_type!r}: the local context-parallel attention "
                             "only all-gathers keys/values (use Transformer Engine for others)")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        tp_group = getattr(pg_collection, "tp", None)
        if tp_group is None:
            tp_group = parallel_state.get_tensor_model_parallel_group()
        self.cp_group = getattr(pg_collection, "cp", None)
        if self.cp_group is None:
            self.cp_group = parallel_state.get_context_parallel_group()
        tp_size = tp_group.size()
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_groups = divide(config.num_query_groups, tp_size)
        self.head_dim = divide(config.kv_channels * config.num_attention_heads,
                               config.num_attention_heads)
        self.softmax_scale = softmax_scale if softmax_scale is not None \
            else 1.0 / math.sqrt(self.head_dim)
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout)

    def _gather(self, x: Tensor) -> Tensor:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if self.cp_group.size() == 1:
            return x
        return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True,
                                                    group=self.cp_group)

    def _mask(self, attention_mask: Optional[Tensor], sq: int, sk: int, device) -> Tensor:
        cp = self.cp_group.size()
        if attention_mask is None:
            if sk != sq * cp:
                raise ValueError(f"{sq} local queries and {sk} gathered keys do not match cp={cp}")
            return load_balanced_causal_mask(sk, cp, self.cp_group.rank()).to(device)
        if tuple(attention_mask.shape[-2:]) != (sq, sk):
            raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)}: expected "
                             f"[..., {sq}, {sk}] (local queries x all CP ranks' keys)")
        return attention_mask.bool()

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Optional[Tensor], attn_mask_type=None,
                attention_bias: Optional[Tensor] = None, packed_seq_params=None) -> Tensor:
        """``query [sq, b, np, hn]``, ``key / value [sq, b, ng, hn]`` (this rank's share)."""
        if packed_seq_params is not None:
            raise ValueError("packed sequences (THD) need Transformer Engine's attention")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the local CP attention")
        key, value = self._gather(key), self._gather(value)
        repeat = self.num_heads // self.num_groups
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        sq, b, heads, dim = query.shape
        sk = key.shape[0]
        # [b, np, sq, hn] x [b, np, hn, sk] -> [b, np, sq, sk]
        scores = torch.matmul(query.permute(1, 2, 0, 3), key.permute(1, 2, 3, 0)).float()
        scores = scores * self.softmax_scale
        mask = self._mask(attention_mask, sq, sk, scores.device)
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(query.dtype)
        probs = self._dropout(probs)
        context = torch.matmul(probs, value.permute(1, 2, 0, 3))  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)

    def _dropout(self, probs: Tensor) -> Tensor:
        if self.attention_dropout.p == 0.0 or not self.training:
            return probs
        from megatron.core import tensor_parallel

        if self.config.sequence_parallel:
            return self.attention_dropout(probs)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.attention_dropout(probs)


def _rotary_base():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding


class LoadBalancedRotaryEmbedding(_rotary_base()):
    """Megatron's ``RotaryEmbedding`` with a CPU-safe CP slice (same load-balanced positions)."""

    @classmethod
    def adopt(cls, rope) -> "LoadBalancedRotaryEmbedding":
        """Turn a built ``RotaryEmbedding`` into this class in place (it holds no parameters or
        buffers, so checkpoints are unaffected)."""
        if type(rope) is not _rotary_base():
            raise TypeError(f"expected megatron's RotaryEmbedding, got {type(rope).__name__}")
        rope.__class__ = cls
        return rope

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> Tensor:
        """``[max_seq_len // cp, 1, 1, dim]``: the table rows of this rank's positions."""
        emb = self.get_emb(max_seq_len, offset)
        group = cp_group if cp_group is not None else self.cp_group
        if group is None or group.size() == 1 or packed_seq:
            return emb
        index = load_balanced_indices(max_seq_len, group.size(), group.rank())
        return emb.index_select(0, index.to(emb.device))
