"""The real-server helper's start-up: a server whose HTTP port turned out taken is stopped at once
with a message naming the port, not polled until the 240 s start-up deadline (SGLang 0.5.23 logs
the bind failure and lives on: fresh clone 14 waited 3.5 minutes so). The server is a stand-in
process that logs what SGLang logs; ``test_rollout_sglang_launcher.py`` shows the real one does."""

from __future__ import annotations

import sys
import time

import pytest

from gspo_megatron.rollout.sglang.engine import BIND_FAILURE
from tests.real_sglang import RealServer


def _server_that_logs(tmp_path, line: str) -> RealServer:
    server = RealServer(str(tmp_path / "model"), tmp_path / "server.log")
    server.command = [sys.executable, "-c",
                      f"import time; print({line!r}, flush=True); time.sleep(300)"]
    return server


def test_a_server_that_cannot_listen_is_stopped_at_once_naming_its_port(tmp_path):
    server = _server_that_logs(tmp_path, f"ERROR:    [Errno 98] {BIND_FAILURE} "
                                         "('127.0.0.1', 4242): address already in use")
    started = time.monotonic()
    with pytest.raises(AssertionError, match=rf"could not listen on 127.0.0.1:{server.port}"):
        server.launch().wait_ready()
    assert time.monotonic() - started < 30
    assert server.process is None  # stopped, its group killed


def test_only_this_launchs_lines_count(tmp_path):
    """The log is appended to: a failure an earlier launch logged is not this launch's."""
    (tmp_path / "server.log").write_text(f"an earlier start: {BIND_FAILURE}\n")
    server = _server_that_logs(tmp_path, "starting")
    server.launch()
    try:
        time.sleep(1.0)
        assert server.alive() and not server._failed_to_bind()
    finally:
        server.stop(grace_s=0)
