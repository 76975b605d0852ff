"""Laying packed micro-batches out (packed and rows layouts), attention metadata, and the CP rank's
view of a micro-batch (tokens, labels, response positions, full counts, token order)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gspo_megatron.distributed.context_parallel import (load_balanced_causal_mask,
                                                        load_balanced_indices,
                                                        thd_partition_indices)
from gspo_megatron.learner.batch import SequenceBatch, build_micro_batch, plan_step
from gspo_megatron.learner.forward import MASKED_LOGIT, mask_padded_vocab, packed_seq_params


def _batch(lengths, prompt=2):
    tokens = [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lengths)]
    return SequenceBatch(token_ids=tokens, prompt_lens=[prompt] * len(lengths),
                         advantages=[float(i) for i in range(len(lengths))],
                         old_logprobs=[torch.full((n - prompt,), -float(i)) for i, n in
                                       enumerate(lengths)])


def test_micro_batch_layout_positions_labels_and_mask():
    batch = _batch([4, 3])
    mb = build_micro_batch(batch, [0, 1], padded_len=10)
    assert mb.tokens.tolist() == [[0, 1, 2, 3, 10, 11, 12, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]
    assert mb.cu_seqlens.tolist() == [0, 4, 7, 10]
    # Response tokens 2,3 (seq 0) and 12 (seq 1) are predicted from positions 1,2 and 5.
    assert mb.response_positions.tolist() == [1, 2, 5]
    assert mb.labels[0, mb.response_positions].tolist() == [2, 3, 12]
    assert mb.seq_index.tolist() == [0, 0, 1]
    assert mb.extras["advantages"].tolist() == [0.0, 0.0, 1.0]
    assert mb.extras["old_logprobs"].tolist() == [0.0, 0.0, -1.0]
    mask = mb.causal_block_mask()[0, 0]
    assert mask.shape == (10, 10)
    assert not mask[5, 4] and not mask[6, 4] and mask[4, 5]  # causal inside sequence 1
    assert mask[4, 3] and mask[7, 6]  # no attention across sequences or into padding


def test_plan_gives_every_rank_the_same_shapes_and_covers_the_batch():
    batch = _batch([7, 12, 9, 15, 5, 11, 3])
    plans = [plan_step(batch, r, 2, max_tokens=20, pad_multiple=4) for r in range(2)]
    assert plans[0].padded_len == plans[1].padded_len and plans[0].padded_len % 4 == 0
    assert len(plans[0].micro_batches) == len(plans[1].micro_batches)
    covered = sorted(i for p in plans for mb in p.micro_batches for i in mb.seq_ids)
    assert covered == list(range(7))
    assert plans[0].global_num_seqs == 7
    assert plans[0].global_num_tokens == sum(n - 2 for n in [7, 12, 9, 15, 5, 11, 3])
    with pytest.raises(ValueError, match="cannot feed 8 data-parallel ranks"):
        plan_step(batch, 0, 8, max_tokens=20)
    rounded = plan_step(batch, 0, 2, max_tokens=20, num_micro_multiple=4)
    assert len(rounded.micro_batches) % 4 == 0
    assert any(mb.num_seqs == 0 for mb in rounded.micro_batches)


def test_bad_batches_name_the_sequence():
    with pytest.raises(ValueError, match="sequence 1 has prompt_len 3 and length 3"):
        SequenceBatch(token_ids=[[1, 2, 3], [4, 5, 6]], prompt_lens=[1, 3])
    with pytest.raises(ValueError, match=r"old_logprobs\[0\]: 1 values for 2 response tokens"):
        SequenceBatch(token_ids=[[1, 2, 3]], prompt_lens=[1], old_logprobs=[torch.zeros(1)])
    with pytest.raises(ValueError, match=r"advantages\[0\]: 3 values for 2"):
        build_micro_batch(SequenceBatch(token_ids=[[1, 2, 3]], prompt_lens=[1],
                                        advantages=[[1.0, 2.0, 3.0]]), [0], 4)


def test_packed_sequence_metadata_for_transformer_engine():
    mb = build_micro_batch(_batch([4, 3]), [0, 1], padded_len=8)
    params = packed_seq_params(mb)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 4, 7, 8] and params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == 4 and params.cu_seqlens_kv is params.cu_seqlens_q


def test_padded_vocabulary_columns_are_masked_per_tp_slice():
    logits = torch.zeros(3, 8)
    assert torch.equal(mask_padded_vocab(logits, vocab_size=16, tp_rank=1), logits)
    rank1 = mask_padded_vocab(logits, vocab_size=13, tp_rank=1)  # ids 8..15, 13.. padded
    assert (rank1[:, 5:] == MASKED_LOGIT).all() and (rank1[:, :5] == 0).all()
    assert (mask_padded_vocab(logits, vocab_size=6, tp_rank=1) == MASKED_LOGIT).all()


def test_rows_layout_one_sequence_per_row_with_a_causal_mask():
    batch = _batch([4, 3, 6, 3])
    plans = [plan_step(batch, r, 2, max_tokens=13, pad_multiple=4, layout="rows")
             for r in range(2)]
    assert all(p.padded_len == 8 and p.rows_per_micro_batch == 1 for p in plans)  # 13 // 8
    assert len(plans[0].micro_batches) == len(plans[1].micro_batches) == 2
    assert sorted(i for p in plans for mb in p.micro_batches for i in mb.seq_ids) == [0, 1, 2, 3]
    wide = plan_step(batch, 0, 1, max_tokens=100, layout="rows")
    mb = wide.micro_batches[0]
    assert wide.rows_per_micro_batch == 4 and mb.tokens.shape == (4, 6) and mb.layout == "rows"
    assert mb.tokens[1].tolist() == [10, 11, 12, 0, 0, 0]
    assert mb.position_ids[1].tolist() == list(range(6))
    # response tokens of row 1 (sequence 1: 12) are predicted from flat position 6 + 1
    flat_labels = mb.labels.reshape(-1)
    expected = [t for i, n in enumerate([4, 3, 6, 3]) for t in batch.token_ids[i][2:n]]
    assert flat_labels[mb.response_positions].tolist() == expected
    assert mb.seq_index.tolist() == [0, 0, 1, 2, 2, 2, 2, 3]
    assert mb.extras["old_logprobs"].tolist() == [0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -2.0, -3.0]
    mask = mb.causal_block_mask()
    assert mask.shape == (1, 1, 6, 6) and torch.equal(mask[0, 0], torch.ones(6, 6).triu(1).bool())
    with pytest.raises(ValueError, match="sequence 2 has 6 tokens.*max_tokens_per_micro_batch=5"):
        plan_step(batch, 0, 1, max_tokens=5, layout="rows")
    with pytest.raises(ValueError, match="unknown micro-batch layout 'thd'"):
        plan_step(batch, 0, 1, max_tokens=5, layout="thd")


# ---- context parallelism: a CP rank's share of a micro-batch ----------------------------

def _cp_batch(lengths, prompts):
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(1, 50, (n,), generator=gen) for n in lengths]
    return SequenceBatch(token_ids=tokens, prompt_lens=list(prompts),
                         advantages=[float(i) for i in range(len(lengths))],
                         old_logprobs=[-torch.arange(n - p, dtype=torch.float32) - i
                                       for i, (n, p) in enumerate(zip(lengths, prompts))])


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
    batch = _cp_batch([7, 12, 9, 15, 5], [3, 4, 3, 5, 2])
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
    batch = _cp_batch([7, 12, 9, 5], [3, 4, 3, 2])
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


def test_token_lags_travel_as_int64_in_every_layout_and_cp_share():
    """Each response token keeps its own lag (asynchronous rollouts: PolicyLossInputs.token_lag),
    packed, in rows and in both CP ranks' shares, next to its old log-prob."""
    batch = _cp_batch([7, 12, 9, 5], [3, 4, 3, 2])
    lags = [torch.arange(batch.response_len(i)) % 3 + 10 * i for i in range(len(batch))]
    batch = replace(batch, token_lags=[t.tolist() if i % 2 else t for i, t in enumerate(lags)])
    expected = {(i, k): (int(lags[i][k]), float(batch.old_logprobs[i][k]))
                for i in range(len(batch)) for k in range(batch.response_len(i))}
    for layout, cp_size in (("packed", 1), ("rows", 1), ("packed", 2), ("rows", 2)):
        seen = {}
        for cp_rank in range(cp_size):
            plan = plan_step(batch, 0, 1, max_tokens=24, pad_multiple=4, layout=layout,
                             cp_size=cp_size, cp_rank=cp_rank)
            for mb in plan.micro_batches:
                got = mb.extras["token_lags"]
                assert got.dtype == torch.int64 and got.shape == mb.seq_index.shape
                for local, idx, lag, old in zip(mb.seq_index.tolist(),
                                                mb.response_token_index().tolist(), got.tolist(),
                                                mb.extras["old_logprobs"].tolist()):
                    seen[(mb.seq_ids[local], idx)] = (lag, old)
        assert seen == expected, (layout, cp_size)
    with pytest.raises(ValueError, match=r"token_lags\[0\]: 3 values for 2 response tokens"):
        SequenceBatch(token_ids=[[1, 2, 3]], prompt_lens=[1], token_lags=[[0, 0, 1]])
