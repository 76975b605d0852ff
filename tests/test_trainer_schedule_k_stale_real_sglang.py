"""Asynchronous rollouts (``rollout.max_staleness=2``) against the real SGLang 0.5.23 server on
CPU: the generator keeps the server busy across weight updates, no token trains more than k
steps after its weights, and a run killed with SIGKILL right after a checkpoint, while groups
are in flight, resumes against the same live server without training a prompt twice or losing
one (``async_groups.jsonl``, trainer/schedule/k_stale_ledger.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from gspo_megatron.trainer.schedule.k_stale_ledger import LEDGER_FILE, read_ledger
from tests.lag_audit import lag_mismatches, off_by_one
from tests.real_sglang import SGLANG_PYTHON, RealServer

REPO = Path(__file__).resolve().parents[1]
K = 2
NUM_TRAIN = 400

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):  # NUM_TRAIN distinct prompts: one epoch outlasts every run
    from gspo_megatron.tiny_task.assets import make_tiny_assets
    from gspo_megatron.tiny_task.task import AdditionTaskConfig

    out = tmp_path_factory.mktemp("tiny_assets")
    return make_tiny_assets(out, task=AdditionTaskConfig(num_train=NUM_TRAIN, num_eval=16))


def _command(assets, run_dir: Path, address: str, num_steps: int) -> list:
    return [sys.executable, "-m", "gspo_megatron.cli.train", str(REPO / "configs" / "tiny_cpu.yaml"),
            f"model.hf_path={assets.model_dir}", f"data.train_path={assets.train_path}",
            f"data.eval_path={assets.eval_path}", f"logging.run_dir={run_dir}",
            "logging.wandb.enabled=false", "batch.num_prompts_per_step=8",
            "rollout.n_samples_per_prompt=4", "batch.num_mini_batches=2",
            "trainer.num_sft_steps=20", "trainer.sft_batch_size=16", "trainer.eval_every_steps=0",
            f"trainer.num_steps={num_steps}", "checkpoint.save_every_steps=2",
            "checkpoint.keep_last=10",
            "algo.old_logprob_source=learner", "algo.tis.mode=truncate", "algo.tis.level=sequence",
            f"rollout.max_staleness={K}", "rollout.engine=sglang", "rollout.mode=disaggregated",
            "rollout.sglang.device=cpu", f"rollout.sglang.python={SGLANG_PYTHON}",
            f"rollout.sglang.server_addresses=[{address}]", "rollout.sglang.health_timeout_s=240",
            "rollout.weight_sync.transport=nccl", "rollout.weight_sync.master_address=127.0.0.1"]


def _rows(run_dir: Path) -> list:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _audit(run_dir: Path) -> Counter:
    """Every admitted group named exactly once (taken, dropped or left); taken ones within k."""
    fates: Counter = Counter()
    seen = {}
    for row in read_ledger(run_dir / LEDGER_FILE):
        for index, prompt_id, lag, _ in row.get("taken", []):
            assert 0 <= lag <= K, row
            seen.setdefault(index, []).append(("taken", prompt_id))
            fates["taken"] += 1
        for index, prompt_id, reason in row.get("dropped", []):
            seen.setdefault(index, []).append((reason, prompt_id))
            fates[reason] += 1
        for index, prompt_id in row.get("left", []):
            seen.setdefault(index, []).append(("left", prompt_id))
            fates["left"] += 1
    twice = {i: f for i, f in seen.items() if len(f) > 1}
    assert not twice, f"groups named more than once: {twice}"
    assert sorted(seen) == list(range(len(seen))), "an admitted group is missing from the ledger"
    # By prompt too (fewer groups than the data set's prompts, so one epoch): a restore that
    # drew trained prompts again under new admission indices would pass the check above.
    prompts = [p for fates_of in seen.values() for _, p in fates_of]
    assert len(seen) < NUM_TRAIN and len(set(prompts)) == len(prompts), "a prompt came back"
    return fates


def test_killed_after_a_checkpoint_with_groups_in_flight_resumes_without_repeating_a_prompt(
        assets, tmp_path):
    server = RealServer(str(assets.model_dir), tmp_path / "server.log").start()
    run_dir = tmp_path / "run"
    command = _command(assets, run_dir, server.address, num_steps=6)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    log_path = tmp_path / "train.log"
    try:
        with open(log_path, "ab") as log:
            victim = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 600
        checkpoint = run_dir / "checkpoints" / "step_000002" / "gspo_meta.json"
        while not checkpoint.exists():
            assert victim.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint of step 2 appeared"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)  # the generator keeps (k + 1) batches going: in flight
        victim.wait(timeout=60)
        assert server.alive(), server.log_tail()
        with open(log_path, "ab") as log:
            resumed = subprocess.run([*command, "--resume"], env=env, stdout=subprocess.DEVNULL,
                                     stderr=log, timeout=600)
        assert resumed.returncode == 0, log_path.read_text()[-3000:]
        assert server.alive(), server.log_tail()
    finally:
        server.stop()
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(7))
    steps = rows[1:]
    for row in steps:
        assert row["rollout/policy_lag_steps"] <= K
        assert sum(row[f"async/lag{j}_token_frac"] for j in range(K + 1)) == pytest.approx(1.0)
        assert 0.0 < row["train/tis_weight_mean"] <= 2.0
    # the run trained on stale samples: some step's tokens were generated before its last update
    assert max(r["async/lag_mean"] for r in steps) > 0
    # the resume discarded the checkpoint's in-flight groups, counted them, generated them again
    saved = torch.load(run_dir / "checkpoints" / "step_000002" / "common.pt",
                       weights_only=False)["extra"]["pending_rollout"]["async"]
    in_flight = {int(i) for i, _ in saved["in_flight"]}
    assert in_flight, "nothing was in flight at the checkpoint: the resume's path went untested"
    assert rows[3]["async/discarded_in_flight_groups"] == len(in_flight)
    taken_after = {i for r in read_ledger(run_dir / LEDGER_FILE) if r["step"] > 2
                   for i, *_ in r.get("taken", [])}
    buffered = {int(g["index"]) for g in saved["buffer"]}
    assert (in_flight | buffered) - taken_after <= _dropped_or_left(run_dir)
    fates = _audit(run_dir)
    assert fates["taken"] == 6 * 8  # 6 steps of 8 groups
    # every trained group says which server generated its tokens (one server here)
    served = {i: tokens for r in read_ledger(run_dir / LEDGER_FILE) for i, _p, tokens, _why in r.get("served", [])}
    assert set(served) == {i for r in read_ledger(run_dir / LEDGER_FILE) for i, *_ in r.get("taken", [])}
    assert all(set(tokens) == {server.address} and sum(tokens.values()) > 0 for tokens in served.values())
    # Every trained token's lag recounted from the versions the real server reported (not
    # through lag_of), across the kill and the resume; the metrics of an off-by-one lag_of
    # would not pass the same recount.
    ledger = read_ledger(run_dir / LEDGER_FILE)
    assert lag_mismatches(rows, ledger, num_mini_batches=2, max_staleness=K) == []
    assert lag_mismatches(off_by_one(rows, K), ledger, num_mini_batches=2, max_staleness=K)


def _dropped_or_left(run_dir: Path) -> set:
    return {i for r in read_ledger(run_dir / LEDGER_FILE)
            for i, *_ in r.get("dropped", []) + r.get("left", [])}
