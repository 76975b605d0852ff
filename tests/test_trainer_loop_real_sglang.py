"""The GSPO loop against the real SGLang 0.5.23 server on CPU, launched by the trainer itself.

``rollout.engine=sglang rollout.sglang.device=cpu`` with the server virtualenv's interpreter
(``make sglang-venv``): the trainer starts the server through our launcher (the CPU engine's
flags, the checkpoint's own dtype), generates every rollout on it, sends the learner's weights
after every update through a gloo broadcast group, and stops it at the end. With
``algo.old_logprob_source=learner`` the learner recomputes every sample's log-probs, so
``rollout/learner_vs_engine_abs_logp`` of every step says that the previous sync arrived
(2 layers of fp32: ~1e-7 when it did, ~1e-1 when the server still had older weights), and
``rollout.weight_sync.verify`` probes the server after every sync (``trainer/sync_check.py``).
The reward is ``brevity``: 20 SFT steps answer no sum, so ``tiny_addition`` gave every sample 0,
every advantage 0 and every gradient 0, and each sync after the first sent the same weights
again; the response lengths differ within a group, so the weights move at every step.

A run killed at a named point (``GSPO_TEST_KILL_AT``, ``gspo_megatron/faults/kill_points.py``)
resumes against the same live server: what it must recover, and what it repeats bit for bit, in
:func:`test_a_run_killed_at_a_named_point_resumes_against_the_same_live_server`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.distributed.ports import free_port
from tests.real_sglang import SGLANG_PYTHON, LeftState, RealServer, left_state, listening_pids

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

NUM_STEPS = 8
"""GSPO steps of each run, every one checked (its sync arrived, the probe after it, the overlap's
lag of one step). Issue 41 item 8: 20 steps checked the same things 20 times, ~10 s more a run."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from gspo_megatron.tiny_task.assets import make_tiny_assets
    from gspo_megatron.tiny_task.task import AdditionTaskConfig

    out = tmp_path_factory.mktemp("tiny_assets")
    return make_tiny_assets(out, task=AdditionTaskConfig(num_train=400, num_eval=16))


def _overrides(assets, run_dir: Path, *extra: str) -> list:
    return [f"model.hf_path={assets.model_dir}", f"data.train_path={assets.train_path}",
                 f"data.eval_path={assets.eval_path}", f"logging.run_dir={run_dir}",
                 "logging.wandb.enabled=false", "batch.num_prompts_per_step=8",
                 "rollout.n_samples_per_prompt=4", "batch.num_mini_batches=2",
                 "trainer.num_sft_steps=20", "trainer.sft_batch_size=16",
                 "trainer.eval_every_steps=0", "checkpoint.save_every_steps=0",
                 "algo.old_logprob_source=learner", "rollout.engine=sglang",
                 "rollout.mode=disaggregated", "rollout.sglang.device=cpu",
                 f"rollout.sglang.python={SGLANG_PYTHON}", "rollout.sglang.max_total_tokens=4096",
                 "rollout.sglang.health_timeout_s=240",
                 "rollout.weight_sync.transport=nccl",
                 "rollout.weight_sync.master_address=127.0.0.1",
                 "rollout.weight_sync.verify=true", "rollout.weight_sync.verify_tolerance=1e-5",
                 "reward.name=brevity", *extra]


def _rows(run_dir: Path) -> list:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _train(assets, run_dir: Path, *extra: str) -> list:
    from gspo_megatron.cli.train import main

    assert main([str(REPO / "configs" / "tiny_cpu.yaml"), *_overrides(assets, run_dir, *extra)]) == 0
    return _rows(run_dir)


@pytest.mark.parametrize("overlap", [False, True], ids=["on_policy", "overlap_one_step"])
def test_eight_steps_against_the_real_server(assets, tmp_path, overlap):
    port = free_port()
    # the overlapped run also routes by prompt: each group's prompt is prefilled once first
    rows = _train(assets, tmp_path, f"trainer.num_steps={NUM_STEPS}", f"rollout.sglang.port={port}",
                  f"rollout.overlap_one_step={str(overlap).lower()}",
                  f"rollout.sglang.routing={'prompt_affinity' if overlap else 'least_loaded'}")
    assert [r["step"] for r in rows] == list(range(NUM_STEPS + 1))
    hits = [r["rollout/prefix_cache_hit"] for r in rows[1:]]  # the real server's cached_tokens
    assert all(0.0 <= h <= 1.0 for h in hits), hits
    if overlap:
        assert min(hits) >= 0.5, hits  # every sample but a resent one finds its prompt cached
    for row in rows[1:]:
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["train/grad_norm"] > 0.0, row["step"]  # the weights move: every sync is new
        # every sample's engine log-probs equal the learner's recomputation: the weights of the
        # update that generated it arrived on the real server (fp32 on both sides)
        assert row["rollout/learner_vs_engine_abs_logp"] < 1e-5, row["step"]
    synced = rows[2:] if overlap else rows[1:]
    assert all(r["weight_sync/gb"] > 0 and r["weight_sync/num_servers"] == 1.0 for r in synced)
    # the probe after every sync: the server's log-probs of its own sample = the learner's
    assert all(r["weight_sync/probe_abs_logp"] < 1e-5 for r in synced)
    if overlap:
        assert [r["rollout/policy_lag_steps"] for r in rows[2:]] == [1.0] * (NUM_STEPS - 1)
    logs = list(tmp_path.rglob("server_127.0.0.1_*.log"))
    assert logs and "Load weight end" in logs[0].read_text()  # it was the real SGLang
    assert listening_pids(port) == []  # the trainer stopped the server it started
    # the server ran with the job's keys (issue 33): made in the run directory, mode 0600, and
    # in no file the run wrote besides that one (logs, config, metrics, checkpoints)
    key_file = tmp_path / "secrets" / "rollout_server_keys.json"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    keys = json.loads(key_file.read_text())
    assert "'api_key': '<redacted>'" in logs[0].read_text()  # set, and redacted in SGLang's log
    for path in tmp_path.rglob("*"):
        if path.is_file() and path != key_file and path.stat().st_size < 50_000_000:
            data = path.read_bytes()
            assert keys["api_key"].encode() not in data and keys["admin_api_key"].encode() not in data, path


KILL_STEP = 4
"""Every kill lands in RL step 4 of a 5-step run that checkpoints every 2 steps: the last complete
checkpoint is step 2's (holding step 3's rollout, generated one step ahead), and the dead run has
logged step 3, trained on that very rollout, before it died."""

NOT_REPEATABLE = ("time/", "memory/", "weight_sync/", "checkpoint/")
"""Row keys that differ between two runs of the same step: timings (also ``*_s``, ``*per_s*``),
memory, the sync's metrics (its timings and the post-sync probe, a fresh unseeded sample), and
the numbers of the save that finished during the step (the resumed run did not make it)."""


@pytest.fixture(scope="module", autouse=True)
def _live_server_ahead(request, assets, tmp_path_factory):
    """The kill tests' server, launched when the module starts if one of them was collected: its
    ~30 CPU-seconds of start-up overlap the eight-step runs, which mostly wait on their own
    server (as ``SpareServers`` does for the rollout tests)."""
    wanted = any("live_server" in item.fixturenames for item in request.session.items
                 if item.module is request.module)
    server = (RealServer(str(assets.model_dir), tmp_path_factory.mktemp("live") / "server.log")
              .launch() if wanted else None)
    yield server
    if server is not None:
        server.stop()


@pytest.fixture(scope="module")
def live_server(_live_server_ahead):
    """One real server for the three kill points, started by the test as a user would start
    one: each test leaves it unpaused, outside any session and holding no group, and checks
    that."""
    return _live_server_ahead.wait_ready()


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items()
            if not (k.startswith(NOT_REPEATABLE) or k.endswith("_s") or "per_s" in k)}


def _leftovers_of_the_kill(point: str, run_dir: Path, left, dead_group: str, log: str) -> None:
    """What the dead run left, as the point says it must have (so the resume has work to do)."""
    assert dead_group in left.groups, (left, dead_group)
    if point == "rollout":
        in_flight = re.search(r"answered, (\d+) requests in flight", log)
        assert in_flight and int(in_flight.group(1)) >= 1, log[-2000:]
    if point == "sync":  # paused, inside the session, some buckets of the update loaded
        assert left.paused and left.session, left
    if point == "checkpoint":  # every file but the manifest: not a checkpoint
        partial = run_dir / "checkpoints" / f"step_{KILL_STEP:06d}.partial"
        assert (partial / "gspo_meta.json").is_file() and (partial / "common.pt").is_file()
        assert not (partial / "manifest.json").exists()


@pytest.mark.parametrize("point", ["rollout", "sync", "checkpoint"])
def test_a_run_killed_at_a_named_point_resumes_against_the_same_live_server(
        assets, live_server, tmp_path, point):
    """Issue 41 item 3: ``GSPO_TEST_KILL_AT=<point>:4`` makes the trainer SIGKILL itself in step
    4 of a one-step off-policy run against an external real server (mid-rollout with requests in
    flight; mid-sync inside the weight-update session after bucket 1 of several; between the files
    of step 4's checkpoint), then ``--resume`` against the same server. Afterwards:

    - the dead run's broadcast group is gone from the server, destroyed by the resumed run's first
      sync (the run directory recorded its name); groups observed with :func:`left_state`, which
      reads SGLang's own list of them (``model_runner_components/weight_updater.py``,
      ``_model_update_group``); the resumed run's own group is gone once it closed;
    - the server is unpaused (``/ready``) and outside any weight-update session;
    - the resume fell back to step 2's checkpoint (a ``.partial`` step 4 is no checkpoint);
    - the rows of steps 0-2 are the dead run's, untouched, and step 3's is bit for bit the dead
      run's step 3 (learner losses, clip fractions, gradient norm, rewards, pi_old gap): both
      trained step 3 on the rollout step 2's checkpoint carries, from the same weights and Adam
      state. Steps 4-5 cannot repeat any other run's: the real server samples with
      ``torch.multinomial`` from its scheduler's global generator (``srt/layers/sampler.py``,
      ``sampling_from_probs_torch``; ``sampling_seed`` counts only with
      ``--enable-deterministic-inference``, which refuses the CPU engine's ``torch_native``
      attention), so every rollout drawn after the kill is a fresh draw, and an uninterrupted
      reference run would differ from its first step. What is checked there is the tightest
      thing that holds: every sample's engine log-probs equal the learner's recomputation
      (< 1e-5, fp32), and the post-sync probe agrees, at every step after the resume: the server
      generated exactly from the weights the resumed learner sent.
    """
    server = live_server
    assert left_state(server.address) == LeftState(False, False, []), "the server is not clean"
    run_dir = tmp_path / "run"
    flags = [f"rollout.sglang.server_addresses=[{server.address}]", "trainer.num_steps=5",
             "checkpoint.save_every_steps=2", "rollout.overlap_one_step=true",
             "rollout.weight_sync.bucket_bytes=131072",  # 5 buckets: the sync kill is mid-update
             "logging.plot=false"]
    command = [sys.executable, "-m", "gspo_megatron.cli.train", str(REPO / "configs" / "tiny_cpu.yaml"),
               *_overrides(assets, run_dir, *flags)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    log_path = tmp_path / "train.log"
    with open(log_path, "ab") as log:
        victim = subprocess.run(command, env={**env, "GSPO_TEST_KILL_AT": f"{point}:{KILL_STEP}"},
                                stdout=subprocess.DEVNULL, stderr=log, timeout=600)
    dead_log = log_path.read_text()
    assert victim.returncode == -signal.SIGKILL, dead_log[-3000:]
    assert f"GSPO_TEST_KILL_AT {point}:{KILL_STEP}: SIGKILL" in dead_log
    dead_rows = _rows(run_dir)
    dead_group = (run_dir / "weight_sync_group.txt").read_text().strip()
    _leftovers_of_the_kill(point, run_dir, left_state(server.address), dead_group, dead_log)
    assert server.alive(), server.log_tail()

    with open(log_path, "ab") as log:
        resumed = subprocess.run([*command, "--resume"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=log, timeout=600)
    resumed_log = log_path.read_text()[len(dead_log):]
    assert resumed.returncode == 0, resumed_log[-3000:]
    assert "resuming from" in resumed_log and "step_000002 (newest complete" in resumed_log
    assert f"destroyed weight-update group {dead_group} on {server.address}" in resumed_log
    if point == "sync":  # found as the kill left them, and undone
        assert "had a weight-update session open" in resumed_log
        assert "had generation paused" in resumed_log
    assert left_state(server.address) == LeftState(False, False, [])
    assert not (run_dir / "weight_sync_group.txt").exists()
    assert not list((run_dir / "checkpoints").glob("*.partial"))

    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    assert rows[:3] == [r for r in dead_rows if r["step"] <= 2]
    dead_step3 = [r for r in dead_rows if r["step"] == 3]
    assert len(dead_step3) == 1 and _comparable(rows[3]) == _comparable(dead_step3[0])
    assert rows[3]["train/loss"] != 0.0 and rows[3]["train/grad_norm"] > 0.0  # it learned
    for row in rows[3:]:
        assert row["rollout/learner_vs_engine_abs_logp"] < 1e-5, row["step"]
        assert row["weight_sync/probe_abs_logp"] < 1e-5, row["step"]
    assert server.alive(), server.log_tail()
