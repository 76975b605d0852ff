#!/usr/bin/env python
"""A training checkpoint's save and load at Qwen3-30B-A3B's widths on 2 learner ranks (DP=2):
each rank's extra owned memory, its writes, and the time a step is held, per optimizer form.

The model is ``configs/qwen3_30b_a3b_1layer_cpu.yaml``'s (1 layer of the hub's widths, bf16
weights, fp32 Adam, the embedding and output layer frozen), randomly initialised, with
``--experts`` of its 128 experts. Each rank takes one optimizer step (so Adam's state exists),
then saves that state, in this order:

* ``fast``: the fast form in the foreground (``learner/checkpointing.py``: every rank writes its
  own optimizer shard, views of its buffers);
* ``fast, async``: the same in the background (``checkpoint.async_save``), the rank then idles
  for as long as the foreground save took (a rollout being generated, at the production ratio
  where a step's generation is longer than a save: ``gspo-plan``), then finishes it; the step is
  held for the begin and the finish;
* ``portable`` (``--portable``): the layout-independent form every save wrote before issue 49
  (megatron-core gathers the data-parallel group's main weights and moments on every rank);

and loads each back (after step 2, see below). A sampler thread in each rank reads its own ``RssAnon + RssShmem`` every
50 ms (``benchmarks/owned_memory.py``); ``extra`` is its peak during the save (or load) less its
value just before. ``own shard`` is the optimizer state the rank holds (its fp32 main weights and
moments), the issue's yardstick (goal: extra <= 1.25x own shard; held <= 10% of the foreground
save). Then step 2 is taken unbroken, and again after loading each checkpoint: its loss and
every weight's bytes must equal the unbroken step's. ``--doc`` replaces the marked section of that file with the command, the conditions and
the table.

    python benchmarks/bench_checkpoint_save.py --experts 32 --portable --work /tmp/bcs \\
        --doc docs/checkpoints.md
    python benchmarks/bench_checkpoint_save.py --experts 128 --work /tmp/bcs --doc docs/checkpoints.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "qwen3_30b_a3b_1layer_cpu.yaml"
GIB = 2**30


def markers(experts: int):
    return (f"<!-- bench_checkpoint_save experts={experts}: begin (written by the benchmark; do "
            "not edit) -->", f"<!-- bench_checkpoint_save experts={experts}: end -->")


# ---- one rank (run under torchrun) -------------------------------------------------------------

def _batch(vocab: int):
    import torch

    from gspo_megatron.learner.batch import SequenceBatch

    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (48,), generator=gen) for _ in range(2)]
    return SequenceBatch(token_ids=tokens, prompt_lens=[16, 16], advantages=[1.0, -1.0])


def _own_shard_bytes(learner) -> int:
    """The optimizer state this rank holds: its fp32 main weights and Adam moments."""
    total = 0
    for sub in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        inner = sub.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                total += p.numel() * p.element_size()
                for value in inner.state[p].values():
                    if hasattr(value, "numel") and value.numel() > 1:
                        total += value.numel() * value.element_size()
    return total


def _measured(fn):
    """``(fn(), extra owned bytes at the peak, seconds)`` in this process."""
    import gc

    from benchmarks.owned_memory import OwnedMemorySampler, owned_bytes

    gc.collect()
    base = owned_bytes(os.getpid())
    sampler = OwnedMemorySampler(os.getpid(), interval_s=0.05)
    sampler.start()
    start = time.perf_counter()
    try:
        out = fn()
    finally:
        seconds = time.perf_counter() - start
        sampler.stop()
    return out, sampler.peak_bytes - base, seconds


def _weights_digest(learner) -> str:
    """sha256 of every weight's bytes on this rank (equal only when bit for bit equal)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for chunk in learner.model:
        for param in chunk.parameters():
            digest.update(param.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def rank_main(args) -> None:
    import torch.distributed as dist

    from gspo_megatron.algorithms.losses import get_policy_loss
    from gspo_megatron.config import load_config
    from gspo_megatron.distributed.runtime import init_distributed, shutdown_distributed
    from gspo_megatron.learner.learner import Learner

    cfg = load_config(CONFIG, ["model.hf_path=null", f"model.num_experts={args.experts}",
                               "parallel.world_size=2", f"logging.run_dir={args.work}/run"])
    runtime = init_distributed(cfg.parallel, seed=1)
    rank = runtime.rank
    learner = Learner(cfg, runtime, total_steps=10)
    loss = get_policy_loss("gspo")
    batch = _batch(cfg.model.vocab_size)
    batch.old_logprobs = learner.compute_logprobs(batch).logprobs
    learner.train_step(batch, loss)  # step 1: the state every form saves
    out: Dict[str, object] = {"rank": rank, "own_shard_bytes": _own_shard_bytes(learner)}
    forms = [("fast", "dp_sharded", False), ("fast, async", "dp_sharded", True)]
    if args.portable:
        forms.append(("portable", "portable", False))
    foreground_s = None
    for name, form, background in forms:
        directory = Path(args.work) / f"ckpt_{form}_{int(background)}"
        dist.barrier()

        def save():
            if not background:
                report = learner.save_checkpoint(directory, form=form)
                return {"held_s": report.total_s, "total_s": report.total_s,
                        "bytes": report.bytes_written}
            begun = time.perf_counter()
            pending = learner.save_checkpoint(directory, form=form, background=True)
            begin_s = time.perf_counter() - begun
            time.sleep(foreground_s)  # the next rollout is being generated meanwhile
            finished = time.perf_counter()
            report = pending.finish()
            return {"held_s": begin_s + time.perf_counter() - finished,
                    "total_s": report.total_s, "bytes": report.bytes_written,
                    "begin_s": begin_s}

        result, extra, _ = _measured(save)
        if name == "fast":
            foreground_s = result["total_s"]
        out[name] = {**result, "save_extra_bytes": extra}
    # Step 2 unbroken, then from each checkpoint: the same loss and weights, bit for bit.
    unbroken = learner.train_step(batch, loss)["loss"], _weights_digest(learner)
    for name, form, background in forms:
        directory = Path(args.work) / f"ckpt_{form}_{int(background)}"
        dist.barrier()
        _, load_extra, load_s = _measured(lambda: learner.load_checkpoint(directory))
        resumed = learner.train_step(batch, loss)["loss"], _weights_digest(learner)
        out[name].update(load_extra_bytes=load_extra, load_s=load_s,
                         resumed_exact=resumed == unbroken)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    Path(args.work, f"rank{rank}.json").write_text(json.dumps(out))
    learner.close()
    shutdown_distributed()


# ---- the driver ----------------------------------------------------------------------------------

def _conditions() -> str:
    load = open("/proc/loadavg").read().split()[:3]
    mem = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/meminfo")
           if line.startswith(("MemTotal", "MemAvailable"))}
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} "
            f"CPUs, load average {' '.join(load)}, {mem['MemAvailable'] / 2**20:.1f} of "
            f"{mem['MemTotal'] / 2**20:.1f} GiB available at the start")


def table(ranks: List[dict]) -> List[str]:
    rows = ["| form | rank | own shard | save: extra (x shard) | written | step held "
            "(x foreground save) | save total | load: extra | load | step 2 after the load |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(ranks, key=lambda x: x["rank"]):
        foreground = r["fast"]["total_s"]
        for name in ("fast", "fast, async", "portable"):
            if name not in r:
                continue
            m, shard = r[name], r["own_shard_bytes"]
            rows.append(
                f"| {name} | {r['rank']} | {shard / GIB:.2f} GiB | "
                f"{m['save_extra_bytes'] / GIB:.2f} GiB ({m['save_extra_bytes'] / shard:.2f}x) | "
                f"{m['bytes'] / GIB:.2f} GiB | {m['held_s']:.1f} s "
                f"({m['held_s'] / foreground:.2f}x) | {m['total_s']:.1f} s | "
                f"{m['load_extra_bytes'] / GIB:.2f} GiB | {m['load_s']:.1f} s | "
                f"{'= unbroken' if m['resumed_exact'] else 'DIFFERS'} |")
    return rows


def write_doc(path: Path, experts: int, command: str, conditions: str, rows: List[str]) -> None:
    begin, end = markers(experts)
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path}: no section marked {begin!r} ... {end!r}")
    head, rest = doc.split(begin, 1)
    text = "\n".join([begin, f"`{command}` ({conditions}):", "", *rows, end])
    path.write_text(head + text + rest.split(end, 1)[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--portable", action="store_true",
                        help="also the portable form (gathers; needs ~12 bytes per trained "
                             "parameter more on every rank)")
    parser.add_argument("--work", required=True)
    parser.add_argument("--doc", default=None)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_main(args)
        return 0
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    conditions = _conditions()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", __file__, "--rank-worker",
           "--experts", str(args.experts), "--work", str(work)] + \
        (["--portable"] if args.portable else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, cwd=REPO)
    if proc.returncode != 0:
        print(f"the ranks failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    rows = table(ranks)
    print("\n".join(rows))
    if args.doc:
        command = shlex.join(["python", "benchmarks/bench_checkpoint_save.py",
                              *sys.argv[1:]])
        write_doc(Path(args.doc), args.experts, command, conditions, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
