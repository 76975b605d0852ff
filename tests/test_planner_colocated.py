"""planner/colocated.py: the phases of a GPU shared by a learner rank and a server, in the
trainer's order, and the largest static pool that fits beside the learner's resident state."""

from __future__ import annotations

import pytest

from gspo_megatron.planner.colocated import colocated_phases, max_mem_fraction_static
from gspo_megatron.planner.hardware import GB, Hardware
from gspo_megatron.planner.learner_memory import LearnerEstimate, Term
from gspo_megatron.planner.rollout_memory import RolloutEstimate

HW = Hardware(gpu_memory_bytes=80 * GB, reserved_bytes=4 * GB)


def _learner(resident, peak):
    est = LearnerEstimate(stage=0, terms=[Term("weights", resident)], peak_bytes=peak,
                          peak_moment="training")
    est.resident_bytes = resident
    return est


def test_phases_follow_the_trainer_order_and_add_the_right_terms():
    rollout = RolloutEstimate(weights_bytes=15 * GB, kv_cache_bytes=30 * GB, kv_bytes_per_token=1.0,
                              max_tokens=10, max_sequences=1, seq_len=10)
    start, learner, sync, generation = colocated_phases(_learner(40 * GB, 55 * GB), rollout, HW, GB)
    assert start.total_bytes == 45 * GB and learner.total_bytes == 55 * GB  # never together
    assert sync.total_bytes == (40 + 15 + 1) * GB  # resident + server weights + one bucket
    assert generation.total_bytes == (40 + 45) * GB  # resident + the whole static pool
    assert [p.name.split()[0] for p in (start, learner, sync, generation)] == \
        ["start:", "learner:", "weight", "generation"]


def test_a_pool_that_holds_no_kv_cache_counts_only_its_weights():
    rollout = RolloutEstimate(weights_bytes=15 * GB, kv_cache_bytes=-5 * GB, kv_bytes_per_token=1.0,
                              max_tokens=0, max_sequences=0, seq_len=10)
    assert colocated_phases(_learner(10 * GB, 20 * GB), rollout, HW, 0)[-1].total_bytes == 25 * GB


@pytest.mark.parametrize("resident_gb, expected", [(0, 1.0), (38, 0.5), (76, 0.0), (80, -4 / 76)])
def test_largest_mem_fraction_static_beside_the_resident_state(resident_gb, expected):
    assert max_mem_fraction_static(_learner(resident_gb * GB, 0), HW) == pytest.approx(expected)
