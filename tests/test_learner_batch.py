"""Packing rollouts into token-budget micro-batches, the DP split, and attention metadata."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.learner.batch import (SequenceBatch, build_micro_batch, pack_by_tokens,
                                         plan_step, split_across_dp)
from gspo_megatron.learner.forward import MASKED_LOGIT, mask_padded_vocab, packed_seq_params


def _batch(lengths, prompt=2):
    tokens = [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lengths)]
    return SequenceBatch(token_ids=tokens, prompt_lens=[prompt] * len(lengths),
                         advantages=[float(i) for i in range(len(lengths))],
                         old_logprobs=[torch.full((n - prompt,), -float(i)) for i, n in
                                       enumerate(lengths)])


def test_dp_split_balances_tokens_and_is_deterministic():
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    shares = split_across_dp(lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert sorted(i for s in shares for i in s) == list(range(8))
    assert abs(loads[0] - loads[1]) <= 1
    assert shares == split_across_dp(lengths, 2)


def test_packing_respects_the_token_budget_and_refuses_too_long_sequences():
    lengths = [5, 9, 3, 7, 2, 6]
    bins = pack_by_tokens(range(6), lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert bins == [[1], [2, 3], [4, 5], [0]]  # first-fit-decreasing: 9 | 7+3 | 6+2 | 5
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens.*max_tokens_per_micro_batch=8"):
        pack_by_tokens(range(6), lengths, 8)


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
