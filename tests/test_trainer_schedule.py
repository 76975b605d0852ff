"""``trainer/schedule``: the loop's schedule is the one of its ``rollout.max_staleness`` (one file
per k), and each syncs the weights where its k says, around the update."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gspo_megatron.config.load import load_config
from gspo_megatron.trainer.schedule import schedule_for
from gspo_megatron.trainer.schedule.base import RolloutSchedule
from gspo_megatron.trainer.schedule.k_stale import AsyncRollouts
from gspo_megatron.trainer.schedule.on_policy import OnPolicyRollouts
from gspo_megatron.trainer.schedule.one_step import OneStepRollouts
from tests.test_trainer_schedule_stepwise import (FakeLearner, FakeSampler, _prepare_with,
                                                  _rollout)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("overrides, kind", [
    ([], OnPolicyRollouts),
    (["rollout.max_staleness=1"], OneStepRollouts),
    (["rollout.overlap_one_step=true"], OneStepRollouts),
    (["rollout.max_staleness=3", "rollout.engine=reference", "rollout.mode=disaggregated",
      "algo.old_logprob_source=learner"], AsyncRollouts)])
def test_the_schedule_is_the_one_of_its_k(overrides, kind, tmp_path):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml",
                      [f"logging.run_dir={tmp_path}", *overrides])
    schedule = schedule_for(cfg, None, FakeSampler(), None, None, FakeLearner(),
                            produce=_rollout, prepare=_prepare_with(FakeLearner()),
                            sync_weights=dict, is_main=False, world_size=1)
    assert type(schedule) is kind and isinstance(schedule, RolloutSchedule)
    assert schedule.max_staleness == {OnPolicyRollouts: 0, OneStepRollouts: 1,
                                      AsyncRollouts: 3}[kind]
    schedule.close()


def test_k_stale_syncs_after_the_update_and_counts_lags_from_it():
    """After step s's update: the sync, then the version it put on the engine belongs to s
    (a lag counted from a sync the schedule did not record would raise)."""
    learner = FakeLearner()
    syncs = []
    cfg = SimpleNamespace(rollout=SimpleNamespace(max_staleness=2), logging=None)
    schedule = AsyncRollouts(cfg, None, FakeSampler(), None, None, None, learner,
                             is_main=False, world_size=1,
                             sync_weights=lambda: syncs.append(learner.step) or {"s": 1.0})
    schedule.submit(1, trained_steps=0)
    learner.step = 4  # step 1's updates
    assert schedule.after_update(1) == {"s": 1.0} and syncs == [4]
    assert schedule.lag_of(4) == 0 and schedule.lag_of(0) == 1
    with pytest.raises(RuntimeError, match="never synced"):
        schedule.lag_of(2)


def test_each_step_schedule_syncs_where_its_k_says():
    """k = 0 syncs after the update and submits nothing ahead; k = 1 syncs when a rollout is
    taken and submits the next step (none past the run's last), and syncs nothing after the
    update. A k = 1 that synced after the update too would hand the next rollout newer
    weights than it was submitted under."""
    syncs = []

    def sync():
        syncs.append(len(syncs))
        return {"time/weight_sync_s": 0.0}

    on = OnPolicyRollouts(_rollout, _prepare_with(FakeLearner()), FakeLearner(), FakeSampler(),
                          is_main=True, world_size=1, learner_logprobs=False, sync_weights=sync,
                          last_step=2)
    on.submit(1, trained_steps=0)
    on.take(1)
    assert on.after_take(1, trained_steps=0) == {} and syncs == [] and not on.has(2)
    assert on.after_update(1) == {"time/weight_sync_s": 0.0} and syncs == [0]
    assert on.max_staleness == 0

    syncs.clear()
    one = OneStepRollouts(_rollout, _prepare_with(FakeLearner()), FakeLearner(), FakeSampler(),
                          is_main=True, world_size=1, learner_logprobs=False, sync_weights=sync,
                          last_step=2)
    one.submit(1, trained_steps=0)
    one.take(1)
    assert one.after_take(1, trained_steps=0) == {"time/weight_sync_s": 0.0} and syncs == [0]
    assert one.has(2)  # step 2 is generating while step 1 trains
    assert one.after_update(1) == {} and syncs == [0]
    one.take(2)
    assert one.after_take(2, trained_steps=1) == {} and not one.has(3)  # the last step
    assert one.max_staleness == 1
    one.close()
