#!/usr/bin/env python
"""Expert volatility against depth: the fraction of activated experts that change after one RL
step's updates, for tiny MoEs of several depths (issue 31). Writes a figure and a Markdown table.

    python tools/volatility_vs_depth.py --out runs/depth --doc docs/volatility_vs_depth.md \\
        --figure docs/figures/volatility_vs_depth.png            # 2, 4, 8, 16 layers
    python tools/volatility_vs_depth.py --out /tmp/smoke --smoke   # 2 and 4 layers, 2 steps

The paper reports ~10% of activated experts changing per update on its 48-layer MoE and blames
that volatility for GRPO's collapse; on the 2-layer model of docs/paper_reproduction.md it is
~1%. Each depth runs the reproduction's setting (``configs/paper_tiny_moe.yaml``: 8 experts
top-2, 32 prompts x 8 samples, 4 mini-batches per step) with GRPO: a cold start capped
at ``--num-sft-steps`` (the same cap for every depth), then ``--num-steps`` RL steps, each
measuring ``routing/activated_expert_changed_frac`` (and the top-k set's
``routing/expert_set_changed_frac``) on 64 sequences before and after the step's updates
(``trainer/expert_volatility.py``). Each depth runs every ``--seeds`` seed (its own cold start);
the table gives the mean over seeds of each run's mean over steps, with the seeds' min-max.
Runs go two at a time, one thread each; a finished run is not run again.
Exit codes: 0 done, 1 a training run failed (its log is named), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from gspo_megatron.experiments.paper_reproduction import Settings, reproduce  # noqa: E402

ACTIVATED = "routing/activated_expert_changed_frac"
TOPK_SET = "routing/expert_set_changed_frac"
VARIANT = "grpo"
SMOKE = dict(num_steps=2, num_sft_steps=2,
             extra=("batch.num_prompts_per_step=4", "rollout.n_samples_per_prompt=4",
                    "algo.diagnostics.expert_volatility_num_seqs=4", "trainer.sft_batch_size=8"))


def run_depth(out: Path, depth: int, seed: int, num_steps: int, num_sft_steps: int,
              extra=()) -> List[dict]:
    """One depth's cold start and RL run for ``seed``; its metrics rows."""
    settings = Settings(out=out / f"layers{depth}", seeds=(seed,), variants=(VARIANT,),
                        num_steps=num_steps, num_sft_steps=num_sft_steps, eval_every_steps=0,
                        jobs=1, extra=tuple(extra), num_layers=depth)
    return reproduce(settings)[VARIANT][seed]


def run_summary(rows: List[dict], early: int) -> Dict[str, float]:
    """One run: means over all its RL steps and over the first ``early`` ones."""
    act = [r[ACTIVATED] for r in rows if ACTIVATED in r]
    top = [r[TOPK_SET] for r in rows if TOPK_SET in r]
    return {"steps": len(act), "activated_mean": statistics.fmean(act),
            "activated_std": statistics.pstdev(act), "activated_early": statistics.fmean(act[:early]),
            "activated_late": statistics.fmean(act[early:] or act),
            "topk_set_mean": statistics.fmean(top),
            "s_per_step": statistics.median([r["time/step_s"] for r in rows if "time/step_s" in r])}


def summarize(runs: List[List[dict]], early: int) -> Dict[str, float]:
    """One depth over its seeds: the mean of each run's values, and the seeds' min-max of the
    activated-experts mean."""
    per_run = [run_summary(rows, early) for rows in runs]
    out = {k: statistics.fmean(r[k] for r in per_run) for k in per_run[0]}
    out["activated_min"] = min(r["activated_mean"] for r in per_run)
    out["activated_max"] = max(r["activated_mean"] for r in per_run)
    out["seeds"] = len(per_run)
    return out


def write_figure(path: Path, results: Dict[int, Dict[str, float]],
                 curves: Dict[int, List[List[dict]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    depths = sorted(results)
    mean = [100 * results[d]["activated_mean"] for d in depths]
    left.errorbar(depths, mean, marker="o", capsize=3,
                  yerr=[[m - 100 * results[d]["activated_min"] for m, d in zip(mean, depths)],
                        [100 * results[d]["activated_max"] - m for m, d in zip(mean, depths)]],
                  label="activated experts changed (mean, seeds' min-max)")
    left.plot(depths, [100 * results[d]["topk_set_mean"] for d in depths], marker="s",
              label="top-k set changed")
    left.set_xscale("log", base=2)
    left.set_xticks(depths, [str(d) for d in depths])
    left.set_xlabel("layers")
    left.set_ylabel("% of (token, layer) pairs, per RL step")
    left.set_title("Expert volatility against depth (GRPO, tiny MoE)")
    left.legend(fontsize=8)
    for d in depths:
        rows = [r for r in curves[d][0] if ACTIVATED in r]
        right.plot([r["step"] for r in rows], [100 * r[ACTIVATED] for r in rows], label=f"{d} layers")
    right.set_xlabel("RL step")
    right.set_ylabel("activated experts changed (%)")
    right.set_title("Per step, first seed")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(results: Dict[int, Dict[str, float]], args, minutes: float, figure: str) -> str:
    seeds = " ".join(str(k) for k in args.seeds)
    lines = ["# Expert volatility against depth", "",
             f"Written by `python tools/volatility_vs_depth.py --out {args.out} --seeds {seeds} --doc "
             f"{args.doc} --figure {args.figure}` on {time.strftime('%Y-%m-%d')} ({os.cpu_count()} CPU "
             f"cores, shared), {minutes:.0f} min. Setting: the module docstring of the tool; GRPO, "
             f"cold start capped at {args.num_sft_steps} SFT steps (it stops at the loss target), "
             f"{args.num_steps} RL steps; 'early' is steps 1-{args.early}. Each value is the mean over "
             f"the {len(args.seeds)} seeds of each run's mean over its steps.", "",
             "| layers | steps | activated experts changed: mean (seeds' min-max) | stdev over steps "
             "| early | late | top-k set changed | s / step |", "|---|---|---|---|---|---|---|---|"]
    for d in sorted(results):
        r = results[d]
        lines.append(f"| {d} | {r['steps']:.0f} | {100 * r['activated_mean']:.2f}% "
                     f"({100 * r['activated_min']:.2f}-{100 * r['activated_max']:.2f}) | "
                     f"{100 * r['activated_std']:.2f} | {100 * r['activated_early']:.2f}% | "
                     f"{100 * r['activated_late']:.2f}% | {100 * r['topk_set_mean']:.2f}% | "
                     f"{r['s_per_step']:.2f} |")
    return "\n".join(lines + ["", f"![volatility against depth]({figure})", ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/depth"))
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--num-steps", type=int, default=50)
    parser.add_argument("--num-sft-steps", type=int, default=1200,
                        help="cold-start cap (it stops earlier at trainer.sft_stop_loss)")
    parser.add_argument("--early", type=int, default=10, help="steps counted as early")
    parser.add_argument("--jobs", type=int, default=2, help="depths at once (one thread each)")
    parser.add_argument("--doc", type=Path, help="write the Markdown table here")
    parser.add_argument("--figure", type=Path, help="default: <out>/volatility_vs_depth.png")
    parser.add_argument("--smoke", action="store_true", help="2 and 4 layers, 2 steps (CI)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.smoke:
        args.depths, args.num_steps, args.num_sft_steps, args.early = [2, 4], 2, 2, 1
        args.seeds = args.seeds[:1]
    if min(args.depths) < 1 or args.num_steps < 1 or args.num_sft_steps < 1:
        parser.error("--depths, --num-steps and --num-sft-steps must be >= 1")
    args.figure = args.figure or args.out / "volatility_vs_depth.png"
    extra = SMOKE["extra"] if args.smoke else ()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
            futures = {(d, seed): pool.submit(run_depth, args.out, d, seed, args.num_steps,
                                              args.num_sft_steps, extra)
                       for d in sorted(args.depths, reverse=True)  # the slowest first
                       for seed in args.seeds}
            curves = {d: [futures[d, seed].result() for seed in args.seeds] for d in args.depths}
    except RuntimeError as exc:
        logging.error("%s", exc)
        return 1
    results = {d: summarize(rows, args.early) for d, rows in curves.items()}
    write_figure(args.figure, results, curves)
    if args.doc:
        figure = os.path.relpath(args.figure, args.doc.parent)
        args.doc.write_text(markdown(results, args, (time.monotonic() - start) / 60, figure))
    for d in sorted(results):
        logging.info("%2d layers: %.2f%% activated experts changed per step (seeds %.2f-%.2f), "
                     "top-k set %.2f%%", d, 100 * results[d]["activated_mean"],
                     100 * results[d]["activated_min"], 100 * results[d]["activated_max"],
                     100 * results[d]["topk_set_mean"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
