"""The slurm/ job scripts and pipelines/ submitters against a real Slurm on this machine.

Each module-scoped fixture starts a private cluster with tools/slurm_local.sh (one node named
``localhost``, or two slurmd daemons named node1 and node2) and stops exactly that cluster
afterwards. The trainer, converter, exporter and rollout server are small Python stand-ins
(written below, passed through the GSPO_*_ENTRY variables the scripts document), so this file
checks the Slurm mechanics alone: afterok ordering, the learner / server split over two nodes,
step supervision, preemption -> checkpoint -> requeue -> resume, and job arrays.
tests/test_slurm_pipeline.py runs the same path with the real entry points.

Needs root and `tools/slurm_local.sh install` (Debian slurm-wlm + munge).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
SLURM_LOCAL = REPO / "tools" / "slurm_local.sh"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}

pytestmark = pytest.mark.slow


@dataclass
class SlurmCluster:
    """A running private cluster: its state directory and the environment that talks to it."""

    state_dir: Path
    num_nodes: int

    def env(self, **extra: str) -> Dict[str, str]:
        """Our environment minus any outer Slurm job's variables, plus this cluster's config."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(SLURM_CONF=str(self.state_dir / "slurm.conf"), GSPO_PYTHON=sys.executable,
                   GSPO_KILL_GRACE_S="5", OMP_NUM_THREADS="1")
        env.update(extra)
        return env

    def run(self, *cmd: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=REPO, env=self.env(**extra), capture_output=True, text=True, timeout=60)

    def sbatch(self, *args: str, **extra: str) -> str:
        proc = self.run("sbatch", "--parsable", *args, **extra)
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, Dependency, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out.splitlines()[0])) if out.strip() else {}

    def wait(self, job_id: str, timeout_s: float = 120.0, release_requeued: bool = True) -> Dict[str, str]:
        """Wait for a final state. Slurm holds a requeued job ~2 minutes (BeginTime);
        ``release_requeued`` starts it at once instead, as an operator would."""
        deadline = time.monotonic() + timeout_s
        released = set()
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            if (release_requeued and info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
                    and info.get("Restarts") not in released):
                released.add(info.get("Restarts"))
                # Not "now": slurmd refuses a launch credential from the second the old run was
                # revoked in ("Job credential revoked"), which is what Slurm's hold guards against.
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+3")
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not finished after {timeout_s}s: {self.job(job_id)}")


@contextlib.contextmanager
def local_slurm(num_nodes: int, port: int) -> Iterator[SlurmCluster]:
    """Start a private cluster with the repo script; stop it (and only it) afterwards."""
    # munged runs as the munge user, so the state dir must be reachable by it (not under 0700 dirs).
    state_dir = Path(tempfile.mkdtemp(prefix="gspo-slurm-", dir="/tmp"))
    state_dir.chmod(0o755)
    start = subprocess.run(["bash", str(SLURM_LOCAL), "start", "--nodes", str(num_nodes), "--port", str(port),
                            str(state_dir)], capture_output=True, text=True, timeout=120)
    try:
        assert start.returncode == 0, (
            f"tools/slurm_local.sh start failed (run `tools/slurm_local.sh install` as root first): {start.stderr}")
        yield SlurmCluster(state_dir, num_nodes)
    finally:
        subprocess.run(["bash", str(SLURM_LOCAL), "stop", str(state_dir)], capture_output=True, timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm1() -> Iterator[SlurmCluster]:
    with local_slurm(1, 17817) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def slurm2() -> Iterator[SlurmCluster]:
    with local_slurm(2, 17827) as cluster:
        yield cluster


# ---------------------------------------------------------------- stand-ins for the entry points

FAKE_TRAINER = r'''
"""Stand-in trainer: a step every FAKE_STEP_S, a /sync call per step to every server; on SIGUSR1
or SIGTERM it checkpoints and exits 124 (with FAKE_IGNORE_WARNING it carries on); it resumes
from its checkpoint. It keeps progress.env as the real trainer does. Events go to
trainer_events.jsonl."""
import json, os, signal, sys, time, urllib.request
if int(os.environ.get("RANK", "0")) != 0:
    sys.exit(0)  # one acting rank: a layout of several learner ranks per node runs the others too
overrides = dict(a.split("=", 1) for a in sys.argv[2:])
run_dir = overrides["logging.run_dir"]
num_steps = int(overrides.get("trainer.num_steps", "5"))
ckpt = os.path.join(run_dir, "checkpoints", "state.json")
os.makedirs(os.path.dirname(ckpt), exist_ok=True)
start = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
stop = []
def warned(signum, _frame):
    record("signal", signal=signal.Signals(signum).name,
           deadline=open(os.environ["GSPO_DEADLINE_FILE"]).read()
           if os.path.exists(os.environ.get("GSPO_DEADLINE_FILE", "")) else None)
    if not os.environ.get("FAKE_IGNORE_WARNING"):
        stop.append(1)
signal.signal(signal.SIGUSR1, warned)
signal.signal(signal.SIGTERM, warned)
def record(kind, **kw):
    with open(os.path.join(run_dir, "trainer_events.jsonl"), "a") as f:
        f.write(json.dumps({"kind": kind, "time": time.time(), **kw}) + "\n")
def progress(trained):
    lines = [f"trained_step={trained}"]
    if os.path.exists(ckpt):
        lines.append(f"checkpoint_step={json.load(open(ckpt))['step']}")
    open(os.path.join(run_dir, "progress.env"), "w").write("\n".join(lines) + "\n")
servers = [s for s in overrides.get("rollout.sglang.server_addresses", "[]").strip("[]").split(",") if s]
record("start", config=sys.argv[1], overrides=overrides, start_step=start, pid=os.getpid(),
       restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")), node=os.environ.get("SLURMD_NODENAME"),
       world=os.environ.get("WORLD_SIZE"), plan=os.environ.get("GSPO_LAUNCH_PLAN"))
for step in range(start, num_steps):
    if stop:
        json.dump({"step": step}, open(ckpt, "w"))
        record("checkpoint", step=step)
        progress(step)
        sys.exit(124)
    for s in servers:
        try:
            urllib.request.urlopen(f"http://{s}/sync?step={step}", timeout=5).read()
        except OSError as exc:
            record("sync_error", step=step, error=str(exc))
    time.sleep(float(os.environ.get("FAKE_STEP_S", "0.05")))
    record("step", step=step)
    progress(step + 1)
json.dump({"step": num_steps}, open(ckpt, "w"))
record("done", steps=num_steps)
'''

FAKE_SERVER = r'''
"""Stand-in rollout server: /health and /sync, each request logged with the node it ran on.
With FAKE_SERVER_EXIT_ON_SYNC it exits with code 3 right after answering its first /sync."""
import argparse, http.server, json, os, threading
p = argparse.ArgumentParser()
p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
a = p.parse_args()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(os.environ["FAKE_SERVER_LOG"], "a") as f:
            f.write(json.dumps({"path": self.path, "node": os.environ.get("SLURMD_NODENAME"), "pid": os.getpid(),
                                "model": a.model_path, "host": a.host, "port": a.port}) + "\n")
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        if self.path.startswith("/sync") and os.environ.get("FAKE_SERVER_EXIT_ON_SYNC"):
            threading.Timer(0.2, lambda: os._exit(3)).start()
    def log_message(self, *args): pass
http.server.HTTPServer((a.host, a.port), H).serve_forever()
'''

FAKE_STAGE = r'''
"""Stand-in converter / exporter: records its arguments and times, writes a marker output."""
import json, os, sys, time
stage, args = sys.argv[1], sys.argv[2:]
opts = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
t0 = time.time()
if stage == "convert" and os.environ.get("FAKE_CONVERT_EXIT"):
    sys.exit(int(os.environ["FAKE_CONVERT_EXIT"]))
if stage == "export":
    assert os.path.exists(os.path.join(opts["--ckpt"], "state.json")), "no checkpoint to export"
time.sleep(0.5)
os.makedirs(opts["--out"], exist_ok=True)
json.dump({"stage": stage}, open(os.path.join(opts["--out"], "marker.json"), "w"))
with open(os.path.join(os.environ["GSPO_RUN_DIR"], "stages.jsonl"), "a") as f:
    f.write(json.dumps({"stage": stage, "start": t0, "end": time.time(), "args": args,
                        "job": os.environ.get("SLURM_JOB_ID")}) + "\n")
'''


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Dict[str, str]:
    folder = tmp_path_factory.mktemp("standins")
    paths = {}
    for name, text in (("trainer", FAKE_TRAINER), ("server", FAKE_SERVER), ("stage", FAKE_STAGE)):
        (folder / f"fake_{name}.py").write_text(text)
        paths[name] = str(folder / f"fake_{name}.py")
    return {
        "GSPO_TRAIN_ENTRY": paths["trainer"],
        "GSPO_ROLLOUT_ENTRY": paths["server"],
        "GSPO_CONVERT_ENTRY": f"{paths['stage']} convert",
        "GSPO_EXPORT_ENTRY": f"{paths['stage']} export",
    }


def read_jsonl(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def batch_log(run_dir: Path, job_id: str) -> str:
    return (run_dir / "logs" / job_id / "batch.log").read_text()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# ---------------------------------------------------------------- tests


def test_pipeline_chain_runs_in_order_with_learner_and_server_on_two_nodes(slurm2, standins, tmp_path):
    run_dir = tmp_path / "run"
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    server_log = tmp_path / "server.jsonl"
    num_steps = 3
    proc = slurm2.run(
        sys.executable, "-m", "pipelines.submit_pipeline", "--profile", "cpu",
        "--config", "configs/tiny_cpu.yaml", "--hf-dir", str(hf_dir), "--run-dir", str(run_dir),
        "--train-sbatch-arg=--nodes=2", "--", f"trainer.num_steps={num_steps}", "rollout.mode=disaggregated",
        "launch.num_learner_nodes=1", FAKE_SERVER_LOG=str(server_log), **standins)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((run_dir / "pipeline.json").read_text())
    jobs = {j["name"]: j for j in record["jobs"]}
    assert list(jobs) == ["convert", "train", "export"]
    assert f"--dependency=afterok:{jobs['convert']['job_id']}" in jobs["train"]["command"]
    assert f"--dependency=afterok:{jobs['train']['job_id']}" in jobs["export"]["command"]

    for name in ("convert", "train", "export"):
        info = slurm2.wait(jobs[name]["job_id"], timeout_s=150)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (name, info)

    stages = {s["stage"]: s for s in read_jsonl(run_dir / "stages.jsonl")}
    events = read_jsonl(run_dir / "trainer_events.jsonl")
    start = next(e for e in events if e["kind"] == "start")
    done = next(e for e in events if e["kind"] == "done")
    # afterok: each stage began only after the previous one ended.
    assert stages["convert"]["end"] <= start["time"] and done["time"] <= stages["export"]["start"]
    assert stages["convert"]["args"][stages["convert"]["args"].index("--hf-dir") + 1] == str(hf_dir)
    assert start["overrides"]["checkpoint.load_dir"] == str(run_dir / "converted")
    assert start["overrides"]["trainer.num_steps"] == str(num_steps)
    assert stages["export"]["args"][stages["export"]["args"].index("--ckpt") + 1] == str(run_dir / "checkpoints")
    assert (run_dir / "hf_export" / "marker.json").exists()
    # Two nodes: the learner on node1, the server on node2, a weight sync per step between them.
    assert start["node"] == "node1" and start["world"] == "1" and start["overrides"]["launch.num_nodes"] == "2"
    plan = json.loads(Path(start["plan"]).read_text())  # the launch plan the job ran
    assert [(s["node"], s["address"]) for s in plan["servers"]] == [("node2", "127.0.0.1:31000")]
    assert start["overrides"]["rollout.sglang.server_addresses"] == "[127.0.0.1:31000]"
    assert start["overrides"]["rollout.engine"] == "reference"
    requests = read_jsonl(server_log)
    assert {r["node"] for r in requests} == {"node2"} and requests[0]["path"] == "/health"
    assert [r["path"] for r in requests if r["path"].startswith("/sync")] == [
        f"/sync?step={i}" for i in range(num_steps)]
    # the server binds its node's address (NodeAddr), not every interface (docs/cluster.md)
    assert requests[0]["model"] == str(hf_dir) and requests[0]["host"] == "127.0.0.1"
    # the job's server keys: made by the planner step, 0600, in no plan or log (issue 33)
    key_file = run_dir / "secrets" / "rollout_server_keys.json"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert start["overrides"]["rollout.sglang.key_file"] == str(key_file)
    keys = json.loads(key_file.read_text())
    for path in [Path(start["plan"]), *(run_dir / "logs").rglob("*")]:
        if path.is_file():
            text = path.read_text(errors="replace")
            assert keys["api_key"] not in text and keys["admin_api_key"] not in text, path
    train_log = batch_log(run_dir, jobs["train"]["job_id"])
    assert "learner nodes node1; rollout nodes node2" in train_log and "job done" in train_log


def test_failed_convert_keeps_the_rest_of_the_chain_from_running(slurm1, standins, tmp_path):
    run_dir = tmp_path / "run"
    proc = slurm1.run(
        sys.executable, "-m", "pipelines.submit_pipeline", "--profile", "cpu",
        "--config", "configs/tiny_cpu.yaml", "--hf-dir", str(tmp_path), "--run-dir", str(run_dir),
        FAKE_CONVERT_EXIT="5", **standins)
    assert proc.returncode == 0, proc.stderr
    jobs = {j["name"]: j["job_id"] for j in json.loads((run_dir / "pipeline.json").read_text())["jobs"]}
    info = slurm1.wait(jobs["convert"])
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "5:0")
    assert "main step 'convert' exited with code 5" in batch_log(run_dir, jobs["convert"])
    wait_for(lambda: slurm1.job(jobs["train"]).get("Reason") == "DependencyNeverSatisfied", 30,
             "train to be marked DependencyNeverSatisfied")
    assert slurm1.job(jobs["train"])["JobState"] == "PENDING"
    assert not (run_dir / "trainer_events.jsonl").exists()
    slurm1.run("scancel", jobs["train"], jobs["export"])


def test_server_crash_without_restarts_fails_the_job_and_stops_the_learner_on_the_other_node(
        slurm2, standins, tmp_path):
    run_dir = tmp_path / "run"
    job = slurm2.sbatch(
        "--nodes=2", f"--output={tmp_path}/job.out", "slurm/tiny_cpu.sh", "trainer.num_steps=100000",
        "rollout.mode=disaggregated", "launch.num_learner_nodes=1", "rollout.sglang.restarts_per_hour=0",
        GSPO_RUN_DIR=str(run_dir), GSPO_HF_DIR=str(tmp_path), FAKE_SERVER_LOG=str(tmp_path / "server.jsonl"),
        FAKE_SERVER_EXIT_ON_SYNC="1", FAKE_STEP_S="0.2", **standins)
    info = slurm2.wait(job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "3:0"), info
    log = batch_log(run_dir, job)
    assert ("FAILED (exit code 3): rollout server server0 (127.0.0.1:31000 on node2): exited with code 3 while "
            "the main step was running (rollout.sglang.restarts_per_hour=0") in log
    events = read_jsonl(run_dir / "trainer_events.jsonl")
    learner_pid = next(e["pid"] for e in events if e["kind"] == "start")
    assert not any(e["kind"] == "done" for e in events)
    wait_for(lambda: not pid_alive(learner_pid), 15, "the learner process to be gone")


# the fleet's timers at the scale of these jobs (slurm/fleet.sh): probe every second, at most 2 s each
FLEET_FAST = dict(GSPO_FLEET_PROBE_S="1", GSPO_FLEET_PROBE_MAX_S="2", GSPO_SERVER_RESTART_DELAY_S="1")


def server_pids(server_log: Path, port: int) -> List[int]:
    """The processes that answered on ``port``, in the order they first did."""
    pids: List[int] = []
    for r in read_jsonl(server_log) if server_log.exists() else []:
        if r["port"] == port and r["pid"] not in pids:
            pids.append(r["pid"])
    return pids


def fleet_events(run_dir: Path) -> List[dict]:
    path = run_dir / "fleet_events.jsonl"
    return read_jsonl(path) if path.exists() else []


def test_a_killed_server_and_a_stopped_one_are_restarted_while_the_learner_trains_on(slurm2, standins, tmp_path):
    """Issue 50 on a real Slurm: three servers on the rollout node, each its own step. SIGKILL one
    mid-run: its step ends, the job restarts it on its node and port; SIGSTOP another: it stops
    answering /health_generate, is found hung after rollout.sglang.hang_timeout_s, killed
    through Slurm (scancel --signal=KILL on its step: a stopped process ignores TERM) and
    restarted. The learner trains on throughout and the job completes."""
    run_dir, server_log = tmp_path / "run", tmp_path / "server.jsonl"
    num_steps = 100
    job = slurm2.sbatch(
        "--nodes=2", f"--output={tmp_path}/job.out", "slurm/tiny_cpu.sh", f"trainer.num_steps={num_steps}",
        "rollout.mode=disaggregated", "launch.num_learner_nodes=1", "launch.devices_per_node=3",
        "rollout.sglang.num_servers=3",
        "rollout.sglang.hang_timeout_s=4",
        GSPO_RUN_DIR=str(run_dir), GSPO_HF_DIR=str(tmp_path), FAKE_SERVER_LOG=str(server_log),
        FAKE_STEP_S="0.3", **FLEET_FAST, **standins)
    stopped = None
    try:
        _wait_for_steps(run_dir / "trainer_events.jsonl", 3)
        killed = server_pids(server_log, 31001)[0]
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: len(server_pids(server_log, 31001)) == 2, 60,
                 "server1 to answer again from a new process")
        stopped = server_pids(server_log, 31002)[0]
        os.kill(stopped, signal.SIGSTOP)
        info = slurm2.wait(job, timeout_s=150)
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        slurm2.run("scancel", job)  # a failed assertion above must not leave the job running
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, batch_log(run_dir, job))
    assert not pid_alive(stopped), "the hung server was killed, not left stopped"
    assert len(server_pids(server_log, 31002)) == 2 and len(server_pids(server_log, 31000)) == 1
    seen = [(e["server"], e["event"]) for e in fleet_events(run_dir)]
    assert seen == [("server1", "down"), ("server1", "restarted"), ("server1", "healthy"),
                    ("server2", "down"), ("server2", "restarted"), ("server2", "healthy")], seen
    reasons = [e["reason"] for e in fleet_events(run_dir) if e["event"] == "down"]
    assert reasons[0].startswith("exited with code") and reasons[1].startswith("hung: /health_generate")
    # the learner trained every step; the restarted servers answered its later syncs
    events = read_jsonl(run_dir / "trainer_events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "step"] == list(range(num_steps))
    new_server1 = server_pids(server_log, 31001)[1]
    assert any(r["pid"] == new_server1 and r["path"].startswith("/sync") for r in read_jsonl(server_log))
    log = batch_log(run_dir, job)
    assert "restarting rollout server server1 (127.0.0.1:31001 on node2)" in log and "job done" in log


def test_a_restarted_server_whose_port_is_taken_ends_the_job_naming_it_and_its_log(slurm2, standins, tmp_path):
    """The server's port is taken once it died (another process bound it): each restart fails in
    its start-up, the budget is spent, and the job ends naming the server and quoting the
    reason from its log; nothing of the job is left running."""
    run_dir, server_log = tmp_path / "run", tmp_path / "server.jsonl"
    job = slurm2.sbatch(
        "--nodes=2", f"--output={tmp_path}/job.out", "slurm/tiny_cpu.sh", "trainer.num_steps=100000",
        "rollout.mode=disaggregated", "launch.num_learner_nodes=1", "rollout.sglang.restarts_per_hour=2",
        GSPO_RUN_DIR=str(run_dir), GSPO_HF_DIR=str(tmp_path), FAKE_SERVER_LOG=str(server_log),
        FAKE_STEP_S="0.2", **{**FLEET_FAST, "GSPO_SERVER_RESTART_DELAY_S": "3"}, **standins)
    squatter = socket.socket()
    # the killed server's connections linger in TIME_WAIT; the restarted server (Python's
    # HTTPServer reuses the address) and this one both bind past them
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        _wait_for_steps(run_dir / "trainer_events.jsonl", 2)
        pid = server_pids(server_log, 31000)[0]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, "the server to be gone")
        squatter.bind(("127.0.0.1", 31000))
        squatter.listen()
        info = slurm2.wait(job, timeout_s=120)
    finally:
        squatter.close()
        slurm2.run("scancel", job)  # a failed assertion above must not leave the job running
    assert info["JobState"] == "FAILED", info
    log = batch_log(run_dir, job)
    assert re.search(r"FAILED \(exit code 1\): rollout server server0 \(127.0.0.1:31000 on node2\): exited with "
                     r"code 1 during its start-up after a restart, after 2 restart\(s\) within the last hour "
                     r"\(rollout.sglang.restarts_per_hour=2\): not restarted again; log: \S+/server0.r0.log", log), log
    assert "Address already in use" in log  # the end of the server's log, quoted
    learner_pid = next(e["pid"] for e in read_jsonl(run_dir / "trainer_events.jsonl") if e["kind"] == "start")
    wait_for(lambda: not pid_alive(learner_pid), 15, "the learner process to be gone")
    assert [e["event"] for e in fleet_events(run_dir)] == ["down", "restarted", "down", "restarted", "down",
                                                           "gave_up"]


def test_preempted_training_checkpoints_requeues_and_resumes_to_the_full_step_count(slurm1, standins, tmp_path):
    run_dir = tmp_path / "run"
    num_steps = 40
    job = slurm1.sbatch(
        f"--output={tmp_path}/job.out", "slurm/tiny_cpu.sh", f"trainer.num_steps={num_steps}",
        "rollout.engine=embedded", "rollout.weight_sync.transport=auto",
        GSPO_RUN_DIR=str(run_dir), FAKE_STEP_S="0.1", **standins)
    events_path = run_dir / "trainer_events.jsonl"
    wait_for(lambda: events_path.exists() and '"step"' in events_path.read_text(), 90, "the first step")
    # What Slurm does at --signal=B:USR1@T: SIGUSR1 to the batch shell only.
    assert slurm1.run("scancel", "--signal=USR1", "--batch", job).returncode == 0
    info = slurm1.wait(job, timeout_s=150)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), info

    events = read_jsonl(events_path)
    starts = [e for e in events if e["kind"] == "start"]
    checkpoint = next(e for e in events if e["kind"] == "checkpoint")
    assert [s["restart"] for s in starts] == [0, 1]
    assert 0 < checkpoint["step"] < num_steps and starts[1]["start_step"] == checkpoint["step"]
    steps = [e["step"] for e in events if e["kind"] == "step"]
    assert steps == list(range(num_steps)), "every step exactly once, as in an uninterrupted run"
    assert events[-1] == {**events[-1], "kind": "done", "steps": num_steps}
    log = batch_log(run_dir, job)
    assert "SIGUSR1 received" in log and "requeueing job" in log and "job done" in log


def _wait_for_steps(events_path: Path, count: int, timeout_s: float = 90) -> None:
    wait_for(lambda: events_path.exists() and events_path.read_text().count('"kind": "step"') >= count,
             timeout_s, f"{count} steps")


def test_sigterm_to_the_learner_step_checkpoints_through_torchrun(slurm1, standins, tmp_path):
    """Issue 49: Slurm's default preemption (GraceTime, no send_user_signal) sends SIGTERM to the
    job's steps, not to the batch shell (``scancel --signal=TERM`` does the same). torchrun
    ignores it (``--signals-to-handle`` without SIGTERM) instead of killing its workers 30 s
    later, the learner's own handler checkpoints and exits 124, and the job is requeued and
    resumed: every step once."""
    run_dir = tmp_path / "run"
    num_steps = 60
    job = slurm1.sbatch(
        f"--output={tmp_path}/job.out", "slurm/tiny_cpu.sh", f"trainer.num_steps={num_steps}",
        "rollout.engine=embedded", "rollout.weight_sync.transport=auto",
        GSPO_RUN_DIR=str(run_dir), FAKE_STEP_S="0.1", **standins)
    events_path = run_dir / "trainer_events.jsonl"
    _wait_for_steps(events_path, 1)
    assert slurm1.run("scancel", "--signal=TERM", job).returncode == 0
    info = slurm1.wait(job, timeout_s=150)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), info
    events = read_jsonl(events_path)
    assert [e["signal"] for e in events if e["kind"] == "signal"][:1] == ["SIGTERM"]
    checkpoint = next(e for e in events if e["kind"] == "checkpoint")
    assert [e["step"] for e in events if e["kind"] == "step"] == list(range(num_steps))
    assert (f"learner checkpointed; the resumed run starts from the checkpoint of step "
            f"{checkpoint['step']} and redoes 0 step(s)") in batch_log(run_dir, job)


def test_a_learner_past_its_deadline_is_stopped_and_the_requeue_says_what_is_redone(slurm1, standins, tmp_path):
    """A preemption with ``PreemptParameters=send_user_signal`` moves the job's end to now +
    GraceTime and sends the job's own warning (B:USR1) to the batch shell: done here with
    ``scontrol update EndTime`` and ``scancel --signal=USR1 --batch``. The learner gets the moved
    end less GSPO_REQUEUE_LEAD_S as its deadline; one that ignores it (a stand-in) is stopped
    GSPO_HARD_STOP_GRACE_S after it, and the job is requeued with the steps the rerun redoes,
    not as a checkpointed one."""
    run_dir = tmp_path / "run"
    num_steps = 300
    job = slurm1.sbatch(
        f"--output={tmp_path}/job.out", "slurm/tiny_cpu.sh", f"trainer.num_steps={num_steps}",
        "rollout.engine=embedded", "rollout.weight_sync.transport=auto",
        GSPO_RUN_DIR=str(run_dir), FAKE_STEP_S="0.05", FAKE_IGNORE_WARNING="1", GSPO_REQUEUE_LEAD_S="30",
        GSPO_HARD_STOP_GRACE_S="2", **standins)
    events_path = run_dir / "trainer_events.jsonl"
    _wait_for_steps(events_path, 1)
    moved = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 37))
    assert slurm1.run("scontrol", "update", f"JobId={job}", f"EndTime={moved}").returncode == 0
    end = int(slurm1.run("squeue", "-h", "-j", job, "-o", "%e", SLURM_TIME_FORMAT="%s").stdout)
    assert slurm1.run("scancel", "--signal=USR1", "--batch", job).returncode == 0
    info = slurm1.wait(job, timeout_s=200)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), info
    events = read_jsonl(events_path)
    signal_event = next(e for e in events if e["kind"] == "signal")
    assert signal_event["deadline"] == f"exit_by={end - 30}\njob_end={end}\n"
    starts = [i for i, e in enumerate(events) if e["kind"] == "start"]
    first_run = [e for e in events[:starts[1]] if e["kind"] == "step"]
    stopped_at = events[starts[1] - 1]["time"]
    assert end - 30 <= stopped_at <= end - 30 + 2 + 8, (stopped_at - (end - 30))  # grace + a poll
    assert events[starts[1]]["start_step"] == 0 and "checkpoint" not in {e["kind"] for e in events}
    log = batch_log(run_dir, job)
    assert "past its deadline: stopping it" in log
    redo = re.search(r"learner stopped WITHOUT a checkpoint at the job's deadline; no checkpoint of "
                     r"this run yet: the resumed run redoes its (\d+) step\(s\)", log)
    assert redo and int(redo.group(1)) in (len(first_run), len(first_run) + 1), log


GRID_TASK = """#!/usr/bin/env bash
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
set -euo pipefail
source "$GSPO_REPO/slurm/lib.sh"
gspo_require_slurm
gspo_setup_run_dir
gspo_grid_overrides
printf '%s\\n' "${GSPO_GRID_OVERRIDES[@]}" >"$GSPO_RUN_DIR/received.overrides"
"""


def test_grid_job_array_gives_each_task_its_point(slurm1, tmp_path):
    script = tmp_path / "grid_task.sh"
    script.write_text(GRID_TASK)
    grid_dir = tmp_path / "grid"
    proc = slurm1.run(sys.executable, "-m", "pipelines.submit_grid", "--grid-dir", str(grid_dir),
                      "--script", str(script), "--config", "configs/tiny_cpu.yaml",
                      "--axis", "optimizer.lr=2e-4,4e-4",
                      "--axis", "algo.loss=gspo,grpo", "--max-parallel", "2", "--", "trainer.num_steps=3")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((grid_dir / "grid.json").read_text())
    job = record["jobs"][0]["job_id"]
    assert len(record["points"]) == 4
    for point in record["points"]:
        info = slurm1.wait(f"{job}_{point['index']}")
        assert info["JobState"] == "COMPLETED", info
        received = (Path(point["run_dir"]) / "received.overrides").read_text().split()
        assert received == point["overrides"] and received[1] == "trainer.num_steps=3"
    assert {tuple(p["overrides"][2:4]) for p in record["points"]} == {
        (f"optimizer.lr={lr}", f"algo.loss={loss}") for lr in ("2e-4", "4e-4") for loss in ("gspo", "grpo")}
