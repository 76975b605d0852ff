"""grid/state.py: a point's state from the scheduler (scontrol / sacct lines, faked here; the
real Slurm in tests/test_cli_grid.py) and from its run directory's batch log."""

from __future__ import annotations

import pytest

from gspo_megatron.grid import state as st

LOG_DONE = "[2026-12-05T01:00:00 gspo job 7] run dir /g/point_0\n[2026-12-05T01:01:00 gspo job 7] job done\n"
LOG_FAILED = ("[2026-12-05T01:00:00 gspo job 7] run dir /g/point_1\n"
              "[2026-12-05T01:01:00 gspo job 7] FAILED (exit code 137): the learner step failed\n"
              "[rank0]: RuntimeError: boom\n")
LOG_REQUEUED = "[t gspo job 7] SIGUSR1 received; requeueing job 7 (restart 1)\n"


def _run_dir(tmp_path, name, log=None, metrics=False, key="7_0"):
    run = tmp_path / name
    (run / "logs" / key).mkdir(parents=True)
    if log is not None:
        (run / "logs" / key / "batch.log").write_text(log)
    if metrics:
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def test_task_ids_and_exit_codes_as_slurm_prints_them():
    assert st._task_ids("3") == [3] and st._task_ids("2-3%1") == [2, 3] and st._task_ids("[0-1,4]") == [0, 1, 4]
    assert st._exit_code("0:0") == 0 and st._exit_code("2:0") == 2 and st._exit_code("0:9") == 137
    assert st._exit_code("") is None


def test_scheduler_tasks_from_scontrol_then_sacct(monkeypatch):
    outputs = {
        ("scontrol", "100"): ("JobId=101 ArrayJobId=100 ArrayTaskId=0 JobState=COMPLETED ExitCode=0:0 Restarts=0\n"
                              "JobId=102 ArrayJobId=100 ArrayTaskId=1 JobState=FAILED ExitCode=1:0 Restarts=0\n"
                              "JobId=100 ArrayJobId=100 ArrayTaskId=2-3%1 JobState=PENDING ExitCode=0:0 Restarts=0\n"),
        ("scontrol", "200"): None,  # forgotten: sacct answers
        ("sacct", "200"): "200_0|CANCELLED by 0|0:15\n200_[1-2]|PENDING|0:0\n",
    }
    monkeypatch.setattr(st, "_run", lambda cmd: outputs.get((cmd[0], cmd[-1] if cmd[0] == "scontrol" else cmd[2])))
    tasks = st.scheduler_tasks(["100", "200"])
    assert {k: (t.state, t.exit_code) for k, t in tasks.items()} == {
        "100_0": ("COMPLETED", 0), "100_1": ("FAILED", 1), "100_2": ("PENDING", 0), "100_3": ("PENDING", 0),
        "200_0": ("CANCELLED", 143), "200_1": ("PENDING", 0), "200_2": ("PENDING", 0)}


def test_log_verdicts(tmp_path):
    assert st.log_verdict(None) == (None, None, "")
    for text, expected in ((LOG_DONE, ("done", 0, "")),
                           (LOG_FAILED, ("failed", 137, "the learner step failed | [rank0]: RuntimeError: boom")),
                           (LOG_REQUEUED, ("requeued", None, ""))):
        path = tmp_path / "batch.log"
        path.write_text(text)
        assert st.log_verdict(path) == expected


@pytest.mark.parametrize("slurm, log, metrics, known, expected", [
    (st.SlurmTask("PENDING"), None, False, True, ("pending", None)),
    (st.SlurmTask("PENDING", restarts=1), LOG_REQUEUED, True, True, ("requeued", None)),
    (st.SlurmTask("RUNNING"), None, True, True, ("running", None)),
    (st.SlurmTask("COMPLETED", 0), LOG_DONE, True, True, ("done", 0)),
    (st.SlurmTask("FAILED", 1), LOG_FAILED, True, True, ("failed", 137)),
    (st.SlurmTask("CANCELLED", 143), "[t gspo job 7] run dir /g\n", True, True, ("failed", 143)),
    (None, LOG_DONE, True, False, ("done", 0)),
    (None, LOG_FAILED, True, False, ("failed", 137)),
    (None, None, True, False, ("running", None)),   # no Slurm to ask, no verdict yet
    (None, None, True, True, ("failed", None)),     # Slurm forgot a task that left no verdict
    (None, None, False, True, ("missing", None)),
])
def test_point_state_combines_scheduler_and_run_dir(tmp_path, slurm, log, metrics, known, expected):
    run = _run_dir(tmp_path, "p", log, metrics)
    got = st.point_state(run, "7_0", slurm, known)
    assert (got.state, got.exit_code) == expected
    if got.state == "failed":
        assert got.error
