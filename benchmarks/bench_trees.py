"""Two checkouts of gspo-train on the bench_vs_trl setup, interleaved: the before / after of a change.

    git worktree add /tmp/before <ref>
    python benchmarks/bench_trees.py --before /tmp/before --rounds 3
    python benchmarks/bench_trees.py --before /tmp/before algo.old_logprob_source=learner

Each round runs both trees once (A B, then B A, ...) with ``OMP_NUM_THREADS=1``, on the model,
prompts and overrides of ``bench_vs_trl.py`` (its setup, ``vs_trl_setup.py``: this checkout's
copy; the config file comes from each tree). Per run: the medians over steps 2..N of the step's
phase times from its ``metrics.jsonl``, and the whole-process time; the summary gives the median
over rounds. Extra arguments are gspo-train overrides for both trees. Used for the before / after
table of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vs_trl_setup  # noqa: E402  (bench_vs_trl.py's setup, shared)

PHASES = ("time/step_s", "time/rollout_s", "time/update_s", "time/old_logprobs_s",
          "time/weight_sync_s")


def run_tree(root: Path, run_dir: Path, args) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = vs_trl_setup.gspo_command(args, args.assets, run_dir, args.overrides)
    cmd[3] = str(root / "configs" / "tiny_cpu.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
    whole = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{root} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 2]
    res = {"whole_s": whole}
    for key in PHASES:
        values = [r[key] for r in rows if key in r]
        if values:
            res[key] = statistics.median(values)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the other checkout's root")
    p.add_argument("--after", default=str(HERE.parent), help="default: this checkout")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-scale", type=int, default=1)
    p.add_argument("--work", default=str(HERE.parent / "runs" / "bench_trees"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps must be >= 4 (steps 2..N are timed)")
    args.prompts, args.samples, args.max_new_tokens = 8 * args.batch_scale, 8, 16
    args.with_diagnostics = False
    work = Path(args.work)
    args.assets = vs_trl_setup.make_assets(work / "assets")
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    results = []
    for r in range(args.rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            res = {"tree": name, "round": r, **run_tree(trees[name], work / f"{name}_{r}", args)}
            results.append(res)
            print(json.dumps(res), flush=True)
    for name in trees:
        mine = [x for x in results if x["tree"] == name]
        keys = [k for k in mine[0] if k not in ("tree", "round")]
        print(name, {k: round(statistics.median(x[k] for x in mine), 3) for k in keys})
    return 0


if __name__ == "__main__":
    sys.exit(main())
