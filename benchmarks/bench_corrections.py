#!/usr/bin/env python
"""Which mismatch correction by default: none, truncate or mask, per token or per sequence (issue 51, item 5).

    make sglang-venv && .venv/bin/python benchmarks/bench_corrections.py run [--settings engine stale]
                                                  [--seeds 1 2 3] [--num-steps 30]
    .venv/bin/python benchmarks/bench_corrections.py doc   # docs/algorithms.md from the results

Two settings, each with a real mismatch between the engine that samples and the fp32 learner
that trains, on the tiny addition task (``configs/tiny_cpu.yaml``), every run from its seed's
cold start (the config's SFT on the fp32 embedded engine, exported; ``bench_async``'s):

- ``engine``: on-policy (``rollout.max_staleness=0``), the embedded engine in bf16
  (``rollout.embedded_dtype=bf16``): the weight corrects the engine / learner mismatch only;
- ``stale``: ``rollout.max_staleness=4`` against a real SGLang 0.5.23 CPU server serving the
  weights in bf16 (``rollout.sglang.dtype=bfloat16``): staleness and the mismatch together.

Columns in each: ``algo.tis.mode`` off / truncate / mask at ``level`` token and sequence, cap 2
(the mask's band [1/2, 2]), the learner's old log-probs (a correction needs them). Per run:
held-out greedy accuracy at the end, the mean over steps of the sequence clip fraction, the
weight, the fraction truncated or masked, and the mismatch diagnostics (``mismatch_kl``, the
per-sequence mean of |engine - learner| log-prob, its per-sequence max, chi-square at sequence
level). Results: ``benchmarks/results/corrections.json``; the doc section between the markers
of docs/algorithms.md is written from it. Exit codes: 0 done, 1 a run failed (its log named),
2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_async  # noqa: E402  (the cold starts, the trainer launch, the real-server settings)

from gspo_megatron.distributed.ports import free_port  # noqa: E402

REPO = bench_async.REPO
RESULTS = REPO / "benchmarks" / "results" / "corrections.json"
DOC = REPO / "docs" / "algorithms.md"
BEGIN, END = "<!-- bench_corrections: begin -->", "<!-- bench_corrections: end -->"

SETTINGS: Dict[str, List[str]] = {
    "engine": ["rollout.max_staleness=0", "rollout.embedded_dtype=bf16"],
    "stale": ["rollout.max_staleness=4", *bench_async.REAL_SERVER, "rollout.sglang.dtype=bfloat16"],
}
"""Each setting's overrides on top of the cold start (the stale one also gets a free port)."""

COLUMNS = [("none", "off", "sequence"), ("truncate, token", "truncate", "token"),
           ("truncate, sequence", "truncate", "sequence"), ("mask, token", "mask", "token"),
           ("mask, sequence", "mask", "sequence")]
"""(label, algo.tis.mode, algo.tis.level); cap 2 for all."""

SERIES = {"clip_frac_seq": "train/clip_frac_seq", "tis_weight_mean": "train/tis_weight_mean",
          "tis_truncated_frac": "train/tis_truncated_frac", "tis_masked_frac": "train/tis_masked_frac",
          "mismatch_kl": "train/mismatch_kl", "mismatch_chi2_seq": "train/mismatch_chi2_seq",
          "mismatch_seq_token_abs_mean": "train/mismatch_seq_token_abs_mean",
          "mismatch_seq_token_abs_max_mean": "train/mismatch_seq_token_abs_max_mean",
          "masked_out_mini_batches": "train/masked_out_mini_batches"}
"""What each run reports (mean over its steps) and the metric it is read from."""


def column_overrides(mode: str, level: str) -> List[str]:
    return [f"algo.tis.mode={mode}", f"algo.tis.level={level}", "algo.tis.cap=2.0"]


def summarise(rows: Sequence[dict]) -> dict:
    """One run's row: the accuracies and the mean of each series over the GSPO steps. A series
    the run never logged (the fraction masked of a truncating run) is None, not 0."""
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    if not steps:
        raise ValueError("the run logged no GSPO step")
    evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
    out = {"acc_start": evals[0] if len(evals) > 1 else None, "acc_end": evals[-1] if evals else None,
           "reward_last10": statistics.fmean(r["reward/mean"] for r in steps[-10:])}
    for name, key in SERIES.items():
        values = [r[key] for r in steps if r.get(key) is not None]
        out[name] = statistics.fmean(values) if values else None
    return out


def run(args) -> List[dict]:
    out: List[dict] = []
    for seed in args.seeds:
        base = bench_async._from_cold_start(args.out, "uniform", seed)
        for setting in args.settings:
            for label, mode, level in COLUMNS:
                run_dir = args.out / f"{setting}_seed{seed}_{mode}_{level}"
                port = [f"rollout.sglang.port={free_port()}"] if setting == "stale" else []
                rows = bench_async._train(bench_async.WORKLOADS["uniform"], run_dir, [
                    *base, *SETTINGS[setting], *port, f"trainer.num_steps={args.num_steps}",
                    f"trainer.eval_every_steps={args.num_steps}", *column_overrides(mode, level)])
                out.append({"setting": setting, "column": label, "seed": seed, **summarise(rows)})
                print(json.dumps(out[-1]), flush=True)
    return out


def _fmt(values: List[float], scale: float = 1.0, digits: int = 3) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) * scale
    return f"{mean:.{digits}f}"


def write_doc(results: dict, doc: Path) -> str:
    """The measured section of docs/algorithms.md, "Which correction by default"."""
    c = results["conditions"]
    lines = [f"Written by `benchmarks/bench_corrections.py doc` from "
             f"`benchmarks/results/corrections.json`: `{c['command']}` on {c['date']}, commit "
             f"`{c['commit']}`, {c['cpus']} CPUs, {c['minutes']:.0f} min. {results['num_steps']} "
             "GSPO steps of 32 prompts x 8 samples from each seed's cold start (fp32 learner, "
             "learner old log-probs, cap 2); held-out greedy accuracy on the 200 eval problems. "
             "`engine`: on-policy, bf16 embedded engine; `stale`: k = 4 against a real SGLang "
             "CPU server serving bf16. Series are means over the steps, then over the seeds.", "",
             "| setting | column | " + " | ".join(f"seed {s}" for s in results["seeds"])
             + " | median | spread | clipped seq frac | weight mean | truncated / masked frac "
             "| mismatch KL | seq mean abs | seq max abs | chi2 seq | mini-batches masked out |",
             "|---|---|" + "---:|" * (len(results["seeds"]) + 10)]
    for setting in dict.fromkeys(r["setting"] for r in results["rows"]):
        for label, mode, _ in COLUMNS:
            rows = [r for r in results["rows"] if r["setting"] == setting and r["column"] == label]
            if not rows:
                continue
            acc = [100 * r["acc_end"] for r in rows]

            def series(name):
                return [r[name] for r in rows if r.get(name) is not None]
            bitten = series("tis_truncated_frac" if mode == "truncate" else "tis_masked_frac")
            lines.append(
                f"| {setting} | {label} | " + " | ".join(f"{a:.1f}%" for a in acc)
                + f" | {statistics.median(acc):.1f}% | {min(acc):.1f}-{max(acc):.1f}% "
                f"| {_fmt(series('clip_frac_seq'))} | {_fmt(series('tis_weight_mean'), digits=4)} "
                f"| {_fmt(bitten, digits=4) if mode != 'off' else '-'} "
                f"| {_fmt(series('mismatch_kl'), digits=6)} "
                f"| {_fmt(series('mismatch_seq_token_abs_mean'), digits=5)} "
                f"| {_fmt(series('mismatch_seq_token_abs_max_mean'), digits=4)} "
                f"| {_fmt(series('mismatch_chi2_seq'), digits=6)} "
                f"| {_fmt(series('masked_out_mini_batches'), digits=2)} |")
    starts = {r["seed"]: r["acc_start"] for r in results["rows"] if r.get("acc_start") is not None}
    if starts:
        lines += ["", "Accuracy after the cold start, per seed: "
                  + ", ".join(f"seed {s} {100 * a:.1f}%" for s, a in sorted(starts.items())) + "."]
    text = "\n".join(lines)
    page = doc.read_text()
    if BEGIN not in page or END not in page:
        raise ValueError(f"{doc} lacks the markers {BEGIN} / {END} of the measured section")
    head, rest = page.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    return text


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("run", "doc"))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--num-steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_corrections")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args(argv)
    if args.part == "run":
        if "stale" in args.settings and not bench_async.SGLANG_PYTHON.exists():
            print(f"error: {bench_async.SGLANG_PYTHON} is missing; run `make sglang-venv`",
                  file=sys.stderr)
            return 2
        args.out.mkdir(parents=True, exist_ok=True)
        started, load, commit = time.time(), os.getloadavg()[0], bench_async._commit()
        try:
            rows = run(args)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        conditions = bench_async._conditions(argv, started, load, commit)
        conditions["command"] = "python benchmarks/bench_corrections.py " + " ".join(argv)
        results = {"rows": rows, "num_steps": args.num_steps, "seeds": args.seeds,
                   "conditions": conditions}
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1) + "\n")
    elif not args.results.exists():
        print(f"error: {args.results} is missing; run the `run` part first", file=sys.stderr)
        return 2
    try:
        print(write_doc(json.loads(args.results.read_text()), args.doc))
    except (ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
