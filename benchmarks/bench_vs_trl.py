"""gspo-train against TRL's GRPOTrainer on the same tiny MoE, side by side, in one invocation.

    python benchmarks/bench_vs_trl.py                          # 8 prompts x 8 samples, 10 steps, 3 rounds
    python benchmarks/bench_vs_trl.py --batch-scale 4          # 32 prompts x 8 samples
    python benchmarks/bench_vs_trl.py --sides trl,gspo_overlap --rounds 5
    python benchmarks/bench_vs_trl.py --sweep --doc docs/performance.md --readme README.md

``--sweep`` (``benchmarks/bench_vs_trl_sweep.py``) runs several model and batch shapes, every
side at its own best thread setting on the whole machine, and writes its table into the
marked section of ``--doc``. The rest of this docstring is the single-shape mode; the setup and
the harness that runs a side are ``benchmarks/vs_trl_setup.py``'s, shared with the sweep.

The setup (both sides): a random-init Qwen3-MoE (4 layers, hidden 128, 4 heads / 2 KV heads of
dim 32, 8 experts top-2 of width 64, ~0.99 M parameters) with the character tokenizer of the tiny
addition task, written once by ``gspo_megatron.tiny_task``; the addition prompts; 8 prompts x 8
samples per RL step (x ``--batch-scale``), at most 16 new tokens, temperature 1; the rollout
batch split into 4 mini-batches (4 optimizer steps per RL step); sequence-level importance
ratios clipped at 3e-4 / 4e-4 (GSPO); group-normalised advantages; no KL; Adam at a constant
1e-5, no weight decay; the exact-match ``tiny_addition`` reward; ``--steps`` RL steps. gspo-train's
expert-volatility diagnostic (``algo.diagnostics.expert_volatility_num_seqs``) is off unless
``--with-diagnostics``: TRL has no counterpart.

Sides:
- ``trl``: TRL ``GRPOTrainer`` (``importance_sampling_level="sequence"``, ``loss_type="grpo"``,
  ``epsilon=3e-4``, ``epsilon_high=4e-4``, ``steps_per_generation=4``, ``beta=0``), run in its
  own virtual environment, created here on first use (``--trl-venv``; ``pip install
  torch==<this torch> trl==<--trl-version>``): TRL is not a dependency of gspo-megatron.
- ``gspo``: ``gspo-train configs/tiny_cpu.yaml`` on-policy, old log-probs from the engine.
- ``gspo_overlap``: the same with ``rollout.overlap_one_step=true``.
- ``gspo_learner_lp``: on-policy, old log-probs recomputed by the learner.

Every side runs in a fresh process with the same ``OMP_NUM_THREADS`` (``--threads``; the overlap's
learner gives the engine's process its thread, ``rollout.overlap_thread_split=share``); rounds
interleave the sides (A B C, then C B A, ...), since the machine may be shared. Per run: seconds
per RL step (median over steps 2..N: step 1 pays one-off warm-up), generated tokens per second
(response tokens of steps 2..N over their time) and whole-process time (spawn to exit, including
imports, model load and, for gspo-train, the final checkpoint and HF export). The table gives
the median over rounds and each side's RL steps per second relative to TRL.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

try:
    from benchmarks.vs_trl_setup import GSPO_SIDES, REPO, ensure_trl_venv, make_assets, run_side
except ImportError:  # run as a script, with benchmarks/ on sys.path
    from vs_trl_setup import GSPO_SIDES, REPO, ensure_trl_venv, make_assets, run_side


def summarise(results: list, sides: list) -> str:
    med = {s: {k: statistics.median(r[k] for r in results if r["side"] == s)
               for k in ("step_s_median", "tokens_per_s", "whole_process_s")} for s in sides}
    base = med.get("trl")
    lines = ["| side | s / RL step | generated tokens / s | whole process (s) | RL steps/s vs TRL |",
             "|---|---|---|---|---|"]
    for s in sides:
        m = med[s]
        ratio = f"{base['step_s_median'] / m['step_s_median']:.2f}x" if base else "-"
        lines.append(f"| {s} | {m['step_s_median']:.3f} | {m['tokens_per_s']:.0f} | "
                     f"{m['whole_process_s']:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sides", default=None,
                   help="comma-separated (default trl,gspo,gspo_overlap; --sweep: "
                        "trl,gspo,gspo_learner_lp,gspo_overlap)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved repeats of every side (default 3; --sweep: of each side's winner)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 10; --sweep: 6)")
    p.add_argument("--batch-scale", type=int, default=1, help="prompts per step = 8 x this")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of every side (1: with two threads a busy machine makes "
                        "OpenMP's barriers spin; both sides slowed down >10x in such runs)")
    p.add_argument("--with-diagnostics", action="store_true",
                   help="keep gspo-train's expert-volatility diagnostic on (two extra forward "
                        "passes per step; TRL computes nothing like it, so it is off by default)")
    p.add_argument("--work", default=str(REPO / "runs" / "bench_vs_trl"))
    p.add_argument("--trl-venv", default=None, help="default: <work>/trl_venv")
    p.add_argument("--trl-version", default="1.16.0")
    p.add_argument("--sweep", action="store_true",
                   help="several shapes, each side at its best thread setting "
                        "(benchmarks/bench_vs_trl_sweep.py; --rounds, --steps, --sides apply)")
    p.add_argument("--shapes", default=None,
                   help="--sweep: comma-separated names (default: all of bench_vs_trl_sweep.SHAPES)")
    p.add_argument("--doc", default=None,
                   help="--sweep: a markdown file whose marked section gets the results")
    p.add_argument("--readme", default=None,
                   help="--sweep: a markdown file whose marked headline gets the range")
    p.add_argument("--results", default=None,
                   help="--sweep: also write the run's record here (the committed one: "
                        "benchmarks/results/vs_trl_sweep.json), which the headline cites")
    p.add_argument("--from-results", default=None,
                   help="--sweep: render this finished sweep's results.json, measure nothing")
    args = p.parse_args(argv)
    args.steps = args.steps or (6 if args.sweep else 10)
    args.rounds = args.rounds or 3
    if args.sweep:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_vs_trl_sweep import DEFAULTS, run_sweep

        args.sides = args.sides or DEFAULTS["sides"]
        return run_sweep(args)
    args.sides = args.sides or "trl,gspo,gspo_overlap"
    args.prompts = 8 * args.batch_scale
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s != "trl" and s not in GSPO_SIDES]
    if unknown or args.steps < 2 or args.rounds < 1:
        p.error(f"unknown sides {unknown}" if unknown else "--steps must be >= 2, --rounds >= 1")
    work = Path(args.work)
    assets = make_assets(work / "assets")
    trl_python = ensure_trl_venv(Path(args.trl_venv or work / "trl_venv"), args.trl_version) \
        if "trl" in sides else Path()
    results = []
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            res = run_side(side, args, assets, work / f"x{args.batch_scale}", trl_python, r)
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "step_s_all"}), flush=True)
    table = summarise(results, sides)
    print(f"\n{args.prompts} prompts x {args.samples} samples, {args.steps} steps, "
          f"OMP_NUM_THREADS={args.threads}, medians of {args.rounds} rounds\n{table}")
    out = work / f"results_x{args.batch_scale}.json"
    out.write_text(json.dumps({"args": vars(args), "results": results, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
