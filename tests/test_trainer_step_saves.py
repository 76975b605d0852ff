"""``trainer/step_saves.py`` on one rank: the real deadline rule (``PreemptionFlag`` reading a
deadline file as the batch shell writes it) decides; the checkpoints and the rollouts are
recorders, so each decision's effect (a save or none, a cut step, the exit code) is visible.
The loop's runs (``test_trainer_loop.py``, ``test_slurm_infra.py``) check the same paths end to
end with real saves."""

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gspo_megatron.learner.checkpoint_write import SaveReport
from gspo_megatron.trainer.deadline import BETWEEN, SAVING
from gspo_megatron.trainer.preemption import (NO_CHECKPOINT_EXIT_CODE, PROGRESS_FILE,
                                              REQUEUE_EXIT_CODE, PreemptionFlag, StepAbandoned)
from gspo_megatron.trainer.step_saves import StepSaves, any_rank


class _Checkpoints:
    """Records each save with the deadline phase it was made in."""

    def __init__(self, flag: PreemptionFlag) -> None:
        self.flag, self.saved, self.reports = flag, [], []

    def save(self, step, extra, sampler_state=None, background=False):
        self.saved.append((step, extra, sampler_state, background, self.flag._phase))
        return Path(f"/ckpt/step_{step:06d}")


class _Rollouts:
    def __init__(self) -> None:
        self.abandoned = 0

    def abandon_state(self):
        self.abandoned += 1
        return {"buffer": ["g1", "g2"]}, {"position": 7}


class _Engine:
    def __init__(self) -> None:
        self.cancelled = 0

    def cancel_generation(self) -> None:
        self.cancelled += 1


@pytest.fixture
def run(tmp_path):
    """A main rank with a real :class:`PreemptionFlag` (its handlers put back afterwards)."""
    flag = PreemptionFlag()
    flag.deadline_file = str(tmp_path / "deadline.env")
    parts = SimpleNamespace(preemption=flag, checkpoints=_Checkpoints(flag), engine=_Engine(),
                            runtime=SimpleNamespace(world_size=1, is_main=True),
                            run_dir=tmp_path)
    try:
        yield parts
    finally:
        flag.close()


def _warned(parts, seconds_left: float) -> None:
    """The batch shell's warning: a deadline ``seconds_left`` away, then the signal's flag."""
    Path(parts.preemption.deadline_file).write_text(f"exit_by={time.time() + seconds_left}\n")
    parts.preemption.requested = True


def test_any_rank_on_one_process_is_the_flag():
    assert any_rank(True, 1) is True and any_rank(False, 1) is False


def test_an_unwarned_run_never_cuts_a_step(run):
    StepSaves(run).abandon_if_late(3)  # nothing asked for: no decision, no raise
    assert run.preemption.last_decision is None


def test_a_warned_run_cuts_the_step_whose_update_and_save_do_not_fit(run):
    saves = StepSaves(run)
    run.preemption.times.observe("update", 100.0)
    run.preemption.times.observe("save", 50.0)
    _warned(run, seconds_left=1000.0)  # 1000 s > 1.25 * (100 + 50): the step goes on
    saves.abandon_if_late(3)
    _warned(run, seconds_left=150.0)  # < 1.25 * (100 + 50)
    with pytest.raises(StepAbandoned, match="no room for step 4's update and a save"):
        saves.abandon_if_late(3)


def test_a_step_is_cut_when_no_update_was_measured_yet(run):
    _warned(run, seconds_left=10_000.0)
    with pytest.raises(StepAbandoned):
        StepSaves(run).abandon_if_late(0)
    assert "no step has been measured yet" in run.preemption.last_decision.reason


def test_save_is_made_in_the_saving_phase_and_leaves_it(run):
    path = StepSaves(run).save(5, {"k": 1}, sampler_state={"s": 2}, background=True)
    assert path == Path("/ckpt/step_000005")
    assert run.checkpoints.saved == [(5, {"k": 1}, {"s": 2}, True, SAVING)]
    assert run.preemption._phase == BETWEEN


def test_a_cut_step_checkpoints_the_state_before_it_and_asks_for_the_requeue(run):
    rollouts = _Rollouts()
    _warned(run, seconds_left=10_000.0)
    code = StepSaves(run).save_abandoned(6, StepAbandoned("late"), rollouts)
    assert code == REQUEUE_EXIT_CODE
    assert run.engine.cancelled == 1 and rollouts.abandoned == 1
    assert run.checkpoints.saved == [(6, {"pending_rollout": {"buffer": ["g1", "g2"]}},
                                      {"position": 7}, False, SAVING)]


def test_a_cut_step_without_time_for_a_save_exits_without_one(run):
    run.preemption.times.observe("save", 400.0)
    _warned(run, seconds_left=100.0)  # < 1.25 * 400
    code = StepSaves(run).save_abandoned(6, StepAbandoned("late"), _Rollouts())
    assert code == NO_CHECKPOINT_EXIT_CODE
    assert run.checkpoints.saved == []


def test_done_reports_the_newest_save_feeds_the_rule_and_notes_the_progress(run):
    report = lambda d, total: SaveReport(directory=d, blocking_s=0.5, total_s=total,  # noqa: E731
                                         bytes_written=2_000_000_000,
                                         checkpoint_bytes=4_000_000_000,
                                         peak_rss_bytes=3 * 2**30)
    run.checkpoints.reports += [(2, report("/ckpt/step_000002", 30.0)),
                                (4, report("/ckpt/step_000004", 80.0))]
    run.preemption.trained_step = 4
    metrics = StepSaves(run).done()
    assert metrics == {"checkpoint/step": 4.0, "time/checkpoint_blocking_s": 0.5,
                       "time/checkpoint_s": 80.0, "checkpoint/written_gb": 2.0,
                       "checkpoint/size_gb": 4.0, "checkpoint/peak_host_gb": 3.0}
    assert run.checkpoints.reports == []
    assert run.preemption.times.estimate("save") == pytest.approx(80.0 * 1.25)
    progress = (run.run_dir / PROGRESS_FILE).read_text()
    assert "trained_step=4" in progress and "checkpoint_step=4" in progress
    assert StepSaves(run).done() == {}  # nothing new since
