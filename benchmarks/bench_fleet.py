#!/usr/bin/env python
"""A rollout server's death, on a real local two-node Slurm, with the real trainer (issue 50).

Each trial submits ``slurm/tiny_cpu.sh`` across two emulated nodes (``tools/slurm_local.sh
--nodes 2``): the learner on node1 (two ranks), two rollout servers on node2 (each its own step,
``slurm/fleet.sh``), the tiny config on-policy with the weights broadcast over the gloo group and
checked by the post-sync probe every step (``rollout.weight_sync.verify``). A reward that sleeps
stretches a step to a few seconds, longer than the fleet's probe interval, so each timer meets a
step in progress (tests/paced_reward.py). Trials:

- ``none``: undisturbed, the baseline;
- ``generation``: SIGKILL server1 the moment the sync of step ``k`` ends (the learner's pause file,
  ``GSPO_FLEET_PAUSE_FILE``, is removed: generation starts);
- ``sync``: SIGKILL server1 while that pause file exists (a weight sync in progress);
- ``hang``: SIGSTOP server1 as generation starts (it stays up for the kernel, silent for HTTP).

Each records the job's end state, whether every step was trained once with full batches, the
job's fleet events (down / restarted / healthy and the time each server was down), the servers
the learner had per step, the probe's largest log-prob gap after the restart, and the steps/s
of the trial against the undisturbed run of the same engine. ``--doc`` writes the table into
the marked section of docs/cluster.md.

    python benchmarks/bench_fleet.py --engine reference sglang --doc docs/cluster.md

``sizes`` measures the fleet itself without Slurm: a weight update over the broadcast group with
2 and with 16 servers, and the update right after one member died (the group re-formed):

    python benchmarks/bench_fleet.py sizes --servers 2 16 --doc docs/cluster.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
BEGIN = "<!-- bench_fleet: begin (written by the benchmark; do not edit) -->"
END = "<!-- bench_fleet: end -->"
SIZES_BEGIN = "<!-- bench_fleet sizes: begin (written by the benchmark; do not edit) -->"
SIZES_END = "<!-- bench_fleet sizes: end -->"
KILLED_PORT = 31001  # server1 on node2


class Cluster:
    """A private two-node Slurm started and stopped with tools/slurm_local.sh."""

    def __init__(self, port: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gspo-slurm-fleet-", dir="/tmp"))
        self.dir.chmod(0o755)
        subprocess.run(["bash", str(REPO / "tools" / "slurm_local.sh"), "start", "--nodes", "2",
                        "--port", str(port), str(self.dir)], check=True, timeout=120)

    def env(self, **extra: str) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(SLURM_CONF=str(self.dir / "slurm.conf"), GSPO_PYTHON=sys.executable,
                   OMP_NUM_THREADS="1", **extra)
        return env

    def run(self, *cmd: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=REPO, env=self.env(**extra), capture_output=True,
                              text=True, timeout=60)

    def job(self, job_id: str) -> Dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out.splitlines()[0])) if out.strip() else {}

    def wait(self, job_id: str, timeout_s: float) -> Dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                return info
            time.sleep(0.5)
        self.run("scancel", job_id)
        raise RuntimeError(f"job {job_id} not done after {timeout_s}s: {self.job(job_id)}")

    def stop(self) -> None:
        subprocess.run(["bash", str(REPO / "tools" / "slurm_local.sh"), "stop", str(self.dir)],
                       capture_output=True, timeout=120)
        shutil.rmtree(self.dir, ignore_errors=True)


def _rows(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []


def listener_pid(port: int) -> Optional[int]:
    """The process listening on ``port`` (``ss``), or None."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
    found = re.search(r"pid=(\d+)", out)
    return int(found.group(1)) if found else None


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


def overrides_for(engine: str, assets: Path, num_steps: int, num_servers: int = 2) -> List[str]:
    common = [f"data.train_path={assets}/data/train.jsonl", "data.eval_path=null",
              f"trainer.num_steps={num_steps}", "trainer.num_sft_steps=2", "trainer.sft_batch_size=8",
              "trainer.eval_every_steps=0", f"batch.num_prompts_per_step={2 * num_servers}",
              "batch.num_mini_batches=1",
              "rollout.n_samples_per_prompt=2", "checkpoint.save_every_steps=0",
              "logging.wandb.enabled=false", "logging.plot=false",
              "rollout.mode=disaggregated", "launch.num_learner_nodes=1", f"launch.devices_per_node={num_servers}",
              f"rollout.sglang.num_servers={num_servers}", "rollout.weight_sync.transport=nccl",
              "rollout.weight_sync.verify=true", "rollout.sglang.hang_timeout_s=6",
              "rollout.sglang.request_timeout_s=20", "reward.name=tests.paced_reward:tiny_addition"]
    if engine == "sglang":
        sglang_python = REPO / ".venv-sglang" / "bin" / "python"
        common += ["rollout.engine=sglang", "rollout.sglang.device=cpu",
                   f"rollout.sglang.python={sglang_python}", "rollout.sglang.max_total_tokens=4096"]
    else:
        common += ["rollout.engine=reference"]
    return common


def trial(cluster: Cluster, engine: str, fault: str, assets: Path, run_dir: Path, num_steps: int,
          at_step: int, num_servers: int = 2) -> dict:
    env = dict(GSPO_RUN_DIR=str(run_dir), GSPO_HF_DIR=str(assets / "model"), PYTHONPATH=str(REPO),
               GSPO_TEST_REWARD_SLEEP_S="0.4", GSPO_FLEET_PROBE_S="1", GSPO_FLEET_PROBE_MAX_S="3",
               GSPO_SERVER_RESTART_DELAY_S="1")
    proc = cluster.run("sbatch", "--parsable", "--nodes=2", f"--output={run_dir}.out", "slurm/tiny_cpu.sh",
                       *overrides_for(engine, assets, num_steps, num_servers), **env)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch: {proc.stderr}")
    job = proc.stdout.strip().split(";")[0]
    metrics, pause = run_dir / "metrics.jsonl", run_dir / "logs" / job / "fleet_paused.r0"
    hit_at = None
    if fault != "none":
        wait_until(lambda: max((r.get("step", 0) for r in _rows(metrics)), default=0) >= at_step - 1
                   or cluster.job(job).get("JobState") not in ("PENDING", "RUNNING"), 900,
                   f"step {at_step - 1}", poll_s=0.2)
        wait_until(pause.exists, 120, "the sync of the next step")  # the pause file: a sync runs
        if fault != "sync":
            wait_until(lambda: not pause.exists(), 120, "the end of that sync")
        pid = listener_pid(KILLED_PORT)
        if pid is None:
            raise RuntimeError(f"no process listens on {KILLED_PORT}")
        os.kill(pid, signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
        hit_at = time.time()
    info = cluster.wait(job, timeout_s=1800)
    if fault == "hang":
        try:
            os.kill(pid, signal.SIGCONT)  # the job should have killed it; never leave one stopped
        except ProcessLookupError:
            pass
    rows = [r for r in _rows(metrics) if r.get("step", 0) > 0]
    events = _rows(run_dir / "fleet_events.jsonl")
    step_s = [r["time/step_s"] for r in rows if "time/step_s" in r]
    probe = [r.get("weight_sync/probe_abs_logp") for r in rows]
    return {
        "engine": engine, "servers": num_servers, "fault": fault, "job": job,
        "at_step": at_step if fault != "none" else None,
        "hit_at": hit_at,
        "state": f"{info.get('JobState')} {info.get('ExitCode')}",
        "steps_once": [r["step"] for r in rows] == list(range(1, num_steps + 1)),
        "full_batches": all(r.get("rollout/num_sequences") == 4.0 * num_servers for r in rows),
        "events": [(e["server"], e["event"], e.get("code"), e.get("reason"), e.get("down_s")) for e in events],
        "live_servers": [r.get("rollout/live_servers") for r in rows],
        "server_restarts": rows[-1].get("rollout/server_restarts") if rows else None,
        "retries": sum(r.get("rollout/num_retries", 0.0) for r in rows),
        "probe_max": max((p for p in probe if p is not None), default=None),
        "step_s": step_s,
        "wall_s": sum(step_s),
    }


def table(trials: List[dict]) -> List[str]:
    base = {t["engine"]: t["wall_s"] for t in trials if t["fault"] == "none"}
    out = ["| engine | fault at step | job | every step once, full batches | fleet events (server: event, "
           "down s) | servers the learner had per step | probe max abs log-prob gap | RL steps' time vs "
           "undisturbed |", "|---|---|---|---|---|---|---|---|"]
    for t in trials:
        events = "; ".join(f"{s}: {e}" + (f" ({r})" if e == "down" else "") + (f" {d} s" if d is not None else "")
                           for s, e, _c, r, d in t["events"]) or "none"
        live = " ".join(f"{v:g}" if v is not None else "-" for v in t["live_servers"])
        ratio = t["wall_s"] / base[t["engine"]] if base.get(t["engine"]) else float("nan")
        probe = f"{t['probe_max']:.1e}" if t["probe_max"] is not None else "-"
        fault = t["fault"] if t["fault"] == "none" else f"{t['fault']} at {t['at_step']}"
        out.append(f"| {t['engine']} | {fault} | {t['state']} | "
                   f"{'yes' if t['steps_once'] and t['full_batches'] else 'NO'} | {events} | {live} | {probe} | "
                   f"{ratio:.2f}x ({t['wall_s']:.1f} s) |")
    return out


def markers(num_servers: int) -> Tuple[str, str]:
    """The doc section of a fleet of ``num_servers`` (2: the first one measured)."""
    if num_servers == 2:
        return BEGIN, END
    return (BEGIN.replace("bench_fleet:", f"bench_fleet {num_servers} servers:"),
            END.replace("bench_fleet:", f"bench_fleet {num_servers} servers:"))


def write_doc(doc: Path, trials: List[dict], command: str, num_steps: int, num_servers: int = 2) -> None:
    write_section(doc, *markers(num_servers), [
        "", f"Measured {datetime.date.today().isoformat()} by `{command}` "
        f"({os.cpu_count()} CPUs, the machine otherwise idle; {num_steps} RL steps per trial, "
        f"on-policy, {num_servers} learner ranks on node1 (the launch plan fills a node's devices: "
        f"`launch.devices_per_node={num_servers}`), {num_servers} servers on node2, "
        f"{2 * num_servers} prompts x 2 samples per step; a paced reward makes a step "
        "a few seconds; the fleet probes every 1 s, restarts 1 s after a death, "
        "`rollout.sglang.hang_timeout_s=6`). Time is the sum of the RL steps' `time/step_s` "
        "against the undisturbed run of the same engine.", "", *table(trials), ""])


def size_trial(num_servers: int, work: Path, repeats: int) -> dict:
    """One fleet of ``num_servers`` reference servers (processes) and this process as learner
    rank 0: the time of a weight update over the gloo broadcast group with every member, then
    of the update right after one member was killed (the pool drops it at ``begin``, the group
    is re-formed with the others), then of one more with the survivors."""
    import torch

    from gspo_megatron.config.schema import WeightSyncConfig
    from gspo_megatron.distributed.ports import free_port
    from gspo_megatron.rollout.sglang.engine import SGLangEngine
    from gspo_megatron.rollout.sglang.launcher import ServerLauncher
    from gspo_megatron.rollout.standin.launcher import reference_server_command
    from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model
    from gspo_megatron.weight_sync import build_transport

    torch.set_num_threads(1)
    model_dir = work / "model"
    if not model_dir.exists():
        save_tiny_model(*build_tiny_policy(seed=0), str(model_dir))
    launcher = ServerLauncher(str(work / f"logs{num_servers}"), env={"OMP_NUM_THREADS": "1"})
    for _ in range(num_servers):
        port = free_port()
        launcher.start(reference_server_command(str(model_dir), port, python=sys.executable),
                       f"127.0.0.1:{port}")
    engine = SGLangEngine(launcher.addresses, request_timeout_s=120, launcher=launcher)
    try:
        t0 = time.perf_counter()
        engine.wait_healthy(timeout_s=900)
        start_s = time.perf_counter() - t0
        transport = build_transport(WeightSyncConfig(transport="nccl", bucket_bytes=1 << 20), engine,
                                    "reference", mode="disaggregated", master_address="127.0.0.1")
        weights = build_tiny_policy(seed=1)[0].state_dict()

        def update(version: str) -> float:
            t = time.perf_counter()
            engine.update_weights(((n, w.clone()) for n, w in weights.items()), version)
            return time.perf_counter() - t

        first = update("v0")  # forms the group
        steady = sorted(update(f"v{i + 1}") for i in range(repeats))
        victim = launcher.servers[-1].process
        victim.kill()
        victim.wait(timeout=30)
        regroup = update("after-kill")
        members_after = len(engine.pool.members)
        world_after = transport.world_size
        steady_after = sorted(update(f"w{i}") for i in range(repeats))
    finally:
        engine.shutdown()
    return {"servers": num_servers, "start_s": start_s, "first_update_s": first,
            "update_s_median": steady[len(steady) // 2], "update_s": steady,
            "update_after_death_s": regroup, "members_after": members_after, "group_world_after": world_after,
            "update_s_median_after": steady_after[len(steady_after) // 2]}


def size_table(trials: List[dict]) -> List[str]:
    base = trials[0]["update_s_median"]
    out = ["| servers | all healthy after | first update (forms the group) | update, median of "
           f"{len(trials[0]['update_s'])} | vs {trials[0]['servers']} servers | update right after one "
           "member died (re-forms the group) | members, group ranks after | update after, median |",
           "|---|---|---|---|---|---|---|---|"]
    for t in trials:
        out.append(f"| {t['servers']} | {t['start_s']:.1f} s | {t['first_update_s']:.2f} s | "
                   f"{t['update_s_median']:.3f} s | {t['update_s_median'] / base:.1f}x | "
                   f"{t['update_after_death_s']:.2f} s | {t['members_after']}, {t['group_world_after']} | "
                   f"{t['update_s_median_after']:.3f} s |")
    return out


def write_section(doc: Path, begin: str, end: str, lines: List[str]) -> None:
    text = doc.read_text()
    block = "\n".join([begin, *lines, end])
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def main_sizes(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="bench_fleet.py sizes",
                                description="weight updates and a membership change against fleet size")
    p.add_argument("--servers", type=int, nargs="+", default=[2, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--work", type=Path, default=Path("/tmp/gspo-bench-fleet-sizes"))
    p.add_argument("--doc", type=Path)
    p.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "fleet_sizes.json")
    args = p.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    trials = []
    for n in args.servers:
        t = size_trial(n, args.work, args.repeats)
        print(json.dumps(t), flush=True)
        trials.append(t)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(trials, indent=1) + "\n")
    lines = size_table(trials)
    print("\n".join(lines))
    if args.doc:
        command = "python benchmarks/bench_fleet.py sizes " + shlex.join(argv)
        write_section(args.doc, SIZES_BEGIN, SIZES_END, [
            "", f"Measured {datetime.date.today().isoformat()} by `{command}` ({os.cpu_count()} CPUs, "
            "nothing else running): reference servers as processes on this host, the tiny model "
            "(0.5 MB of weights, 1 MiB buckets) over the gloo broadcast group, this process as "
            "learner rank 0. Times are wall clock and include each server's load.", "", *lines, ""])
    return 0


def main() -> int:
    if sys.argv[1:2] == ["sizes"]:
        return main_sizes(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", nargs="+", default=["reference"], choices=["reference", "sglang"])
    p.add_argument("--faults", nargs="+", default=["none", "generation", "sync", "hang"])
    p.add_argument("--num-steps", type=int, default=8)
    p.add_argument("--at-step", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("/tmp/gspo-bench-fleet"))
    p.add_argument("--port", type=int, default=17907)
    p.add_argument("--servers", type=int, default=2, help="rollout servers on node2 (server1 is hit)")
    p.add_argument("--doc", type=Path)
    p.add_argument("--json", type=Path, default=None,
                   help="default: benchmarks/results/fleet.json (fleet_<N>servers.json for N != 2)")
    args = p.parse_args()
    if args.servers < 2:
        p.error("--servers: at least 2 (server1 is the one hit)")
    if args.json is None:
        name = "fleet.json" if args.servers == 2 else f"fleet_{args.servers}servers.json"
        args.json = REPO / "benchmarks" / "results" / name
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    assets = args.work / "assets"
    subprocess.run([sys.executable, "tools/make_tiny_assets.py", str(assets), "--num-train", "64",
                    "--num-eval", "8"], cwd=REPO, check=True, capture_output=True, timeout=600)
    cluster = Cluster(args.port)
    trials = []
    try:
        for engine in args.engine:
            for fault in args.faults:
                run_dir = args.work / f"{engine}-{fault}"
                t = trial(cluster, engine, fault, assets, run_dir, args.num_steps, args.at_step,
                          args.servers)
                print(json.dumps(t), flush=True)
                trials.append(t)
    finally:
        cluster.stop()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(trials, indent=1) + "\n")
    print("\n".join(table(trials)))
    if args.doc:
        command = "python benchmarks/bench_fleet.py " + shlex.join(sys.argv[1:])
        write_doc(args.doc, trials, command, args.num_steps, args.servers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
