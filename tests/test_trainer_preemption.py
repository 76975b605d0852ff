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


def test_a_second_signal_ends_a_process_blocked_in_a_call_at_once(tmp_path):
    """The first SIGTERM waits for the step's end; a second one unwinds a process that is blocked
    (here in a socket read with no data, as in a call to a wedged server), running its
    ``finally`` blocks, and exits 124 with a message."""
    import subprocess
    import sys
    import time

    marker = tmp_path / "cleaned"
    code = f"""
import socket, sys
from gspo_megatron.trainer.preemption import PreemptionFlag
flag = PreemptionFlag()
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
                            env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
                                os.path.abspath(__file__)))))
    assert proc.stdout.readline().strip() == "blocked"
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None  # the first signal only asks for the end of the step
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == REQUEUE_EXIT_CODE
    assert marker.read_text() == "yes"
    assert "received SIGTERM again: stopping now" in proc.stderr.read()
