"""Context-parallel partitioning: load-balanced chunks, THD per-sequence chunks, and the CP
rank's view of a micro-batch (tokens, labels, response positions, full counts, token order)."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.learner.batch import SequenceBatch, build_micro_batch, plan_step
from gspo_megatron.learner.context_parallel import (load_balanced_causal_mask,
                                                    load_balanced_indices, padded_boundaries,
                                                    thd_partition_indices)
from gspo_megatron.learner.forward import packed_seq_params


def _batch(lengths, prompts):
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(1, 50, (n,), generator=gen) for n in lengths]
    return SequenceBatch(token_ids=tokens, prompt_lens=list(prompts),
                         advantages=[float(i) for i in range(len(lengths))],
                         old_logprobs=[-torch.arange(n - p, dtype=torch.float32) - i
                                       for i, (n, p) in enumerate(zip(lengths, prompts))])


def test_load_balanced_chunks_follow_megatron_convention():
    assert load_balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert load_balanced_indices(12, 3, 1).tolist() == [2, 3, 8, 9]
    everything = torch.cat([load_balanced_indices(24, 3, r) for r in range(3)])
    assert sorted(everything.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="10 tokens cannot be split into 2\\*cp = 4"):
        load_balanced_indices(10, 2, 0)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        load_balanced_indices(8, 2, 2)


def test_thd_partition_splits_every_padded_sequence():
    real, padded = padded_boundaries([3, 8, 1], 4)
    assert real == [0, 3, 11, 12] and padded == [0, 4, 12, 16]
    assert thd_partition_indices(padded, 2, 0).tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    assert thd_partition_indices(padded, 2, 1).tolist() == [1, 2, 6, 7, 8, 9, 13, 14]
    with pytest.raises(ValueError, match="packed sequence 1 has padded length 6"):
        thd_partition_indices([0, 4, 10], 2, 0)


def test_causal_mask_uses_global_positions_of_gathered_keys():
    for rank in range(2):
        mask = load_balanced_causal_mask(8, 2, rank)[0, 0]
        queries = load_balanced_indices(8, 2, rank)
        keys = torch.cat([load_balanced_indices(8, 2, r) for r in range(2)])
        assert mask.shape == (4, 8)
        for i, q in enumerate(queries.tolist()):
            for j, k in enumerate(keys.tolist()):
                assert bool(mask[i, j]) == (k > q)


def _check_shares(batch, plans_by_cp_rank, fulls):
    """The CP shares of every micro-batch hold each response token exactly once, with the right
    label, advantage and position in the local row."""
    for m, full in enumerate(fulls):
        shares = [p.micro_batches[m] for p in plans_by_cp_rank]
        seen = {i: [] for i in full.seq_ids}
        for share in shares:
            assert share.tokens.shape[1] * 2 == full.tokens.shape[1]
            assert share.seq_ids == full.seq_ids
            assert torch.equal(share.seq_token_counts(),
                               torch.bincount(full.seq_index, minlength=full.num_seqs))
            labels = share.labels.reshape(-1)[share.response_positions]
            for tok, (local, idx, label, old) in enumerate(zip(
                    share.seq_index.tolist(), share.response_token_index().tolist(),
                    labels.tolist(), share.extras["old_logprobs"].tolist())):
                i = full.seq_ids[local]
                prompt = batch.prompt_lens[i]
                assert label == int(batch.token_ids[i][prompt + idx]), (m, tok)
                assert old == float(batch.old_logprobs[i][idx])
                seen[i].append(idx)
        for i, idx in seen.items():
            assert sorted(idx) == list(range(batch.response_len(i))), i


def test_rows_layout_shares_cover_every_response_token_once():
    batch = _batch([7, 12, 9, 15, 5], [3, 4, 3, 5, 2])
    full = plan_step(batch, 0, 1, max_tokens=40, pad_multiple=4, layout="rows")
    plans = [plan_step(batch, 0, 1, max_tokens=40, pad_multiple=4, layout="rows", cp_size=2,
                       cp_rank=r) for r in range(2)]
    assert full.padded_len == plans[0].padded_len == 16  # full length: Megatron divides by CP
    _check_shares(batch, plans, full.micro_batches)
    share = plans[1].micro_batches[0]
    cols = load_balanced_indices(16, 2, 1)
    assert torch.equal(share.tokens, full.micro_batches[0].tokens[:, cols])
    assert torch.equal(share.causal_block_mask(), load_balanced_causal_mask(16, 2, 1))
    with pytest.raises(ValueError, match="pad_multiple=2 must be a multiple of 2\\*cp = 4"):
        plan_step(batch, 0, 1, max_tokens=40, pad_multiple=2, layout="rows", cp_size=2)


def test_packed_layout_pads_each_sequence_and_shares_per_sequence():
    batch = _batch([7, 12, 9, 5], [3, 4, 3, 2])
    kwargs = dict(max_tokens=24, pad_multiple=4, layout="packed", cp_size=2)
    plans = [plan_step(batch, 0, 1, cp_rank=r, **kwargs) for r in range(2)]
    mb = build_micro_batch(batch, plans[0].micro_batches[0].seq_ids, plans[0].padded_len,
                           seq_multiple=4)
    padded = mb.cu_seqlens_padded.tolist()
    assert all((b - a) % 4 == 0 for a, b in zip(padded, padded[1:]))
    lengths = [batch.seq_len(i) for i in mb.seq_ids]
    assert (torch.diff(mb.cu_seqlens)[:len(lengths)].tolist() == lengths)
    fulls = [build_micro_batch(batch, m.seq_ids, plans[0].padded_len, seq_multiple=4)
             for m in plans[0].micro_batches]
    assert len(fulls) >= 2 and plans[0].padded_len % 4 == 0
    _check_shares(batch, plans, fulls)
    share = plans[0].micro_batches[0]
    params = packed_seq_params(share)  # global boundaries: TE splits each sequence itself
    assert params.cu_seqlens_q_padded.tolist() == share.cu_seqlens_padded.tolist()
    assert params.cu_seqlens_q.tolist() == share.cu_seqlens.tolist()
    assert params.max_seqlen_q == max(b - a for a, b in zip(share.cu_seqlens_padded.tolist(),
                                                            share.cu_seqlens_padded.tolist()[1:]))
    cols = thd_partition_indices(share.cu_seqlens_padded.tolist(), 2, 0)
    assert torch.equal(share.tokens, fulls[0].tokens[:, cols])
    with pytest.raises(ValueError, match="need Transformer Engine's THD attention"):
        share.causal_block_mask()
