#!/usr/bin/env python
"""The tiny GSPO run with the embedded engine and with the real SGLang server, side by side.

    make sglang-venv && .venv/bin/python tools/compare_rollout_engines.py [--seeds 1 2 3] [--num-steps 100]

For each seed, ``gspo-train configs/tiny_cpu.yaml`` runs the same cold start and ``--num-steps``
GSPO steps twice: rollouts from the embedded engine (in-process transformers, weights copied in
place) and from a real SGLang 0.5.23 server on CPU that the trainer launches
(``rollout.engine=sglang rollout.sglang.device=cpu``, gloo broadcast of the weights after every
step). Both use ``algo.old_logprob_source=learner``, so every step also logs how far the engine's
log-probs are from the learner's recomputation of the same tokens. Writes
``docs/real_sglang_training.md``: held-out accuracy after the cold start and at the end, mean
reward of the first and last 10 steps, the per-token log-prob gap, seconds per step. Sampling on
the real server is not seeded (SGLang honours ``sampling_seed`` only with deterministic
inference), so the two engines' trajectories differ as two seeds do.

Exit codes: 0 done, 1 a run failed (its log is named).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gspo_megatron.distributed.ports import free_port

REPO = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"

ENGINES = {
    "embedded": [],
    "real SGLang": ["rollout.engine=sglang", "rollout.mode=disaggregated",
                    "rollout.sglang.device=cpu", f"rollout.sglang.python={SGLANG_PYTHON}",
                    "rollout.sglang.max_total_tokens=8192", "rollout.sglang.port={port}",
                    "rollout.weight_sync.transport=nccl",
                    "rollout.weight_sync.master_address=127.0.0.1"],
}


def run(out: Path, engine: str, seed: int, num_steps: int) -> dict:
    run_dir = out / f"{engine.replace(' ', '_').lower()}_seed{seed}"
    overrides = [f"trainer.seed={seed}", f"trainer.num_steps={num_steps}", f"logging.run_dir={run_dir}",
                 "logging.wandb.enabled=false", "logging.plot=false", "checkpoint.save_every_steps=0",
                 "algo.old_logprob_source=learner", f"trainer.eval_every_steps={num_steps}",
                 *(o.format(port=free_port()) for o in ENGINES[engine])]
    log_path = out / f"{run_dir.name}.log"
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        code = subprocess.run([sys.executable, "-m", "gspo_megatron.cli.train",
                               str(REPO / "configs" / "tiny_cpu.yaml"), *overrides],
                              env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{engine} seed {seed} exited {code}: see {log_path}")
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steps = [r for r in rows if r["step"] >= 1]
    gaps = [r["rollout/learner_vs_engine_abs_logp"] for r in steps]
    return {"engine": engine, "seed": seed, "wall_s": time.perf_counter() - t0,
            "acc_sft": rows[0]["eval/accuracy"], "acc_end": rows[-1]["eval/accuracy"],
            "reward_first": statistics.mean(r["reward/mean"] for r in steps[:10]),
            "reward_last": statistics.mean(r["reward/mean"] for r in steps[-10:]),
            "gap_mean": statistics.mean(gaps), "gap_max": max(gaps),
            "step_s": statistics.median(r["time/step_s"] for r in steps if "time/step_s" in r)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--num-steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "compare_engines")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "real_sglang_training.md")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not (REPO / "runs" / "tiny_assets" / "model" / "config.json").exists():  # as `make demo`
        subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_assets.py"),
                        str(REPO / "runs" / "tiny_assets")], check=True)
    results = []
    try:
        for seed in args.seeds:
            for engine in ENGINES:
                results.append(run(args.out, engine, seed, args.num_steps))
                print(json.dumps(results[-1]), flush=True)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    lines = ["# The tiny GSPO run: embedded engine vs the real SGLang server (measured)", "",
             f"Written by `python tools/compare_rollout_engines.py --seeds "
             f"{' '.join(map(str, args.seeds))} --num-steps {args.num_steps}` on "
             f"{datetime.date.today().isoformat()} ({os.cpu_count()}-core CPU machine, one run at a "
             "time). `configs/tiny_cpu.yaml` (cold start to loss 0.6, then GSPO, 32 prompts x 8 "
             f"samples, 4 mini-batches) for {args.num_steps} steps with "
             "`algo.old_logprob_source=learner`; the real server is launched by the trainer "
             "(`rollout.sglang.device=cpu`) and receives the weights through a gloo broadcast "
             "group after every step. Held-out greedy accuracy on the 200 eval problems.", "",
             "| engine | seed | accuracy after SFT | accuracy at the end | reward, first 10 steps "
             "| reward, last 10 steps | learner vs engine log-prob, mean / max of step means "
             "| s / step (median) | run s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['engine']} | {r['seed']} | {100 * r['acc_sft']:.1f}% | "
                     f"{100 * r['acc_end']:.1f}% | {r['reward_first']:.3f} | {r['reward_last']:.3f} | "
                     f"{r['gap_mean']:.1e} / {r['gap_max']:.1e} | {r['step_s']:.2f} | {r['wall_s']:.0f} |")
    for engine in ENGINES:
        ends = [100 * r["acc_end"] for r in results if r["engine"] == engine]
        lines.append("")
        lines.append(f"- {engine}: accuracy at the end {min(ends):.1f}-{max(ends):.1f}% over "
                     f"{len(ends)} seeds (median {statistics.median(ends):.1f}%)")
    args.doc.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
