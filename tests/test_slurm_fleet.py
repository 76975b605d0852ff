"""slurm/fleet.sh: a rollout server that dies or hangs while the learner runs is restarted, within
its budget, and the job goes on; every way that cannot go on ends the job naming the server.

The production job (slurm/gspo_30b.sh) runs here on four fake nodes with the stand-ins of
tests/test_slurm_scripts.py: a fake ``srun`` whose server steps die or hang on cue (counted over
each server's starts), a fake ``curl`` that answers a server's probe while its step is alive and
not hung, and a learner step that runs FAKE_LEARNER_S seconds. tests/test_slurm_infra.py kills
and stops real processes of a job under a real Slurm.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import List

import pytest

from tests.test_slurm_scripts import run_gpu_job

# probe every second, restart at once: the fleet's timers at the scale of these tests
FAST = dict(GSPO_FLEET_PROBE_S="1", GSPO_SERVER_RESTART_DELAY_S="0", GSPO_FLEET_PROBE_MAX_S="2")


def events(tmp_path: Path) -> List[dict]:
    path = tmp_path / "run" / "fleet_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def server_steps(calls: List[dict], name: str) -> List[dict]:
    return [c for c in calls if f"--job-name={name}" in c["argv"]]


def assert_nothing_left(calls: List[dict]) -> None:
    for call in calls:
        with pytest.raises(ProcessLookupError):
            os.kill(call["pid"], 0)


def test_a_server_that_dies_is_restarted_on_its_node_and_the_job_finishes(tmp_path):
    proc, calls = run_gpu_job(tmp_path, FAKE_DIE_server1="3:1", FAKE_LEARNER_S="8", **FAST)
    assert proc.returncode == 0, proc.stderr
    first, second = server_steps(calls, "server1")
    assert first["argv"] == second["argv"] and "--nodelist=n3" in second["argv"]  # same node, port, log
    assert len(server_steps(calls, "server0")) == 1 and len(server_steps(calls, "server3")) == 1
    log = proc.stderr
    assert "rollout server server1 (10.0.0.3:30001 on n3) is down: exited with code 3" in log
    assert "restarting rollout server server1 (10.0.0.3:30001 on n3) (1 of 3 restart(s) within the hour used)" in log
    assert re.search(r"server1 \(10.0.0.3:30001 on n3\) is healthy again, \d+ s after it went down", log)
    assert "job done" in log
    seen = [(e["server"], e["event"], e["code"]) for e in events(tmp_path)]
    assert seen == [("server1", "down", 3), ("server1", "restarted", None), ("server1", "healthy", None)]
    healthy = events(tmp_path)[-1]
    assert healthy["down_s"] >= 0 and healthy["restarts_last_hour"] == 1 and healthy["job"] == "9"
    server_log = (tmp_path / "run/logs/9/server1.r0.log").read_text()
    assert "restarting server1 after: exited with code 3" in server_log
    assert_nothing_left(calls)


def test_with_no_restart_budget_a_death_ends_the_job_naming_the_server_and_its_log(tmp_path):
    proc, calls = run_gpu_job(tmp_path, "rollout.sglang.restarts_per_hour=0", FAKE_DIE_server2="3:1",
                              FAKE_LEARNER_S="30", **FAST)
    assert proc.returncode == 3
    assert ("FAILED (exit code 3): rollout server server2 (10.0.0.4:30000 on n4): exited with code 3 while the "
            "main step was running (rollout.sglang.restarts_per_hour=0: a server is not restarted); log: "
            f"{tmp_path}/run/logs/9/server2.r0.log") in proc.stderr
    assert len(server_steps(calls, "server2")) == 1
    assert_nothing_left(calls)  # the learner and the other servers were stopped


def test_a_server_that_keeps_dying_spends_its_budget_and_ends_the_job(tmp_path):
    proc, calls = run_gpu_job(tmp_path, "rollout.sglang.restarts_per_hour=2",
                              FAKE_DIE_server0="3:1,5:0,6:0", FAKE_LEARNER_S="30", **FAST)
    assert proc.returncode == 6, proc.stderr
    assert len(server_steps(calls, "server0")) == 3  # the first start and two restarts
    # the second and third deaths happened before the restarted server was ever healthy
    assert "is down: exited with code 5 during its start-up after a restart" in proc.stderr
    assert ("rollout server server0 (10.0.0.3:30000 on n3): exited with code 6 during its start-up after a "
            "restart, after 2 restart(s) within the last hour (rollout.sglang.restarts_per_hour=2): not "
            "restarted again; log: ") in proc.stderr
    assert [e["event"] for e in events(tmp_path)] == ["down", "restarted", "down", "restarted", "down", "gave_up"]
    assert_nothing_left(calls)


@pytest.mark.parametrize("paused", [False, True])
def test_a_hung_server_is_killed_and_restarted_unless_the_learner_holds_the_fleet_paused(tmp_path, paused):
    """The hung fake ignores SIGTERM (as a SIGSTOPped process does) and stops answering its probe;
    with the learner's pause file present (a weight sync or a memory release of ours) the same
    silence is expected and nothing is killed."""
    if paused:
        (tmp_path / "run/logs/9").mkdir(parents=True)
        (tmp_path / "run/logs/9/fleet_paused.r0").write_text("1\n")
    t0 = time.monotonic()
    proc, calls = run_gpu_job(tmp_path, "rollout.sglang.hang_timeout_s=3", FAKE_HANG_server3="1",
                              FAKE_LEARNER_S="12", **FAST)
    assert proc.returncode == 0, proc.stderr
    if paused:
        assert events(tmp_path) == [] and len(server_steps(calls, "server3")) == 1
    else:
        down = events(tmp_path)[0]
        assert (down["server"], down["event"], down["code"]) == ("server3", "down", 0)
        assert re.fullmatch(r"hung: /health_generate not answered 200 for [3-9] s "
                            r"\(rollout.sglang.hang_timeout_s=3; last answer: HTTP 000\)", down["reason"])
        assert [e["event"] for e in events(tmp_path)] == ["down", "restarted", "healthy"]
        assert len(server_steps(calls, "server3")) == 2
    assert time.monotonic() - t0 < 60
    assert_nothing_left(calls)


def test_the_learner_failing_while_every_server_is_down_requeues_the_job(tmp_path):
    """A rollout node lost: every server dies at once, the learner fails for want of servers;
    the job is requeued to resume from its last checkpoint (the fake scontrol refuses the
    requeue, so the job then fails saying so, with the requeue's exit code)."""
    dies = {f"FAKE_DIE_server{i}": "9:1" for i in range(4)}
    proc, calls = run_gpu_job(tmp_path, FAKE_LEARNER_S="4", FAKE_LEARNER_EXIT="1", **dies,
                              **{**FAST, "GSPO_SERVER_RESTART_DELAY_S": "60"})
    assert proc.returncode == 124, proc.stderr
    assert re.search(r"main step 'learner' exited with code 1 while every rollout server was down \(server0: "
                     r"exited with code 9 .*server3: exited with code 9\); the job resumes from its last "
                     r"checkpoint; requeueing job 9", proc.stderr), proc.stderr
    assert "'scontrol requeue 9' failed" in proc.stderr
    assert_nothing_left(calls)


def test_a_learner_that_stops_while_a_server_restarts_leaves_no_server_behind(tmp_path):
    """The learner checkpoints for a requeue (exit 124) while server1's restarted step is still
    starting: the job stops that step with the others."""
    proc, calls = run_gpu_job(tmp_path, FAKE_DIE_server1="3:1", FAKE_LEARNER_S="2.5", FAKE_LEARNER_EXIT="124",
                              **FAST)
    assert "learner checkpointed; requeueing job 9" in proc.stderr, proc.stderr
    assert len(server_steps(calls, "server1")) == 2
    assert_nothing_left(calls)


def test_sixteen_servers_lose_two_and_get_both_back(tmp_path):
    """The fleet at a production size: 16 servers of TP 4 on 8 rollout nodes, 2 learner nodes."""
    nodes = [f"n{i}" for i in range(1, 11)]
    urls = {f"FAKE_URL_{30000 + i % 2}_{3 + i // 2}": f"server{i}" for i in range(16)}
    proc, calls = run_gpu_job(tmp_path, "rollout.sglang.num_servers=16", SLURM_JOB_NODELIST="n[1-10]",
                              FAKE_NODES=" ".join(nodes), FAKE_DIE_server5="3:1", FAKE_DIE_server12="4:1.5",
                              FAKE_LEARNER_S="10", **urls, **FAST)
    assert proc.returncode == 0, proc.stderr
    assert sorted(c["argv"][-1] for c in calls if "rollout_server.sh" in c["argv"][-2]) == sorted(
        [f"server{i}" for i in range(16)] + ["server5", "server12"])
    by_server = {}
    for e in events(tmp_path):
        by_server.setdefault(e["server"], []).append(e["event"])
    assert by_server == {"server5": ["down", "restarted", "healthy"], "server12": ["down", "restarted", "healthy"]}
    assert "--nodelist=n9" in server_steps(calls, "server12")[1]["argv"]
    assert "--nodelist=n5" in server_steps(calls, "server5")[1]["argv"]
    assert_nothing_left(calls)
