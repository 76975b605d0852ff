"""The deadline rule on its own: measured times, phases and the three answers."""

from __future__ import annotations

import pytest

from gspo_megatron.trainer.deadline import (ABANDON, BETWEEN, CONTINUE, GENERATING, GIVE_UP,
                                            SAFETY, SAVING, UPDATING, DeadlineFileError,
                                            StepTimes, decide, read_exit_by, save_prior_s)


def times(generate=None, update=None, save=None, prior=0.0) -> StepTimes:
    t = StepTimes(save_prior_s=prior)
    for kind, value in (("generate", generate), ("update", update), ("save", save)):
        if value is not None:
            t.observe(kind, value)
    return t


def test_estimates_are_the_longest_recent_time_with_a_margin_and_the_prior_before_a_save():
    t = times(prior=40.0)
    assert t.estimate("save") == 40.0 * SAFETY and t.estimate("update") is None
    for value in (30.0, 10.0, 20.0, 5.0, 5.0, 5.0):  # 30 is the sixth-newest: out of the window
        t.observe("update", value)
    assert t.estimate("update") == 20.0 * SAFETY
    t.observe("save", 8.0)
    assert t.estimate("save") == 8.0 * SAFETY  # measured beats the prior
    t.observe("save", float("nan"))
    assert t.estimate("save") == 8.0 * SAFETY
    with pytest.raises(ValueError, match="unknown duration kind"):
        t.observe("eval", 1.0)


@pytest.mark.parametrize("left, elapsed, expected", [
    (1000.0, 0.0, CONTINUE),   # the whole step (~125 + 62.5 s) and a save (~25 s) fit
    (150.0, 0.0, ABANDON),     # predicted rollout end 125 s; the update and save need 87.5 more
    (150.0, 90.0, CONTINUE),   # 90 s into the rollout: ~35 s to go, 62.5 + 25 after: fits
    (20.0, 90.0, GIVE_UP),     # not even the save fits
])
def test_generating(left, elapsed, expected):
    t = times(generate=100.0, update=50.0, save=20.0)
    decision = decide(1000.0, 1000.0 + left, GENERATING, elapsed, t)
    assert decision.action == expected, decision
    if expected == CONTINUE:  # checked again when the rollout must be in
        assert decision.recheck_at == pytest.approx(1000.0 + left - 50.0 * SAFETY - 20.0 * SAFETY)


def test_an_unmeasured_step_cannot_be_shown_to_fit_and_an_unknown_rollout_is_waited_for():
    assert decide(0.0, 1e6, GENERATING, 0.0, times(save=1.0)).action == ABANDON
    late = decide(0.0, 100.0, GENERATING, 0.0, times(update=10.0, save=10.0))
    assert late.action == CONTINUE and late.recheck_at == pytest.approx(100.0 - 25.0)
    # the rollout is in (elapsed inf): only the update and the save are left
    assert decide(80.0, 100.0, GENERATING, float("inf"),
                  times(generate=500.0, update=10.0, save=10.0)).action == ABANDON
    assert decide(70.0, 100.0, GENERATING, float("inf"),
                  times(generate=500.0, update=10.0, save=10.0)).action == CONTINUE


def test_updating_saving_and_between():
    t = times(generate=100.0, update=50.0, save=20.0)
    on = decide(0.0, 100.0, UPDATING, 10.0, t)
    assert on.action == CONTINUE and on.recheck_at == pytest.approx(75.0)
    assert decide(75.0, 100.0, UPDATING, 10.0, t).action == GIVE_UP  # at the recheck
    assert decide(0.0, 100.0, BETWEEN, 0.0, t).action == CONTINUE
    assert decide(80.0, 100.0, BETWEEN, 0.0, t).action == GIVE_UP
    assert decide(99.0, 100.0, SAVING, 0.0, t).action == CONTINUE  # a save under way runs on
    assert decide(100.5, 100.0, SAVING, 0.0, t).action == GIVE_UP
    with pytest.raises(ValueError, match="unknown phase"):
        decide(0.0, 1.0, "resting", 0.0, t)


def test_deadline_file(tmp_path):
    path = tmp_path / "deadline.env"
    assert read_exit_by(None) is None and read_exit_by(str(path)) is None
    path.write_text("exit_by=1765000000\njob_end=1765000060\n")
    assert read_exit_by(str(path)) == 1765000000.0
    path.write_text("job_end=1765000060\n")
    with pytest.raises(DeadlineFileError, match="deadline.env: expected a line exit_by="):
        read_exit_by(str(path))


def test_the_save_prior_counts_weights_and_adam_state_of_every_rank():
    import torch

    trained, frozen = torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16)), \
        torch.nn.Parameter(torch.zeros(500), requires_grad=False)
    # (1000 x (2 + 12) + 500 x 4) bytes x 4 ranks at 1 GB/s
    assert save_prior_s([trained, frozen], 4, 1.0) == pytest.approx(16000 * 4 / 1e9)
