#!/usr/bin/env python
"""Asynchronous rollouts against the real SGLang CPU server: speed by staleness k, and learning.

    make sglang-venv && .venv/bin/python benchmarks/bench_async.py speed  [--ks 0 1 2 4] [--num-steps 12]
    .venv/bin/python benchmarks/bench_async.py parity [--seeds 1 2 3] [--num-steps 40]
    .venv/bin/python benchmarks/bench_async.py lengths [--seeds 1 2 3] [--num-steps 12]
    .venv/bin/python benchmarks/bench_async.py doc      # docs/async_rollouts.md from the results

**speed**: for each workload (``uniform``: the tiny addition task, responses of 2-4 tokens;
``longtail``: the repeat task of ``configs/tiny_longtail.yaml``, answers of 2-30+ tokens), one
cold start (embedded engine, the config's SFT) is exported, then ``gspo-train`` runs
``--num-steps`` GSPO steps from it once per k, one run after the other on the same machine,
against a real SGLang 0.5.23 server on CPU that the trainer launches (weights through a gloo
broadcast after every update). Every column does the same work per step: 32 prompts x 8
samples, the learner's old-log-prob pass (``algo.old_logprob_source=learner``), 4 mini-batches.
Thread split, the same for every column: the trainer and the server each run torch with one
thread (``OMP_NUM_THREADS=1``) on a 2-core machine. Steps/s and trained tokens/s are taken over
the steps after ``--warmup-steps`` (the first steps fill the pipeline); where the time goes:
the mean per step of the rollout wait, the old-log-prob pass, the update and the weight sync
(of which the servers' pause).

**parity**: held-out accuracy of the tiny task after ``--num-steps`` GSPO steps from each seed's
cold start, for k = 0, 1, 2, 4 with the decoupled objective (``algo.tis`` at sequence level,
cap 2) and for k = 4 without the behaviour weight; the spread over seeds.

**lengths**: the long-tail task (``configs/tiny_longtail.yaml``, answers of 1-40 digits) at
k = 0 and k = 4 from each seed's cold start: the mean length of the responses each step
*trained*, the groups dropped as too old, and which prompts were trained (the ledger) with
their reference answers' lengths. A taking rule that prefers the groups that finish first
(short answers) would drop long ones and train shorter responses per prompt at k = 4 than
on-policy; the earliest-deadline-first rule (issue 51) drops none. What it cannot help: the
groups still generating when the run ends are the long ones, so a short run at k = 4 trains a
set of prompts with shorter answers than the on-policy run's; the response length *per answer
length* compares the two on what each trained. ``--reuse-runs`` re-reads finished runs.

Results go to ``benchmarks/results/async.json`` (each part replaces its own entries) and the doc
is written from that file. Exit codes: 0 done, 1 a run failed (its log is named), 2 bad usage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

from gspo_megatron.distributed.ports import free_port

REPO = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
RESULTS = REPO / "benchmarks" / "results" / "async.json"
DOC = REPO / "docs" / "async_rollouts.md"
WORKLOADS = {"uniform": "tiny_cpu.yaml", "longtail": "tiny_longtail.yaml"}
ASSET_TASKS = {"uniform": [], "longtail": ["--task", "repeat"]}
THREADS = "1"
"""torch threads of the trainer and of the server it launches (OMP_NUM_THREADS), every column."""
REAL_SERVER = ["rollout.engine=sglang", "rollout.mode=disaggregated", "rollout.sglang.device=cpu",
               f"rollout.sglang.python={SGLANG_PYTHON}", "rollout.sglang.max_total_tokens=16384",
               "rollout.weight_sync.transport=nccl", "rollout.weight_sync.master_address=127.0.0.1"]
QUIET = ["logging.wandb.enabled=false", "logging.plot=false", "checkpoint.save_every_steps=0",
         "algo.old_logprob_source=learner"]


def staleness_overrides(k: int, corrected: bool = True) -> List[str]:
    """The column's settings: k, and the behaviour weight for k >= 2 (what ``algo.tis.mode=auto``
    gives there, spelt out), or the uncorrected ablation by name when ``corrected`` is off."""
    out = [f"rollout.max_staleness={k}"]
    if k >= 2:
        out += (["algo.tis.mode=truncate", "algo.tis.level=sequence", "algo.tis.cap=2.0"]
                if corrected else ["algo.tis.mode=off"])
    return out


def _train(config: str, run_dir: Path, overrides: Sequence[str]) -> List[dict]:
    """One fresh ``gspo-train`` in its own process (a run directory left by an earlier
    invocation is removed: resuming it would train nothing and return its old rows); its
    metrics rows. RuntimeError naming the log."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = run_dir.with_suffix(".log")
    env = dict(os.environ, OMP_NUM_THREADS=THREADS, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "gspo_megatron.cli.train", str(REPO / "configs" / config),
           f"logging.run_dir={run_dir}", *QUIET, *overrides]
    with open(log_path, "wb") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=3600).returncode
    if code != 0:
        raise RuntimeError(f"{run_dir.name} exited {code}: see {log_path}")
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _assets(out: Path, workload: str) -> Path:
    target = out / f"assets_{workload}"
    if not (target / "model" / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_assets.py"), str(target),
                        *ASSET_TASKS[workload]], check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    return target


def _cold_start(out: Path, workload: str, seed: int) -> Path:
    """The config's SFT on the embedded engine, exported: every column starts from it."""
    assets = _assets(out, workload)
    run_dir = out / f"{workload}_sft_seed{seed}"
    export = run_dir / "hf_export"
    if not (export / "config.json").exists():
        _train(WORKLOADS[workload], run_dir, [
            f"model.hf_path={assets / 'model'}", f"data.train_path={assets / 'data' / 'train.jsonl'}",
            f"data.eval_path={assets / 'data' / 'eval.jsonl'}", f"trainer.seed={seed}",
            "trainer.num_steps=0"])
    return export


def _from_cold_start(out: Path, workload: str, seed: int) -> List[str]:
    assets = _assets(out, workload)
    return [f"model.hf_path={_cold_start(out, workload, seed)}",
            f"data.train_path={assets / 'data' / 'train.jsonl'}",
            f"data.eval_path={assets / 'data' / 'eval.jsonl'}", "trainer.num_sft_steps=0",
            f"trainer.seed={seed}"]


def _mean(rows: List[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r and r[key] is not None]
    return statistics.fmean(values) if values else 0.0


def _weight(rows: List[dict]) -> str:
    """The mean behaviour weight, or '-' for columns without one (no ``algo.tis``)."""
    values = [r["tis_weight_mean"] for r in rows if r.get("tis_weight_mean")]
    return f"{statistics.fmean(values):.3f}" if values else "-"


def speed_row(rows: List[dict], warmup: int) -> Dict[str, float]:
    """Steps/s, trained tokens/s and the time split over the steps after ``warmup``."""
    steps = [r for r in rows if r["step"] > warmup and "time/step_s" in r]
    if not steps:
        raise ValueError(f"no step after the {warmup} warm-up steps")
    seconds = sum(r["time/step_s"] for r in steps)
    tokens = sum(r["rollout/num_sequences"] * r["rollout/response_len_mean"] for r in steps)
    lengths = [r["rollout/response_len_max"] for r in steps]
    return {"steps": len(steps), "seconds": seconds, "steps_per_s": len(steps) / seconds,
            "tokens_per_s": tokens / seconds, "response_len_mean": _mean(steps, "rollout/response_len_mean"),
            "response_len_max": max(lengths),
            "wait_s": _mean(steps, "time/rollout_wait_s"), "old_logprobs_s": _mean(steps, "time/old_logprobs_s"),
            "update_s": _mean(steps, "time/update_s"), "sync_s": _mean(steps, "time/weight_sync_s"),
            "pause_s": _mean(steps, "weight_sync/pause_s"), "lag_mean": _mean(steps, "async/lag_mean"),
            "multi_version_frac": _mean(steps, "async/multi_version_sample_frac"),
            "dropped_stale": sum(r.get("async/dropped_stale_groups", 0.0) for r in steps),
            "reward_mean": _mean(steps, "reward/mean")}


def run_speed(args) -> List[dict]:
    out: List[dict] = []
    for workload in args.workloads:
        base = _from_cold_start(args.out, workload, args.seed)
        for k in args.ks:
            run_dir = args.out / f"speed_{workload}_k{k}"
            rows = _train(WORKLOADS[workload], run_dir, [
                *base, *REAL_SERVER, f"rollout.sglang.port={free_port()}",
                f"trainer.num_steps={args.num_steps}", "trainer.eval_every_steps=0",
                *staleness_overrides(k)])
            out.append({"workload": workload, "k": k, **speed_row(rows, args.warmup_steps)})
            print(json.dumps(out[-1]), flush=True)
    return out


PARITY_COLUMNS = [("k=0", 0, True), ("k=1", 1, True), ("k=2", 2, True), ("k=4", 4, True),
                  ("k=4, no behaviour weight", 4, False)]


def run_parity(args) -> List[dict]:
    out: List[dict] = []
    for seed in args.seeds:
        base = _from_cold_start(args.out, "uniform", seed)
        for label, k, corrected in PARITY_COLUMNS:
            run_dir = args.out / f"parity_seed{seed}_k{k}{'' if corrected else '_uncorrected'}"
            rows = _train(WORKLOADS["uniform"], run_dir, [
                *base, *REAL_SERVER, f"rollout.sglang.port={free_port()}",
                f"trainer.num_steps={args.num_steps}", f"trainer.eval_every_steps={args.num_steps}",
                *staleness_overrides(k, corrected)])
            steps = [r for r in rows if r["step"] >= 1]
            out.append({"column": label, "seed": seed, "acc_start": rows[0].get("eval/accuracy"),
                        "acc_end": rows[-1]["eval/accuracy"],
                        "reward_last10": statistics.fmean(r["reward/mean"] for r in steps[-10:]),
                        "clip_frac_seq": _mean(steps, "train/clip_frac_seq"),
                        "tis_weight_mean": _mean(steps, "train/tis_weight_mean")})
            print(json.dumps(out[-1]), flush=True)
    return out


LENGTH_KS = (0, 4)


def answer_lengths(assets: Path) -> Dict[str, int]:
    """Prompt id -> tokens of its reference answer and eos (the repeat task's answer is the
    digit ``count`` times, one token each): what a correct response's length is."""
    out = {}
    for line in open(assets / "data" / "train.jsonl"):
        record = json.loads(line)
        out[record["id"]] = len(record["answer"]) + 1
    return out


def trained_prompts(run_dir: Path, k: int, drawn_in_order: List[str], num_steps: int,
                    batch: int):
    """``(prompts trained, prompts left generating at the end)``: for k >= 2 from the run's
    ledger (``async_groups.jsonl``); on-policy every step trains the batch it drew, the data in
    file order (``data.shuffle: false`` in ``configs/tiny_longtail.yaml``)."""
    if k < 2:
        return drawn_in_order[:num_steps * batch], []
    ledger = [json.loads(line) for line in open(run_dir / "async_groups.jsonl")]
    taken = [p for row in ledger for _, p, *_ in row.get("taken", [])]
    left = [p for row in ledger for _, p in row.get("left", [])]
    return taken, left


def length_row(rows: List[dict], k: int, seed: int, taken: List[str], left: List[str],
               answer_len: Dict[str, int]) -> dict:
    steps = [r for r in rows if r["step"] >= 1]
    trained_answer = statistics.fmean(answer_len[p] for p in taken)
    response = _mean(steps, "rollout/response_len_mean")
    return {"k": k, "seed": seed, "response_len_mean": response,
            "answer_len_mean": trained_answer, "response_per_answer": response / trained_answer,
            "left_groups": len(left),
            "left_answer_len_mean": statistics.fmean(answer_len[p] for p in left) if left else None,
            "dropped_stale": sum(r.get("async/dropped_stale_groups", 0.0) for r in steps),
            "lag_mean": _mean(steps, "async/lag_mean")}


def run_lengths(args) -> List[dict]:
    out: List[dict] = []
    assets = _assets(args.out, "longtail")
    answer_len = answer_lengths(assets)
    in_order = list(answer_len)
    for seed in args.seeds:
        base = _from_cold_start(args.out, "longtail", seed)
        for k in LENGTH_KS:
            run_dir = args.out / f"lengths_seed{seed}_k{k}"
            metrics = run_dir / "metrics.jsonl"
            if args.reuse_runs and metrics.exists() and \
                    sum(1 for _ in open(metrics)) == args.num_steps + 1:
                rows = [json.loads(line) for line in open(metrics)]  # a finished run, re-read
            else:
                rows = _train(WORKLOADS["longtail"], run_dir, [
                    *base, *REAL_SERVER, f"rollout.sglang.port={free_port()}",
                    f"trainer.num_steps={args.num_steps}", "trainer.eval_every_steps=0",
                    *staleness_overrides(k)])
            taken, left = trained_prompts(run_dir, k, in_order, args.num_steps, 32)
            out.append(length_row(rows, k, seed, taken, left, answer_len))
            print(json.dumps(out[-1]), flush=True)
    return out


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()


def _conditions(argv: Sequence[str], started: float, load_start: float, commit: str) -> dict:
    """``commit``: the checkout the runs started from (each run imports it when it starts)."""
    return {"command": "python benchmarks/bench_async.py " + " ".join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit, "cpus": os.cpu_count(), "machine": platform.machine(),
            "load_start": load_start, "load_end": os.getloadavg()[0],
            "minutes": (time.time() - started) / 60, "threads": THREADS}


BEGIN, END = "<!-- bench_async: begin -->", "<!-- bench_async: end -->"


def write_doc(results: dict, doc: Path) -> str:
    """The measured section of docs/async_rollouts.md (between its markers; the rest of the
    file is the design, written by hand) from the results file (the parts it holds)."""
    lines = ["Written by `benchmarks/bench_async.py doc` from `benchmarks/results/async.json`; "
             "each part names the command, commit and machine that measured it.", ""]
    speed = results.get("speed")
    if speed:
        c = speed["conditions"]
        lines += ["## Speed against the real SGLang server", "",
                  f"`{c['command']}` on {c['date']}, commit `{c['commit']}`, {c['cpus']} CPUs "
                  f"(load {c['load_start']:.1f} at the start, {c['load_end']:.1f} at the end), "
                  f"{c['minutes']:.0f} min. One real SGLang 0.5.23 CPU server launched by the "
                  f"trainer; trainer and server each with {c['threads']} torch thread; 32 prompts "
                  "x 8 samples, learner old log-probs, 4 mini-batches per step; every column from "
                  "the same cold start, one after the other. Steps after the first "
                  f"{speed['warmup_steps']} of {speed['num_steps']}.", "",
                  "| workload | k | steps/s | vs k=0 | trained tokens/s | response len mean / max "
                  "| wait s | old log-probs s | update s | sync s (pause) | mean lag | spanning "
                  "versions | dropped too old |",
                  "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
        for w in dict.fromkeys(r["workload"] for r in speed["rows"]):
            rows = [r for r in speed["rows"] if r["workload"] == w]
            base = next((r["steps_per_s"] for r in rows if r["k"] == 0), None)
            for r in rows:
                ratio = f"{r['steps_per_s'] / base:.2f}x" if base else "-"
                lines.append(
                    f"| {w} | {r['k']} | {r['steps_per_s']:.3f} | {ratio} | {r['tokens_per_s']:.0f} "
                    f"| {r['response_len_mean']:.1f} / {r['response_len_max']:.0f} | {r['wait_s']:.2f} "
                    f"| {r['old_logprobs_s']:.2f} | {r['update_s']:.2f} | {r['sync_s']:.2f} "
                    f"({r['pause_s']:.2f}) | {r['lag_mean']:.2f} | {r['multi_version_frac']:.2f} "
                    f"| {r['dropped_stale']:.0f} |")
        lines.append("")
    parity = results.get("parity")
    if parity:
        c = parity["conditions"]
        lines += ["## Learning parity (tiny addition task)", "",
                  f"`{c['command']}` on {c['date']}, commit `{c['commit']}`, {c['cpus']} CPUs. "
                  f"{parity['num_steps']} GSPO steps against the real server from each seed's cold "
                  "start; held-out greedy accuracy on the 200 eval problems.", "",
                  "| column | " + " | ".join(f"seed {s}" for s in parity["seeds"])
                  + " | median | spread | mean clipped seq frac | mean behaviour weight |",
                  "|---|" + "---:|" * (len(parity["seeds"]) + 4)]
        for label, _, _ in PARITY_COLUMNS:
            rows = [r for r in parity["rows"] if r["column"] == label]
            if not rows:
                continue
            acc = [100 * r["acc_end"] for r in rows]
            lines.append(f"| {label} | " + " | ".join(f"{a:.1f}%" for a in acc)
                         + f" | {statistics.median(acc):.1f}% | {min(acc):.1f}-{max(acc):.1f}% "
                         f"| {_mean(rows, 'clip_frac_seq'):.3f} | {_weight(rows)} |")
        starts = [100 * r["acc_start"] for r in parity["rows"] if r["column"] == "k=0"
                  and r["acc_start"] is not None]
        if starts:
            lines += ["", "Accuracy after the cold start, per seed: "
                      + ", ".join(f"{a:.1f}%" for a in starts) + "."]
        lines.append("")
    lengths = results.get("lengths")
    if lengths:
        c = lengths["conditions"]
        lines += ["## Trained response lengths, on-policy against k = 4 (long-tail task)", "",
                  f"`{c['command']}` on {c['date']}, commit `{c['commit']}`, {c['cpus']} CPUs "
                  f"(load {c['load_start']:.1f} at the start, {c['load_end']:.1f} at the end). "
                  f"{lengths['num_steps']} GSPO steps against the real server from each seed's "
                  "cold start. Per run: the mean over steps of the trained responses' mean "
                  "length; the mean length of the reference answers (digits + eos) of the "
                  "prompts it trained, and the response length per answer length; the groups "
                  "still generating or buffered when the run ended, and their answers' mean "
                  "length; groups dropped as too old.", "",
                  "| k | response len, per seed | mean (spread) | trained prompts' answer len "
                  "| response / answer len | left at the end: groups, answer len "
                  "| dropped too old | mean lag |",
                  "|---:|---|---|---|---|---|---:|---:|"]
        for k in LENGTH_KS:
            rows = [r for r in lengths["rows"] if r["k"] == k]
            if not rows:
                continue
            lens = [r["response_len_mean"] for r in rows]
            ratio = [r["response_per_answer"] for r in rows]
            left = [r for r in rows if r["left_groups"]]
            left_text = (f"{statistics.fmean(r['left_groups'] for r in rows):.0f}, "
                         f"{statistics.fmean(r['left_answer_len_mean'] for r in left):.2f}"
                         if left else "0")
            lines.append(f"| {k} | " + " / ".join(f"{x:.2f}" for x in lens)
                         + f" | {statistics.fmean(lens):.2f} ({min(lens):.2f}-{max(lens):.2f}) "
                         f"| {_mean(rows, 'answer_len_mean'):.2f} "
                         f"| {statistics.fmean(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f}) "
                         f"| {left_text} | {sum(r['dropped_stale'] for r in rows):.0f} "
                         f"| {_mean(rows, 'lag_mean'):.2f} |")
        lines.append("")
    text = "\n".join(lines)
    page = doc.read_text() if doc.exists() else f"# Asynchronous rollouts\n\n{BEGIN}\n{END}\n"
    if BEGIN not in page or END not in page:
        raise ValueError(f"{doc} lacks the markers {BEGIN} / {END} of the measured section")
    head, rest = page.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    return text


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("speed", "parity", "lengths", "doc"))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--num-steps", type=int, default=None)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1, help="speed: the cold start's seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="parity, lengths")
    parser.add_argument("--reuse-runs", action="store_true",
                        help="lengths: re-read a finished run of the same step count instead of "
                             "training it again (a new analysis of the same runs)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_async")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    if args.part != "doc":
        if not SGLANG_PYTHON.exists():
            print(f"error: {SGLANG_PYTHON} is missing; run `make sglang-venv`", file=sys.stderr)
            return 2
        args.out.mkdir(parents=True, exist_ok=True)
        started, load, commit = time.time(), os.getloadavg()[0], _commit()
        try:
            if args.part == "speed":
                args.num_steps = args.num_steps or 12
                rows = run_speed(args)
                results["speed"] = {"rows": rows, "num_steps": args.num_steps,
                                    "warmup_steps": args.warmup_steps}
            elif args.part == "lengths":
                args.num_steps = args.num_steps or 12
                rows = run_lengths(args)
                results["lengths"] = {"rows": rows, "num_steps": args.num_steps, "seeds": args.seeds}
            else:
                args.num_steps = args.num_steps or 40
                rows = run_parity(args)
                results["parity"] = {"rows": rows, "num_steps": args.num_steps, "seeds": args.seeds}
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        results[args.part]["conditions"] = _conditions(argv, started, load, commit)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1) + "\n")
    try:
        print(write_doc(results, args.doc))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
