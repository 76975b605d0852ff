#!/usr/bin/env python
"""Preemption trials on a real local Slurm (``tools/slurm_local.sh``) with the real trainer at the
production ratio: a step several times longer than the batch shell's repeat interval.

Each trial submits ``slurm/tiny_cpu.sh`` with the tiny config (a reward that sleeps makes a step
~3 s: ``tests/paced_reward.py``), the batch shell's SIGUSR1 repeated every second
(``GSPO_USR1_REPEAT_S=1``), and sends SIGUSR1 to the batch shell (``scancel --signal=USR1
--batch``, what ``--signal=B:USR1@N`` does) once step ``k`` is logged, ``k`` = 2, 3, 4 over the
trials. A ``late`` trial first moves the job's end (``scontrol update EndTime``) to 22 s ahead with
``GSPO_REQUEUE_LEAD_S=20``: the learner has ~2 s, not enough for the rest of a step and a save,
so it drops the step or stops without a checkpoint (``trainer/deadline.py``). Every trial
records whether the step in progress was checkpointed (or which state was), whether the rerun
resumed from that checkpoint, whether every step was trained exactly once, and the job's end
state. ``--doc`` replaces the marked section of that file with the command, the conditions and
the table.

    python benchmarks/bench_preemption.py --work /tmp/preempt --doc docs/cluster.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
NUM_STEPS = 6
BEGIN = "<!-- bench_preemption: begin (written by the benchmark; do not edit) -->"
END = "<!-- bench_preemption: end -->"


class Cluster:
    """A private one-node Slurm started and stopped with tools/slurm_local.sh."""

    def __init__(self, port: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gspo-slurm-bench-", dir="/tmp"))
        self.dir.chmod(0o755)
        subprocess.run(["bash", str(REPO / "tools" / "slurm_local.sh"), "start", "--nodes", "1",
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
        """Until the job ends; a requeued one is released at once (as an operator would)."""
        deadline, released = time.monotonic() + timeout_s, set()
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                return info
            if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime" and \
                    info.get("Restarts") not in released:
                released.add(info.get("Restarts"))
                # a moved end time shortened the limit: give the rerun the script's hour back
                self.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=60")
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+3")
            time.sleep(0.5)
        raise RuntimeError(f"job {job_id} not done after {timeout_s}s: {self.job(job_id)}")

    def stop(self) -> None:
        subprocess.run(["bash", str(REPO / "tools" / "slurm_local.sh"), "stop", str(self.dir)],
                       capture_output=True, timeout=120)
        shutil.rmtree(self.dir, ignore_errors=True)


def _rows(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []


def trial(cluster: Cluster, assets: Path, run_dir: Path, after_step: int, late: bool) -> dict:
    """One preempted job; what happened to the step in progress and to the rerun."""
    overrides = [f"data.train_path={assets}/data/train.jsonl", "data.eval_path=null",
                 f"trainer.num_steps={NUM_STEPS}", "trainer.num_sft_steps=2",
                 "trainer.sft_batch_size=8", "trainer.eval_every_steps=0",
                 "batch.num_prompts_per_step=4", "batch.num_mini_batches=1",
                 "rollout.n_samples_per_prompt=2", "checkpoint.save_every_steps=0",
                 "logging.wandb.enabled=false", "logging.plot=false", "rollout.engine=embedded",
                 "rollout.weight_sync.transport=auto",
                 "reward.name=tests.paced_reward:tiny_addition"]
    env = dict(GSPO_RUN_DIR=str(run_dir), GSPO_HF_DIR=str(assets / "model"),
               GSPO_TEST_REWARD_SLEEP_S="0.4", GSPO_USR1_REPEAT_S="1",
               GSPO_REQUEUE_LEAD_S="20" if late else "60", PYTHONPATH=str(REPO))
    proc = cluster.run("sbatch", "--parsable", f"--output={run_dir}.out", "slurm/tiny_cpu.sh",
                       *overrides, **env)
    job = proc.stdout.strip().split(";")[0]
    metrics = run_dir / "metrics.jsonl"
    limit = time.monotonic() + 300
    while max((r["step"] for r in _rows(metrics)), default=0) < after_step:
        if time.monotonic() > limit:
            raise RuntimeError(f"job {job}: step {after_step} not logged: {cluster.job(job)}")
        time.sleep(0.2)
    if late:
        end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 22))
        cluster.run("scontrol", "update", f"JobId={job}", f"EndTime={end}")
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    info = cluster.wait(job, timeout_s=600)
    logs = run_dir / "logs" / job
    first = (logs / "learner.r0.log").read_text(errors="replace")
    batch = (logs / "batch.log").read_text(errors="replace")
    saved = re.search(r"checkpointed step (\d+) after SIGUSR1", first)
    dropped = re.search(r"dropped step (\d+) .* checkpointed the state after step (\d+)", first)
    rerun = logs / "learner.r1.log"
    resumed = re.search(r"resumed from \S+/step_(\d+) \(step", rerun.read_text(errors="replace")) \
        if rerun.exists() else None
    trained = [r["step"] for r in _rows(metrics) if r.get("step", 0) > 0]
    outcome = ("finished and saved" if saved else "dropped, saved the one before" if dropped
               else "stopped without a checkpoint")
    checkpoint = int(saved.group(1)) if saved else int(dropped.group(2)) if dropped else None
    return {"after_step": after_step, "late": late, "outcome": outcome,
            "checkpoint_step": checkpoint,
            "resumed_step": int(resumed.group(1)) if resumed else None,
            "repeats": batch.count("sending it again"),
            "steps_once": trained == list(range(1, NUM_STEPS + 1)),
            "state": f"{info.get('JobState')} {info.get('ExitCode')}, restarts {info.get('Restarts')}"}


def table(trials: List[dict]) -> List[str]:
    rows = ["| trial | SIGUSR1 | the step in progress | checkpoint | rerun resumed from | "
            "repeats seen | each step once | job |", "|---|---|---|---|---|---|---|---|"]
    for i, t in enumerate(trials, 1):
        when = f"after step {t['after_step']}" + (", end moved to 22 s ahead" if t["late"] else "")
        rows.append(f"| {i} | {when} | {t['outcome']} | step {t['checkpoint_step']} | "
                    f"step {t['resumed_step']} | {t['repeats']} | "
                    f"{'yes' if t['steps_once'] else 'NO'} | {t['state']} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--doc", default=None)
    parser.add_argument("--port", type=int, default=17857)
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    subprocess.run([sys.executable, "tools/make_tiny_assets.py", str(work / "assets"),
                    "--num-train", "64", "--num-eval", "8"], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    cluster = Cluster(args.port)
    try:
        trials = [trial(cluster, work / "assets", work / f"run{i}", after, late)
                  for i, (after, late) in enumerate([(2, False), (3, False), (4, False),
                                                      (2, True)])]
    finally:
        cluster.stop()
    rows = table(trials)
    print("\n".join(rows))
    (work / "trials.json").write_text(json.dumps(trials, indent=2))
    if args.doc:
        doc = Path(args.doc).read_text()
        head, rest = doc.split(BEGIN, 1)
        command = shlex.join(["python", "benchmarks/bench_preemption.py", *sys.argv[1:]])
        text = "\n".join([BEGIN, f"`{command}` ({started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} "
                                 "CPUs, one emulated node):", "", *rows, END])
        Path(args.doc).write_text(head + text + rest.split(END, 1)[1])
    return 0 if all(t["steps_once"] and t["resumed_step"] == t["checkpoint_step"]
                    for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
