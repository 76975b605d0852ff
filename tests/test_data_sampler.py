"""PromptSampler: seeded shuffling, epochs, exact resume from state_dict, query-set refresh."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.data import PromptRecord, PromptSampler


def _records(n):
    return [PromptRecord(f"p{i}", (i,), str(i), str(i)) for i in range(n)]


def _ids(batch):
    return [r.prompt_id for r in batch]


def test_same_seed_same_order_and_each_epoch_visits_all():
    a, b = PromptSampler(_records(10), seed=3), PromptSampler(_records(10), seed=3)
    first = [_ids(a.next_batch(4)) for _ in range(5)]
    assert first == [_ids(b.next_batch(4)) for _ in range(5)]
    flat = sum(first, [])
    assert sorted(flat[:10]) == sorted(f"p{i}" for i in range(10))
    assert sorted(flat[10:20]) == sorted(f"p{i}" for i in range(10))
    assert flat[:10] != flat[10:20], "epochs should be reshuffled"
    assert flat[:10] != _ids(PromptSampler(_records(10), seed=4).next_batch(10))
    assert a.stats().epoch == 1 and a.stats().num_drawn == 20  # epochs count from 0


def test_no_shuffle_keeps_file_order():
    sampler = PromptSampler(_records(3), seed=0, shuffle=False)
    assert _ids(sampler.next_batch(5)) == ["p0", "p1", "p2", "p0", "p1"]


def test_resume_from_state_dict_draws_the_same_prompts():
    reference = PromptSampler(_records(7), seed=11)
    for _ in range(3):
        reference.next_batch(3)
    reference.retire(["p1"])
    state = json.loads(json.dumps(reference.state_dict()))  # survives a JSON round trip
    expected = [_ids(reference.next_batch(3)) for _ in range(6)]

    resumed = PromptSampler(_records(7), seed=11)
    resumed.load_state_dict(state)
    assert [_ids(resumed.next_batch(3)) for _ in range(6)] == expected
    assert "p1" not in sum(expected, [])
    assert resumed.stats() == reference.stats()


def test_state_from_another_dataset_or_seed_is_rejected():
    state = PromptSampler(_records(5), seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(_records(5), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint"):
        PromptSampler(_records(6)[1:], seed=1).load_state_dict(state)


def test_retire_saturated_removes_all_solved_and_all_failed():
    sampler = PromptSampler(_records(4), seed=0, shuffle=False)
    retired = sampler.retire_saturated({"p0": [1.0, 1.0], "p1": [0.0, 1.0], "p2": [0.0, 0.0]})
    assert sorted(retired) == ["p0", "p2"]
    assert set(_ids(sampler.next_batch(6))) == {"p1", "p3"}
    stats = sampler.stats()
    assert (stats.num_retired, stats.num_retired_solved, stats.num_retired_unsolved,
            stats.num_active) == (2, 1, 1, 2)
    with pytest.raises(KeyError, match="unknown prompt id 'zz'"):
        sampler.retire(["zz"])
    sampler.retire(["p1", "p3"])
    with pytest.raises(RuntimeError, match="all 4 prompts have been retired"):
        sampler.next_batch(1)
