"""Context-parallel index math: load-balanced chunks, THD per-sequence chunks, the causal mask of
gathered keys, and each response token's index inside its response."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.distributed.context_parallel import (load_balanced_causal_mask,
                                                        load_balanced_indices, padded_boundaries,
                                                        response_token_index,
                                                        thd_partition_indices)


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


def test_response_token_index_counts_within_each_sequence():
    seq_index = torch.tensor([0, 0, 0, 1, 2, 2])
    assert response_token_index(seq_index, 4).tolist() == [0, 1, 2, 0, 0, 1]
