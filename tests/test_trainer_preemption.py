"""The preemption flag: a signal only sets it; during start-up it means "exit 124 now"."""

from __future__ import annotations

import logging
import os
import signal

from gspo_megatron.trainer.preemption import REQUEUE_EXIT_CODE, PreemptionFlag


def test_signal_sets_the_flag_and_start_up_exits_for_requeue(caplog):
    old = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        flag = PreemptionFlag()
        assert flag.exit_code_if_requested("loading the config") is None
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered before kill() returns (same thread)
        assert flag.requested and flag.signal_name == "SIGUSR1"
        with caplog.at_level(logging.WARNING):
            assert flag.exit_code_if_requested("loading the config") == REQUEUE_EXIT_CODE
        assert "SIGUSR1 arrived during start-up (loading the config)" in caplog.text
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
