"""Chunked vocab-parallel log-probs / entropy against the naive log_softmax, packed vs padded
layouts, per-sequence sums, and (slow, 2 gloo processes) TP=2 and CP=2 against one rank."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.algorithms.logprobs import sequence_sums, vocab_parallel_logprobs_entropy
from tests.multiproc import run_on_ranks

torch.set_num_threads(1)


def _naive(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _case(seed: int, shape=(5, 3), vocab: int = 37, scale: float = 4.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=gen) * scale
    targets = torch.randint(0, vocab, shape, generator=gen)
    g_lp, g_h = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    return logits, targets, g_lp, g_h


@pytest.mark.parametrize("chunk_size,temperature", [(1, 1.0), (4, 0.7), (1000, 1.3)])
def test_values_and_gradients_match_naive_log_softmax(chunk_size, temperature):
    logits, targets, g_lp, g_h = _case(0)
    mine = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(mine, targets, chunk_size=chunk_size,
                                              temperature=temperature)
    (lp * g_lp + ent * g_h).sum().backward()
    ref = logits.clone().requires_grad_()
    lp_ref, ent_ref = _naive(ref, targets, temperature)
    (lp_ref * g_lp + ent_ref * g_h).sum().backward()
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == targets.shape
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.grad, ref.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.detach(), logits)  # the logits are never modified


def test_without_entropy_and_with_inplace_backward():
    logits, targets, g_lp, _ = _case(1)
    ref = logits.clone().requires_grad_()
    lp_ref, _ = _naive(ref, targets)
    (lp_ref * g_lp).sum().backward()
    leaf = logits.clone().requires_grad_()
    staged = leaf * 1.0  # a non-leaf like the output layer's logits
    lp, ent = vocab_parallel_logprobs_entropy(staged, targets, compute_entropy=False,
                                              chunk_size=2, inplace_backward=True)
    assert ent is None
    (lp * g_lp).sum().backward()
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(leaf.grad, ref.grad, atol=1e-5, rtol=0)


def test_padded_vocabulary_columns_are_left_out():
    logits, targets, g_lp, g_h = _case(6, vocab=37)
    padded = torch.cat([logits, torch.full((5, 3, 3), 50.0)], dim=-1).requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(padded, targets, vocab_size=37, chunk_size=4)
    (lp * g_lp + ent * g_h).sum().backward()
    ref = logits.clone().requires_grad_()
    lp_ref, ent_ref = _naive(ref, targets)
    (lp_ref * g_lp + ent_ref * g_h).sum().backward()
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded.grad[..., :37], ref.grad, atol=1e-5, rtol=0)
    assert bool((padded.grad[..., 37:] == 0).all())
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 37\)"):
        vocab_parallel_logprobs_entropy(padded, torch.full((5, 3), 38), vocab_size=37)


def test_bf16_logits_give_fp32_outputs_close_to_fp32_reference():
    logits, targets, _, _ = _case(2)
    lp, ent = vocab_parallel_logprobs_entropy(logits.bfloat16(), targets)
    lp_ref, ent_ref = _naive(logits.bfloat16().float(), targets)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)


def test_autograd_keeps_no_full_vocabulary_copy():
    """Only the logits themselves and [num_tokens] vectors are saved for the backward."""
    logits, targets, _, _ = _case(3, shape=(64,), vocab=50)
    logits.requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_logprobs_entropy(logits, targets)
    big = [t for t in saved if t.numel() > 64]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()


def test_bad_targets_and_shapes_are_refused():
    logits = torch.zeros(4, 10)
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 10\)"):
        vocab_parallel_logprobs_entropy(logits, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="must agree"):
        vocab_parallel_logprobs_entropy(logits, torch.zeros(3, dtype=torch.long))


def test_packed_and_padded_batches_give_the_same_sequence_values():
    gen = torch.Generator().manual_seed(4)
    lengths = torch.tensor([5, 1, 3])
    mask = torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)  # right padded [3, 6]
    logits = torch.randn(3, 6, 11, generator=gen)
    targets = torch.randint(0, 11, (3, 6), generator=gen)
    lp_pad, ent_pad = vocab_parallel_logprobs_entropy(logits, targets)
    sums_pad = (lp_pad * mask).sum(1)

    # Packed: the real tokens of all rows concatenated, sequence b being row b.
    lp_pack, ent_pack = vocab_parallel_logprobs_entropy(logits[mask], targets[mask])
    seq_index = torch.arange(3).unsqueeze(1).expand(3, 6)[mask]
    assert seq_index.tolist() == [0, 0, 0, 0, 0, 1, 2, 2, 2]
    torch.testing.assert_close(sequence_sums(lp_pack, seq_index, 3), sums_pad)
    torch.testing.assert_close(ent_pack, ent_pad[mask])


def test_sequence_sums_gradient_and_shape_check():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    sums = sequence_sums(values, torch.tensor([0, 0, 2, 2]), 3)
    assert sums.tolist() == [3.0, 0.0, 7.0]
    (sums * torch.tensor([1.0, 5.0, 2.0])).sum().backward()
    assert values.grad.tolist() == [1.0, 1.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="must be matching 1-D per-token tensors"):
        sequence_sums(values, torch.tensor([0, 0, 2]), 3)


def _tp_cp_worker(rank: int) -> dict:
    """TP=2 vocab split and CP=2 token split on the same two processes."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    logits, targets, g_lp, g_h = _case(5, shape=(7, 2), vocab=38, scale=6.0)
    # TP: rank r holds vocabulary slice [19r, 19r + 19); loss replicated on both ranks.
    mine = logits[..., rank * 19:(rank + 1) * 19].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(mine, targets, tp_group=group, chunk_size=3)
    (lp * g_lp + ent * g_h).sum().backward()
    ref = logits.clone().requires_grad_()
    lp_ref, ent_ref = _naive(ref, targets)
    (lp_ref * g_lp + ent_ref * g_h).sum().backward()
    out = {"lp": (lp - lp_ref).abs().max().item(), "ent": (ent - ent_ref).abs().max().item(),
           "grad": (mine.grad - ref.grad[..., rank * 19:(rank + 1) * 19]).abs().max().item()}
    # Padded vocabulary: 30 real ids, rank 1 holds 11 real and 8 padded columns.
    real = targets % 30
    mine = logits[..., rank * 19:(rank + 1) * 19].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(mine, real, tp_group=group, vocab_size=30)
    (lp * g_lp + ent * g_h).sum().backward()
    ref = logits[..., :30].clone().requires_grad_()
    lp_ref, ent_ref = _naive(ref, real)
    (lp_ref * g_lp + ent_ref * g_h).sum().backward()
    ref_grad = torch.cat([ref.grad, torch.zeros(7, 2, 8)], -1)[..., rank * 19:(rank + 1) * 19]
    out["padded"] = max((lp - lp_ref).abs().max().item(), (ent - ent_ref).abs().max().item(),
                        (mine.grad - ref_grad).abs().max().item())
    # CP: tokens of 3 sequences split between ranks; sums and gradients vs the whole batch.
    values = torch.arange(1.0, 11.0)
    seq_index = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    part = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 1, 0]) == rank
    local = values[part].clone().requires_grad_()
    sums = sequence_sums(local, seq_index[part], 3, cp_group=group)
    (sums * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    out["cp_sums"] = sums.tolist()
    out["cp_whole"] = sequence_sums(values, seq_index, 3).tolist()
    out["cp_grad_ok"] = local.grad.tolist() == (seq_index[part] + 1.0).tolist()
    return out


@pytest.mark.slow
def test_tp2_and_cp2_equal_single_rank():
    for res in run_on_ranks(_tp_cp_worker, world_size=2, timeout_s=120):
        assert res["lp"] <= 1e-5 and res["ent"] <= 1e-5 and res["grad"] <= 1e-5, res
        assert res["padded"] <= 1e-5, res
        assert res["cp_sums"] == res["cp_whole"] == [6.0, 9.0, 40.0]
        assert res["cp_grad_ok"]
