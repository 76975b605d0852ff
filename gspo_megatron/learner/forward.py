"""One micro-batch through a Megatron model chunk, and its response-token log-probs.

Attention metadata depends on the backend, not on the data: Transformer Engine gets the packed
row's ``cu_seqlens`` as THD :class:`PackedSeqParams` (it resets RoPE positions and attends per
sequence). Megatron's local attention gets the ``rows`` layout (one sequence per row) and a
causal mask; a packed row still works there through the equivalent block-diagonal mask, with
RoPE on row positions (exact in value: scores depend only on the query-key distance inside a
sequence).

Log-probs: the output layer's vocabulary is padded (``make_vocab_size_divisible_by`` x TP);
padded columns are not part of the Hugging Face model or of the rollout engine's softmax, so
they are masked out before the (vocab-parallel) softmax. Only response positions are passed on,
so the fp32 softmax temporaries scale with response tokens, not with the row.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gspo_megatron.learner.batch import MicroBatch

MASKED_LOGIT = -1.0e9
"""Logit given to padded vocabulary entries: exp() underflows to exactly 0 without inf/NaN."""


def packed_seq_params(mb: MicroBatch, device: Optional[torch.device] = None):
    """THD metadata for Transformer Engine: one packed row, boundaries from ``cu_seqlens``.

    Under context parallelism the boundaries stay *global* (TE splits each sequence itself):
    ``cu_seqlens`` are the real lengths' sums, ``cu_seqlens_padded`` the offsets of sequences
    padded to a multiple of ``2 * cp``, and ``max_seqlen`` the longest padded sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb.cu_seqlens.to(device=device, dtype=torch.int32)
    padded = cu if mb.cu_seqlens_padded is None \
        else mb.cu_seqlens_padded.to(device=device, dtype=torch.int32)
    max_len = int((padded[1:] - padded[:-1]).max()) if padded.numel() > 1 else 0
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=max_len, max_seqlen_kv=max_len)


def forward_chunk(chunk, mb: MicroBatch, use_packed_seq: bool, device: torch.device) -> torch.Tensor:
    """Run one model chunk. Last stage: logits ``[R, S_local, V_local]``; otherwise hidden states.

    Under context parallelism ``mb`` is already this CP rank's share (``S_local = S / cp``); the
    local-spec attention gets the ``[S_local, S]`` load-balanced causal mask."""
    tokens = mb.tokens.to(device, non_blocking=True)
    position_ids = mb.position_ids.to(device, non_blocking=True)
    if use_packed_seq:
        return chunk(tokens, position_ids, None, packed_seq_params=packed_seq_params(mb, device))
    mask = mb.causal_block_mask().to(device, non_blocking=True)
    return chunk(tokens, position_ids, mask)


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Give padded vocabulary columns of this TP rank's slice a logit of ``MASKED_LOGIT``."""
    v_local = logits.shape[-1]
    first_padded = vocab_size - tp_rank * v_local
    if first_padded >= v_local:
        return logits
    keep = torch.arange(v_local, device=logits.device) < max(first_padded, 0)
    return logits.masked_fill(~keep, MASKED_LOGIT)


def response_logprobs(logits: torch.Tensor, mb: MicroBatch, vocab_size: int, tp_group,
                      tp_rank: int, temperature: float, compute_entropy: bool
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) of the response tokens, flat ``[N]`` in ``mb.seq_index`` order."""
    from gspo_megatron.algorithms.logprobs import vocab_parallel_logprobs_entropy

    positions = mb.response_positions.to(logits.device)
    flat = logits.reshape(-1, logits.shape[-1])  # row-major [R * S, V_local]
    selected = flat.index_select(0, positions)  # [N, V_local]
    selected = mask_padded_vocab(selected, vocab_size, tp_rank)
    targets = mb.labels.reshape(-1).to(logits.device).index_select(0, positions)
    return vocab_parallel_logprobs_entropy(selected, targets, tp_group=tp_group,
                                           compute_entropy=compute_entropy,
                                           temperature=temperature)


def split_by_sequence(values: torch.Tensor, mb: MicroBatch) -> list:
    """Flat ``[N]`` -> one tensor per sequence of the micro-batch (detached, CPU, fp32)."""
    counts = torch.bincount(mb.seq_index, minlength=mb.num_seqs).tolist()
    return [t.detach().float().cpu() for t in torch.split(values, counts)]
