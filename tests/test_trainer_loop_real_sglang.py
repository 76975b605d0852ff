"""The GSPO loop against the real SGLang 0.5.23 server on CPU, launched by the trainer itself.

``rollout.engine=sglang rollout.sglang.device=cpu`` with the server virtualenv's interpreter
(``make sglang-venv``): the trainer starts the server through our launcher (the CPU engine's
flags, the checkpoint's own dtype), generates every rollout on it, sends the learner's weights
after every update through a gloo broadcast group, and stops it at the end. With
``algo.old_logprob_source=learner`` the learner recomputes every sample's log-probs, so
``rollout/learner_vs_engine_abs_logp`` of every step says that the previous sync arrived
(2 layers of fp32: ~1e-7 when it did, ~1e-1 when the server still had older weights), and
``rollout.weight_sync.verify`` probes the server after every sync (``trainer/sync_check.py``).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_megatron.distributed.runtime import free_port
from tests.real_sglang import SGLANG_PYTHON, RealServer, listening_pids

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
                 "rollout.weight_sync.verify=true", "rollout.weight_sync.verify_tolerance=1e-5", *extra]


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
    rows = _train(assets, tmp_path, f"trainer.num_steps={NUM_STEPS}", f"rollout.sglang.port={port}",
                  f"rollout.overlap_one_step={str(overlap).lower()}")
    assert [r["step"] for r in rows] == list(range(NUM_STEPS + 1))
    for row in rows[1:]:
        assert 0.0 <= row["reward/mean"] <= 1.0
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


def test_a_run_killed_mid_rollout_resumes_against_the_same_live_server(assets, tmp_path):
    """Issue 28 item 8: ``kill -9`` of the trainer while it uses an external server (started
    here, as a user would), then ``--resume`` against that same server, which the dead trainer
    may have left paused, inside a session and holding its broadcast group: the resumed run
    recovers it, syncs its checkpoint's weights and finishes, every step's samples coming from
    the weights it sent (learner vs engine log-probs)."""
    server = RealServer(str(assets.model_dir), tmp_path / "server.log").start()
    run_dir = tmp_path / "run"
    flags = [f"rollout.sglang.server_addresses=[{server.address}]", "trainer.num_steps=8",
             "checkpoint.save_every_steps=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "gspo_megatron.cli.train", str(REPO / "configs" / "tiny_cpu.yaml"),
               *_overrides(assets, run_dir, *flags)]
    log_path = tmp_path / "train.log"
    try:
        with open(log_path, "ab") as log:
            victim = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 600
        checkpoint = run_dir / "checkpoints" / "step_000002" / "gspo_meta.json"
        while not checkpoint.exists():
            assert victim.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint of step 2 appeared"
            time.sleep(0.1)
        time.sleep(0.3)  # into step 3: its rollout, update or sync
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=60)
        assert server.alive(), server.log_tail()
        with open(log_path, "ab") as log:
            resumed = subprocess.run([*command, "--resume"], env=env, stdout=subprocess.DEVNULL,
                                     stderr=log, timeout=600)
        assert resumed.returncode == 0, log_path.read_text()[-3000:]
        rows = _rows(run_dir)
        assert [r["step"] for r in rows][-1] == 8
        after = [r for r in rows if r["step"] >= 3]
        assert after and all(r["rollout/learner_vs_engine_abs_logp"] < 1e-5 for r in after)
        assert server.alive(), server.log_tail()
    finally:
        server.stop()
