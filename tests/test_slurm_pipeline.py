"""End to end through a real local Slurm with the real entry points: convert -> train -> export
of the tiny config submitted by pipelines/submit_pipeline.py, on one node and on a two-node
emulated cluster (learner on node1, the reference rollout server on node2, a weight sync over the
network group every step); the exported model must load in transformers.

Uses the clusters of tests/test_slurm_infra.py (tools/slurm_local.sh; root + slurm-wlm).
"""

from __future__ import annotations

import json
import re
import time
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
import torch

from tests.test_slurm_infra import REPO, SlurmCluster, local_slurm, read_jsonl

pytestmark = pytest.mark.slow

NUM_STEPS = 2


@pytest.fixture(scope="module")
def cluster1():
    with local_slurm(1, 17837) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster2():
    with local_slurm(2, 17847) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_assets")
    proc = subprocess.run([sys.executable, "tools/make_tiny_assets.py", str(out), "--num-train", "64",
                           "--num-eval", "8"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def small_run_overrides(assets: Path) -> List[str]:
    return [f"data.train_path={assets}/data/train.jsonl", "data.eval_path=null",
            f"trainer.num_steps={NUM_STEPS}", "trainer.num_sft_steps=2", "trainer.sft_batch_size=8",
            "trainer.eval_every_steps=0",
            "batch.num_prompts_per_step=4", "batch.num_mini_batches=1", "rollout.n_samples_per_prompt=2",
            "checkpoint.save_every_steps=0", "logging.wandb.enabled=false", "logging.plot=false"]


def run_pipeline(cluster: SlurmCluster, assets: Path, run_dir: Path, extra_args: List[str],
                 env: Dict[str, str], overrides: Sequence[str] = ()) -> Dict[str, str]:
    proc = cluster.run(sys.executable, "-m", "pipelines.submit_pipeline", "--profile", "cpu",
                       "--config", "configs/tiny_cpu.yaml", "--hf-dir", str(assets / "model"),
                       "--run-dir", str(run_dir), *extra_args, "--", *small_run_overrides(assets), *overrides,
                       **env)
    assert proc.returncode == 0, proc.stderr
    jobs = {j["name"]: j["job_id"] for j in json.loads((run_dir / "pipeline.json").read_text())["jobs"]}
    for name in ("convert", "train", "export"):
        info = cluster.wait(jobs[name], timeout_s=600)
        logs = "\n".join(p.read_text()[-3000:] for p in (run_dir / "logs").rglob("*.log"))
        state = (info["JobState"], info["ExitCode"])
        assert state == ("COMPLETED", "0:0"), f"{name} job {jobs[name]}: {state}\n{logs}"
    return jobs


def assert_trained_and_exported(run_dir: Path, assets: Path) -> None:
    from transformers import AutoModelForCausalLM

    rows = read_jsonl(run_dir / "metrics.jsonl")
    synced = [r for r in rows if "weight_sync/gb" in r]
    assert len(synced) >= NUM_STEPS and all(r["weight_sync/gb"] > 0 for r in synced), rows
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf_export")
    initial = AutoModelForCausalLM.from_pretrained(assets / "model")
    assert exported.config.model_type == "qwen3_moe"
    new, old = exported.state_dict(), initial.state_dict()
    assert new.keys() == old.keys() and all(new[k].shape == old[k].shape for k in old)
    assert any(not torch.equal(new[k], old[k]) for k in old), "export equals the initial weights"
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(exported(ids).logits).all()


def test_convert_train_export_of_the_tiny_config_on_one_node(cluster1, tiny_assets, tmp_path):
    run_dir = tmp_path / "run"
    run_pipeline(cluster1, tiny_assets, run_dir, [], {})
    assert_trained_and_exported(run_dir, tiny_assets)


def test_learner_on_node1_and_reference_server_on_node2(cluster2, tiny_assets, tmp_path):
    run_dir = tmp_path / "run"
    jobs = run_pipeline(cluster2, tiny_assets, run_dir, ["--train-sbatch-arg=--nodes=2"], {},
                        ["rollout.mode=disaggregated", "launch.num_learner_nodes=1"])
    batch = (run_dir / "logs" / jobs["train"] / "batch.log").read_text()
    assert "learner nodes node1; rollout nodes node2" in batch and "healthy: http://127.0.0.1:31000/health" in batch
    assert_trained_and_exported(run_dir, tiny_assets)


def test_learner_on_node1_and_the_real_sglang_server_on_node2(cluster2, tiny_assets, tmp_path):
    """The same two-node job with the real SGLang 0.5.23 server (CPU engine, its own virtualenv)
    on node 2: started by the launch plan through the keyed launcher with the job's keys, the
    learner's weights sent over a gloo group every step and checked by the post-sync probe."""
    from tests.real_sglang import SGLANG_PYTHON

    run_dir = tmp_path / "run"
    jobs = run_pipeline(cluster2, tiny_assets, run_dir, ["--train-sbatch-arg=--nodes=2"], {},
                        ["rollout.mode=disaggregated", "launch.num_learner_nodes=1",
                         "rollout.engine=sglang", "rollout.sglang.device=cpu",
                         f"rollout.sglang.python={SGLANG_PYTHON}", "rollout.sglang.max_total_tokens=4096",
                         "rollout.weight_sync.transport=nccl", "rollout.weight_sync.verify=true",
                         "rollout.weight_sync.verify_tolerance=1e-5"])
    batch = (run_dir / "logs" / jobs["train"] / "batch.log").read_text()
    assert "learner nodes node1; rollout nodes node2" in batch and "healthy: http://127.0.0.1:31000/health" in batch
    server_log = (run_dir / "logs" / jobs["train"] / "server0.r0.log").read_text()
    assert "Load weight end" in server_log and "'api_key': '<redacted>'" in server_log  # real, keyed
    rows = read_jsonl(run_dir / "metrics.jsonl")
    probed = [r["weight_sync/probe_abs_logp"] for r in rows if "weight_sync/probe_abs_logp" in r]
    assert len(probed) >= NUM_STEPS and max(probed) < 1e-5
    assert_trained_and_exported(run_dir, tiny_assets)


def test_real_trainer_preempted_by_slurm_resumes_to_the_full_step_count(cluster1, tiny_assets, tmp_path):
    """Issue 49's reproduction: a user reward that sleeps makes a step take ~2.5 s, more than twice
    the batch shell's repeat interval (GSPO_USR1_REPEAT_S=1), and SIGUSR1 comes to the batch shell
    (as at --signal=B:USR1@T) after step 2. The repeats reach the learner during its step and
    change nothing: the step in progress is finished and checkpointed (exit 124), the job
    requeues and resumes from that checkpoint, and every step is trained once."""
    run_dir = tmp_path / "run"
    num_steps = 5
    overrides = [o for o in small_run_overrides(tiny_assets) if not o.startswith("trainer.num_steps")]
    job = cluster1.sbatch(f"--output={tmp_path}/job.out", "slurm/tiny_cpu.sh", f"trainer.num_steps={num_steps}",
                          *overrides, "rollout.engine=embedded", "rollout.weight_sync.transport=auto",
                          "reward.name=tests.paced_reward:tiny_addition",
                          GSPO_RUN_DIR=str(run_dir), GSPO_HF_DIR=str(tiny_assets / "model"),
                          GSPO_TEST_REWARD_SLEEP_S="0.3", GSPO_USR1_REPEAT_S="1")
    metrics = run_dir / "metrics.jsonl"

    def trained_steps() -> List[int]:
        rows = read_jsonl(metrics) if metrics.exists() else []
        return [r["step"] for r in rows if r.get("step", 0) > 0]

    deadline = time.monotonic() + 300
    while len(trained_steps()) < 2:
        state = cluster1.job(job).get("JobState")
        assert time.monotonic() < deadline and state in ("PENDING", "RUNNING"), (state, trained_steps())
        time.sleep(0.2)
    assert cluster1.run("scancel", "--signal=USR1", "--batch", job).returncode == 0
    info = cluster1.wait(job, timeout_s=400)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), info
    assert trained_steps() == list(range(1, num_steps + 1)), "each step once, as in an uninterrupted run"
    first = (run_dir / "logs" / job / "learner.r0.log").read_text()
    warned_in = int(re.search(r"checkpointed step (\d+) after SIGUSR1; exiting 124", first).group(1))
    assert warned_in >= 3 and "the checkpoint asked for by SIGUSR1 stands" in first  # repeats: no effect
    assert "received SIGUSR1: will checkpoint after the current step" in first
    batch = (run_dir / "logs" / job / "batch.log").read_text()
    assert batch.count("learner still running after SIGUSR1; sending it again") >= 1
    assert (f"learner checkpointed; the resumed run starts from the checkpoint of step {warned_in} and "
            "redoes 0 step(s)") in batch
    resumed = (run_dir / "logs" / job / "learner.r1.log").read_text()
    assert f"resumed from {run_dir}/checkpoints/step_{warned_in:06d}" in resumed
