"""Does one-step off-policy training learn like on-policy training? The tiny task, several seeds.

    python benchmarks/bench_overlap_learning.py                      # seeds 1,2,3, 200 RL steps
    python benchmarks/bench_overlap_learning.py --seeds 1,2 --steps 100 algo.clip_eps_high=0.01

For each seed, ``gspo-train configs/tiny_cpu.yaml`` runs twice, with ``rollout.overlap_one_step``
false and true (interleaved, same seed: same cold-start SFT, same prompts), and the script reads
each run's ``metrics.jsonl``: held-out greedy accuracy after SFT and after the last RL step, the
mean training reward of the last 20 steps, the mean sequence clip fraction and the mean step
time. It prints one row per run and the mean over seeds per mode. Extra arguments are passed to
gspo-train as overrides (both modes). Assets come from ``tools/make_tiny_assets.py`` (written to
``<work>/assets`` when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(seed: int, overlap: bool, args, assets: Path, work: Path) -> dict:
    run_dir = work / f"seed{seed}_{'overlap' if overlap else 'onpolicy'}"
    cmd = [sys.executable, "-m", "gspo_megatron.cli.train", str(REPO / "configs" / "tiny_cpu.yaml"),
           f"model.hf_path={assets / 'model'}", f"data.train_path={assets / 'data' / 'train.jsonl'}",
           f"data.eval_path={assets / 'data' / 'eval.jsonl'}", f"logging.run_dir={run_dir}",
           "logging.wandb.enabled=false", "logging.plot=false", f"trainer.seed={seed}",
           f"trainer.num_steps={args.steps}", "trainer.eval_every_steps=0",
           "checkpoint.save_every_steps=0", "checkpoint.resume=never",
           f"rollout.overlap_one_step={str(overlap).lower()}", *args.overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed} overlap={overlap} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if r["step"] >= 1]
    return {"seed": seed, "overlap": overlap, "acc_after_sft": evals[0]["eval/accuracy"],
            "acc_final": evals[-1]["eval/accuracy"],
            "reward_last20": statistics.mean(r["reward/mean"] for r in steps[-20:]),
            "clip_frac_seq": statistics.mean(r.get("train/clip_frac_seq", 0.0) for r in steps),
            "step_s": statistics.mean(r["time/step_s"] for r in steps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default=str(REPO / "runs" / "overlap_learning"))
    p.add_argument("overrides", nargs="*", help="gspo-train overrides for both modes")
    args = p.parse_args(argv)
    work = Path(args.work)
    assets = work / "assets"
    if not (assets / "model" / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_assets.py"), str(assets)],
                       check=True)
    results = []
    for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
        for overlap in ((False, True) if i % 2 == 0 else (True, False)):
            results.append(run(seed, overlap, args, assets, work))
            print(json.dumps(results[-1]), flush=True)
    keys = ("acc_after_sft", "acc_final", "reward_last20", "clip_frac_seq", "step_s")
    print("\n| mode | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for overlap in (False, True):
        mine = [r for r in results if r["overlap"] == overlap]
        cells = []
        for k in keys:
            values = [r[k] for r in mine]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.3f} ± {spread:.3f}")
        print(f"| {'overlap' if overlap else 'on-policy'} | " + " | ".join(cells) + " |")
    (work / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
