"""Token log-probs and entropy from (vocab-parallel) logits, and per-sequence reductions.

``vocab_parallel_logprobs_entropy`` turns logits ``[..., V_local]`` into the log-prob of each
target token and the entropy of each position's distribution, fp32 ``[...]``. Rank ``r`` of the
tensor-parallel group holds the contiguous vocabulary slice ``[r*V_local, (r+1)*V_local)``
(Megatron's layout); with no group the logits hold the whole vocabulary.

Why not ``log_softmax(logits.float()).gather(...)``: with Qwen3's 151,936-token vocabulary that
materialises a full-vocabulary fp32 tensor (about 10 GB for 16k tokens), and autograd keeps it for
the backward. Here a custom autograd function walks the tokens in chunks, keeps only per-token
statistics (max, sum of exponentials, target logit, entropy partial), merges them across the TP
group with two all-reduces of ``[num_tokens]`` vectors, and recomputes each chunk's softmax in the
backward (``grad_logits = g_lp * (onehot - p) - g_H * p * (log p + H)``). Extra memory is two fp32
chunks, whatever the token count. The logits are never modified (unless ``inplace_backward``).

TP autograd: the outputs are replicated on every TP rank and the loss computed from them is the
same on every rank, so each rank's gradient w.r.t. its own vocabulary slice is complete locally
(the same convention as Megatron's ``vocab_parallel_cross_entropy``); no backward all-reduce.

``sequence_sums`` completes per-sequence sums over the context-parallel group; see its docstring
for the gradient convention. The learner calls the first (``learner/forward.py``), the losses the
second (``algorithms/loss_terms.py``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

DEFAULT_CHUNK_SIZE = 512
"""Tokens per chunk: 2 fp32 chunks of Qwen3's vocabulary are 2 * 512 * 151,936 * 4 B = 0.58 GiB."""


def _group_size_rank(group) -> Tuple[int, int]:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _chunk_rows(num_rows: int, chunk_size: int) -> int:
    """Rows per chunk; small inputs still use >= 4 chunks so temporaries stay a fraction."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return max(1, min(chunk_size, math.ceil(num_rows / 4)))


def _shifted_fp32(chunk: torch.Tensor, shift: torch.Tensor, inv_temp: float,
                  out: torch.Tensor) -> torch.Tensor:
    """``out = chunk * inv_temp - shift[:, None]`` in fp32, one pass, never touching ``chunk``."""
    if inv_temp == 1.0:
        return torch.sub(chunk, shift.unsqueeze(-1), out=out)
    return torch.add(shift.neg().unsqueeze(-1), chunk, alpha=inv_temp, out=out)


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Chunked log-prob + entropy over a vocabulary split across a TP group (see module doc).

    Work buffers of ``[chunk, V_local]`` fp32 are allocated once per call and reused by every
    chunk (re-allocating them per chunk costs page faults on CPU); each pass is a single fused
    elementwise op writing into them.
    """

    @staticmethod
    def forward(ctx, full_logits: torch.Tensor, targets: torch.Tensor, tp_group,
                compute_entropy: bool, chunk_size: int, inv_temp: float, inplace_backward: bool,
                num_valid: int):
        num_rows, v_local = full_logits.shape
        logits = full_logits[:, :num_valid]  # padded vocabulary columns are left out (a view)
        tp_size, tp_rank = _group_size_rank(tp_group)
        local_targets = targets - tp_rank * v_local
        in_slice = (local_targets >= 0) & (local_targets < num_valid)
        local_targets = torch.where(in_slice, local_targets, torch.zeros_like(local_targets))

        f32 = dict(dtype=torch.float32, device=logits.device)
        step = _chunk_rows(num_rows, chunk_size)
        shifted = torch.empty(min(step, num_rows), num_valid, **f32)
        exps = torch.empty_like(shifted) if compute_entropy else shifted
        if num_rows and num_valid:
            row_max = logits.amax(dim=-1).float() * inv_temp
        else:  # a rank holding only padding: a finite floor keeps the TP merge NaN-free
            row_max = torch.full((num_rows,), torch.finfo(torch.float32).min, **f32)
        target_logit = full_logits.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).float() * inv_temp
        target_logit = torch.where(in_slice, target_logit, torch.zeros_like(target_logit))
        sum_exp = torch.empty(num_rows, **f32)  # sum_j exp(x_j - row_max), this rank's slice
        sum_ex = torch.zeros(num_rows, **f32)  # sum_j exp(x_j - row_max) * (x_j - row_max)
        for start in range(0, num_rows, step):
            rows = slice(start, start + step)
            n = min(step, num_rows - start)
            x = _shifted_fp32(logits[rows], row_max[rows], inv_temp, shifted[:n])
            e = torch.exp(x, out=exps[:n])
            sum_exp[rows] = e.sum(dim=-1)
            if compute_entropy:  # in place, not a matmul: TF32 would cost the entropy precision
                sum_ex[rows] = e.mul_(x).sum(dim=-1)

        if tp_size > 1:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
            # Rescale this slice's partial sums from its own max to the global one, then add.
            shift = row_max - global_max
            scale = torch.exp(shift)
            stats = torch.stack([sum_exp * scale, (sum_ex + shift * sum_exp) * scale, target_logit])
            dist.all_reduce(stats, group=tp_group)
            sum_exp, sum_ex, target_logit = stats[0], stats[1], stats[2]
            row_max = global_max
        log_z = row_max + torch.log(sum_exp)
        logprobs = target_logit - log_z
        # H = log S - sum_j e_j (x_j - m) / S with e_j = exp(x_j - m), S = sum_j e_j.
        entropy = torch.log(sum_exp) - sum_ex / sum_exp if compute_entropy else None

        ctx.save_for_backward(full_logits, local_targets, in_slice, log_z,
                              entropy if compute_entropy else log_z)
        ctx.cfg = (compute_entropy, step, inv_temp, inplace_backward, num_valid)
        if entropy is None:
            empty = torch.zeros((0,), **f32)
            ctx.mark_non_differentiable(empty)
            return logprobs, empty
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        full_logits, local_targets, in_slice, log_z, entropy = ctx.saved_tensors
        compute_entropy, step, inv_temp, inplace_backward, num_valid = ctx.cfg
        use_entropy = compute_entropy and grad_entropy is not None
        g_lp = grad_logprobs if grad_logprobs is not None else torch.zeros_like(log_z)
        full_grad = full_logits if inplace_backward else torch.empty_like(full_logits)
        full_grad[:, num_valid:] = 0
        logits, grad = full_logits[:, :num_valid], full_grad[:, :num_valid]
        num_rows = logits.shape[0]
        logp_buf = torch.empty(min(step, num_rows), num_valid, dtype=torch.float32,
                               device=logits.device)
        p_buf = torch.empty_like(logp_buf)
        # grad_x = inv_temp * [g_lp * onehot - p * (g_lp + g_H * (log p + H))]
        #        = inv_temp * g_lp * onehot + p * (a * log p + b),  a = -inv g_H, b = -inv (g_lp + g_H H)
        if use_entropy:
            a = -inv_temp * grad_entropy
            b = -inv_temp * (g_lp + grad_entropy * entropy)
        else:
            b = -inv_temp * g_lp
        hit = torch.where(in_slice, inv_temp * g_lp, torch.zeros_like(g_lp)).unsqueeze(-1)
        for start in range(0, num_rows, step):
            rows = slice(start, start + step)
            n = min(step, num_rows - start)
            logp = _shifted_fp32(logits[rows], log_z[rows], inv_temp, logp_buf[:n])
            p = torch.exp(logp, out=p_buf[:n])
            if use_entropy:
                coef = torch.addcmul(b[rows].unsqueeze(-1), logp, a[rows].unsqueeze(-1), out=logp)
            else:
                coef = b[rows].unsqueeze(-1)
            g = torch.mul(p, coef, out=p)
            g.scatter_add_(-1, local_targets[rows].unsqueeze(-1), hit[rows])
            grad[rows].copy_(g)
        return full_grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group=None,
    compute_entropy: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    temperature: float = 1.0,
    inplace_backward: bool = False,
    vocab_size: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of ``targets`` and entropy under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V_local]``, any float dtype; this rank's vocabulary slice.
        targets: ``[...]`` int64 global vocabulary ids.
        tp_group: tensor-parallel group splitting the vocabulary; None for whole logits.
        compute_entropy: also return the per-position entropy (differentiable).
        chunk_size: tokens processed at once (bounds the fp32 temporaries).
        temperature: sampling temperature of the rollout (divides the logits, chunk by chunk).
        inplace_backward: write the logits' gradient into the logits' own storage (saves one
            logits-sized buffer in training; only safe when nothing else needs the logits after
            this backward, as in Megatron's ``vocab_parallel_cross_entropy``).
        vocab_size: the real vocabulary size when the logits are padded (Megatron pads the
            output layer to a multiple of 128 * TP): columns with global id >= vocab_size are
            left out (zero probability, zero gradient) without masking a copy of the logits.
            Logits must otherwise be finite (-inf would turn the entropy into NaN).
    Returns:
        ``(logprobs [...], entropy [...] or None)``, fp32.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         "must agree on every dimension but the last (vocabulary)")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    tp_size, tp_rank = _group_size_rank(tp_group)
    padded_vocab = logits.shape[-1] * tp_size
    vocab = padded_vocab if vocab_size is None else vocab_size
    if not 0 < vocab <= padded_vocab:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {padded_vocab}] "
                         f"(V_local={logits.shape[-1]} x tp={tp_size})")
    num_valid = min(max(vocab - tp_rank * logits.shape[-1], 0), logits.shape[-1])
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"target ids must lie in [0, {vocab}) (V_local={logits.shape[-1]} x "
                         f"tp={tp_size}); got [{int(targets.min())}, {int(targets.max())}]")
    lead = targets.shape
    logprobs, entropy = _VocabParallelLogProbEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), tp_group,
        compute_entropy, chunk_size, 1.0 / temperature, inplace_backward, num_valid)
    return logprobs.view(lead), (entropy.view(lead) if compute_entropy else None)


class _AllReduceSumLocalGrad(torch.autograd.Function):
    """All-reduce (sum) forward; backward hands the gradient to the local partial unchanged."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_reduce_sum_local_grad(partial: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``partial`` over ``group`` (replicated); gradient flows to the local partial only.

    Correct when every rank then computes the *same* loss from the sum, counts it once, and
    parameter gradients are summed over the group: rank r's graph yields exactly dL/d(its own
    tokens), and the sum over ranks is dL/d(all tokens). (An all-reduce in the backward would
    count the loss once per rank.)
    """
    if _group_size_rank(group)[0] == 1:
        return partial
    return _AllReduceSumLocalGrad.apply(partial, group)


def sequence_sums(values: torch.Tensor, seq_index: torch.Tensor, num_seqs: int,
                  cp_group=None) -> torch.Tensor:
    """Per-sequence sums ``[num_seqs]`` of per-token ``values [num_tokens]``, over the CP group.

    Under context parallelism each rank holds part of every sequence; the local partial sums are
    all-reduced so every CP rank sees the whole-sequence sum (every CP rank must pass the same
    ``num_seqs``). Differentiable w.r.t. ``values`` with the convention of
    :func:`all_reduce_sum_local_grad`.
    """
    if values.dim() != 1 or values.shape != seq_index.shape:
        raise ValueError(f"values {tuple(values.shape)} and seq_index {tuple(seq_index.shape)} "
                         "must be matching 1-D per-token tensors")
    dtype = values.dtype if values.is_floating_point() else torch.float32
    out = torch.zeros(num_seqs, dtype=dtype, device=values.device)
    out = out.index_add(0, seq_index, values.to(dtype))
    return all_reduce_sum_local_grad(out, cp_group)
