"""rollout/fleet_events.py: the trainer's reading of the Slurm job's fleet events (slurm/fleet.sh
writes them; tests/test_slurm_fleet.py checks what it writes)."""

import json
import logging

from gspo_megatron.rollout.fleet_events import EVENTS_FILE, FleetEventLog


def line(server, event, **extra):
    return json.dumps({"time": 1.0, "server": server, "address": f"{server}:1", "event": event, **extra}) + "\n"


def test_restarts_servers_down_and_time_lost_are_counted_as_the_job_writes_them(tmp_path, caplog):
    log = FleetEventLog.for_run(str(tmp_path))
    assert log.path == str(tmp_path / EVENTS_FILE)
    assert log.metrics() == {"rollout/server_restarts": 0.0, "rollout/servers_down": 0.0,
                             "rollout/server_down_s": 0.0}  # no file yet
    path = tmp_path / EVENTS_FILE
    path.write_text(line("server1", "down", code=137, reason="exited with code 137")
                    + line("server1", "restarted", restarts_last_hour=1))
    with caplog.at_level(logging.INFO):
        assert log.metrics() == {"rollout/server_restarts": 1.0, "rollout/servers_down": 1.0,
                                 "rollout/server_down_s": 0.0}
    assert "rollout server server1 (server1:1) went down: exited with code 137" in caplog.text
    with path.open("a") as f:  # the job is still writing its next line: it waits for the newline
        f.write(line("server1", "healthy", down_s=41).rstrip("\n"))
    assert log.metrics()["rollout/servers_down"] == 1.0
    with path.open("a") as f:
        f.write("\n" + line("server3", "down", reason="hung") + "{not json\n")
    with caplog.at_level(logging.WARNING):
        metrics = log.metrics()
    assert metrics == {"rollout/server_restarts": 1.0, "rollout/servers_down": 1.0, "rollout/server_down_s": 41.0}
    assert log.down == {"server3": "hung"}
    assert "unreadable line skipped" in caplog.text
    assert log.poll() == []  # everything read once


def test_no_run_directory_no_reader():
    assert FleetEventLog.for_run(None) is None
