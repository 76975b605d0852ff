"""The preemption flag: a signal asks for a checkpoint, repeats change nothing, and only the
job's deadline (the batch shell's file) cuts a step or ends the process without a checkpoint."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_megatron.trainer.deadline import GENERATING, UPDATING
from gspo_megatron.trainer.preemption import (NO_CHECKPOINT_EXIT_CODE, PROGRESS_FILE,
                                              REQUEUE_EXIT_CODE, AbandonMarker, PreemptionFlag,
                                              StepAbandoned, raise_if_abandoned)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def flag(tmp_path, monkeypatch):
    """A flag of this process with a deadline file under ``tmp_path``; handlers restored after."""
    monkeypatch.setenv("GSPO_DEADLINE_FILE", str(tmp_path / "deadline.env"))
    made = PreemptionFlag()
    made.deadline_path = tmp_path / "deadline.env"
    yield made
    made.close()


def _deadline(flag, seconds_from_now: float) -> None:
    flag.deadline_path.write_text(f"exit_by={time.time() + seconds_from_now}\njob_end=0\n")


def _measured(flag, generate=4.0, update=1.0, save=1.0) -> None:
    for kind, value in (("generate", generate), ("update", update), ("save", save)):
        flag.times.observe(kind, value)


def test_signal_sets_the_flag_and_start_up_exits_for_requeue(caplog):
    flag = PreemptionFlag()
    try:
        assert flag.exit_code_if_requested("loading the config") is None
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered before kill() returns (same thread)
        assert flag.requested and flag.signal_name == "SIGUSR1"
        with caplog.at_level(logging.WARNING):
            assert flag.exit_code_if_requested("loading the config") == REQUEUE_EXIT_CODE
        assert "SIGUSR1 arrived during start-up (loading the config)" in caplog.text
    finally:
        flag.close()
    assert signal.getsignal(signal.SIGUSR1) != flag._handle  # close() put the old one back


def test_repeated_signals_never_stop_a_run_only_the_deadline_does(tmp_path):
    """Issue 49: the batch shell repeats SIGUSR1 every minute for ranks that missed it; a rank
    that has it keeps going, blocked or not (here in a socket read, as in a call to a wedged
    server). Once the deadline file says not even a save fits, the next signal ends it at once
    with exit 125, its ``finally`` blocks run, and the log names what the resumed run redoes."""
    marker, deadline = tmp_path / "cleaned", tmp_path / "deadline.env"
    code = f"""
import socket, sys
from gspo_megatron.trainer.preemption import PreemptionFlag
flag = PreemptionFlag()
flag.acting = True
flag.progress({str(tmp_path)!r}, 7, checkpoint={str(tmp_path / "step_000005")!r})
flag.trained_step = 8
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen(1)
client = socket.create_connection(server.getsockname())
print("blocked", flush=True)
try:
    client.recv(1)  # nobody ever writes
finally:
    open({str(marker)!r}, "w").write("yes")
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO),
                                     GSPO_DEADLINE_FILE=str(deadline)))
    try:
        assert proc.stdout.readline().strip() == "blocked"
        for sig in (signal.SIGUSR1, signal.SIGUSR1, signal.SIGTERM):  # no deadline file yet
            proc.send_signal(sig)
            time.sleep(0.3)
        deadline.write_text(f"exit_by={time.time() + 3600}\n")  # a far deadline: carry on
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        assert proc.poll() is None, proc.stderr.read()
        deadline.write_text(f"exit_by={time.time() - 1}\n")  # passed: no room for a save
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=10) == NO_CHECKPOINT_EXIT_CODE
    finally:
        proc.kill()
        proc.wait()
    assert marker.read_text() == "yes"
    err = proc.stderr.read()
    assert err.count("received SIGUSR1: will checkpoint") == 1
    assert "the checkpoint asked for by SIGUSR1 stands" in err
    assert ("stopping without a checkpoint; a resumed run starts from the checkpoint of step 7 "
            "and redoes 1 step(s) (exit 125)") in err


def test_a_wait_is_abandoned_when_the_rest_of_the_step_and_a_save_do_not_fit(flag):
    flag.acting = True
    _measured(flag, generate=10.0, update=1.0, save=1.0)
    _deadline(flag, 5.0)  # 5 s left: ~12.5 s of rollout still to come does not fit
    flag.enter(GENERATING)
    with pytest.raises(StepAbandoned, match="do not fit"):
        with flag.abandonable():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(5)  # the handler raises in here
            pytest.fail("the wait was not abandoned")
    assert flag.requested and flag.last_decision.action == "abandon"


def test_a_wait_that_fits_goes_on_until_the_timer_says_the_rollout_is_late(flag):
    """The plan holds when the signal comes (the rollout is predicted in time); the flag's
    timer fires at the last moment it still would, and the rollout is not in yet: abandoned."""
    flag.acting = True
    _measured(flag, generate=0.8, update=1.0, save=1.0)
    _deadline(flag, 4.5)  # latest rollout end: 4.5 - 1.25 - 1.25 = 2.0 s from now
    flag.enter(GENERATING)
    start = time.monotonic()
    with pytest.raises(StepAbandoned):
        with flag.abandonable():
            os.kill(os.getpid(), signal.SIGUSR1)
            assert flag.last_decision.action == "continue"
            time.sleep(10)
    assert 1.5 < time.monotonic() - start < 4.0


def test_outside_a_wait_an_abandon_is_not_raised_and_no_deadline_means_finish_and_save(flag):
    flag.acting = True
    _measured(flag, generate=10.0)
    flag.enter(UPDATING)
    os.kill(os.getpid(), signal.SIGUSR1)  # no deadline file: nothing to plan with
    assert flag.requested and flag.decision() is None
    _deadline(flag, 5.0)
    flag.enter(GENERATING)  # abandon says the rule, but no wait is marked: nothing raised
    assert flag.last_decision.action == "abandon"
    flag.acting = False  # another rank: never acts
    with flag.abandonable():
        os.kill(os.getpid(), signal.SIGUSR1)


def test_the_marker_crosses_to_every_rank_and_the_progress_file_names_the_checkpoint(tmp_path):
    with pytest.raises(StepAbandoned, match="late"):
        raise_if_abandoned(AbandonMarker("late"))
    raise_if_abandoned(None)
    flag = PreemptionFlag()
    try:
        flag.progress(tmp_path, 4)
        assert (tmp_path / PROGRESS_FILE).read_text() == "trained_step=4\n"
        assert flag.redo_note() == "no checkpoint of this run yet: a resumed run redoes its 4 step(s)"
        flag.progress(tmp_path, 6, checkpoint=tmp_path / "step_000006")
        flag.progress(tmp_path, 9)
        assert (tmp_path / PROGRESS_FILE).read_text().splitlines() == [
            "trained_step=9", "checkpoint_step=6", f"checkpoint={tmp_path / 'step_000006'}"]
        assert flag.redo_note() == ("a resumed run starts from the checkpoint of step 6 and "
                                    "redoes 3 step(s)")
    finally:
        flag.close()


def test_a_malformed_deadline_file_is_named_and_the_step_finishes(flag, caplog):
    flag.acting = True
    flag.deadline_path.write_text("exit_by=soon\n")
    with caplog.at_level(logging.ERROR):
        os.kill(os.getpid(), signal.SIGUSR1)
    assert flag.requested and flag.decision() is None
    assert f"{flag.deadline_path}: expected a line exit_by=<unix seconds>" in caplog.text
