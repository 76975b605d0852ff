"""Benchmark: weight-sync transports, the old vs the staged gather, and Qwen3-30B-A3B's predicted sync.

1. Transports (``--transports tensor,disk``): tiny-to-small Qwen3-MoE policies (fp32), a fresh
   copy of every parameter streamed into the embedded engine through ``engine.update_weights``
   (the one bucket loop) with the configured bucket size; median of ``--repeats``.
2. Gathers (``--measure-gather``): a Qwen3-MoE with many small experts under PP=2 x EP=2 on 4
   gloo processes; the per-tensor gather used before issue 12 (benchmarks/legacy_gather.py) and
   the staged bucketed gather (checkpoint/gather.py) deliver every tensor to rank 0, timed in the
   same run (medians, ratio). A 1-process run of the staged gather gives the Python cost per
   canonical tensor, used as ``python_per_tensor_s`` of the prediction.
3. Prediction (always): Qwen3-30B-A3B on the production layout (TP2, EP8, PP1, 1 GiB buckets, 4
   servers of TP4) for several link bandwidths: floor, old gather, staged gather
   (benchmarks/sync_model.py documents the method).

    OMP_NUM_THREADS=1 python benchmarks/bench_weight_sync.py --transports tensor,disk --measure-gather
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sync_model import Hardware, LearnerLayout, predict  # noqa: E402
from gspo_megatron.config.schema import WeightSyncConfig  # noqa: E402
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine  # noqa: E402
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model  # noqa: E402
from gspo_megatron.weight_sync import build_transport  # noqa: E402

SIZES = {  # name: (hidden, layers, experts, moe_ffn)
    "xs": (64, 2, 4, 64), "s": (128, 4, 8, 256), "m": (256, 4, 16, 512),
    "l": (512, 4, 16, 1024), "xl": (768, 4, 16, 1536)}
GATHER_MODEL = dict(hidden_size=64, num_layers=4, num_experts=64, moe_ffn_hidden_size=32)


def bench_transport(size: str, transport: str, bucket_bytes: int, repeats: int, disk_dir: str) -> Dict:
    hidden, layers, experts, ffn = SIZES[size]
    model, tok = build_tiny_policy(seed=0, hidden_size=hidden, num_layers=layers,
                                   num_experts=experts, moe_ffn_hidden_size=ffn)
    source = {n: t.detach().clone() for n, t in model.state_dict().items()}
    engine = EmbeddedEngine(model, tok)
    build_transport(WeightSyncConfig(transport=transport, bucket_bytes=bucket_bytes,
                                     disk_dir=disk_dir), engine, "embedded")
    runs = [engine.update_weights(iter(source.items())) for _ in range(repeats)]
    seconds = statistics.median(r.seconds for r in runs)
    num_bytes = runs[0].num_bytes
    return {"size": size, "transport": transport, "params_m": num_bytes / 4 / 1e6,
            "mb": num_bytes / 1e6, "buckets": runs[0].num_buckets, "seconds": seconds,
            "gb_per_s": num_bytes / 1e9 / seconds}


def _gather_rank(rank: int, world: int, port: int, hf_dir: str, layout: Dict, repeats: int,
                 out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from benchmarks.legacy_gather import legacy_iter_hf_tensors
    from gspo_megatron.checkpoint import mapping
    from gspo_megatron.checkpoint.convert import build_model_chunks, model_config_for_hf_dir
    from gspo_megatron.checkpoint.gather import iter_hf_buckets
    from gspo_megatron.config.schema import ParallelConfig
    from gspo_megatron.distributed.runtime import init_distributed

    parallel = ParallelConfig(**layout)
    init_distributed(parallel)
    cfg = model_config_for_hf_dir(hf_dir)
    chunks = build_model_chunks(cfg, parallel, initialize=True)
    gathers = {"staged": lambda: [t for b in iter_hf_buckets(chunks, cfg, 1 << 20) for t in b]}
    if world > 1:
        gathers["old"] = lambda: list(legacy_iter_hf_tensors(chunks, cfg))
    times: Dict[str, List[float]] = {k: [] for k in gathers}
    for _ in range(repeats):
        for name, run in gathers.items():
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            got = run()
            times[name].append(time.perf_counter() - t0)
            if rank == 0:
                assert len(got) == len(mapping.expected_hf_shapes(cfg))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "num_canonical": len(mapping.canonical_names(cfg))}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def measure_gathers(repeats: int) -> Dict:
    import torch.multiprocessing as mp

    from gspo_megatron.distributed.ports import free_port

    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_model(*build_tiny_policy(seed=0, **GATHER_MODEL), os.path.join(tmp, "m"))
        results = {}
        for world, layout in ((4, dict(pp=2, ep=2)), (1, {})):
            out = os.path.join(tmp, f"gather{world}.json")
            mp.spawn(_gather_rank, args=(world, free_port(), os.path.join(tmp, "m"), layout,
                                         repeats, out), nprocs=world)
            with open(out) as f:
                results[world] = json.load(f)
    four, one = results[4], results[1]
    old, staged = (statistics.median(four["times"][k]) for k in ("old", "staged"))
    return {"old_s": old, "staged_s": staged, "ratio": old / staged,
            "num_canonical": four["num_canonical"],
            "python_per_tensor_s": statistics.median(one["times"]["staged"]) / one["num_canonical"]}


def prediction_table(hw: Hardware, links: List[float]) -> List[Dict]:
    rows = []
    for link in links:
        p = predict(hw=replace(hw, link_gb_per_s=link), layout=LearnerLayout())
        rows.append({"link_gb_per_s": link, **{k: p[k] for k in ("floor", "old", "staged", "buckets",
                                                                  "old_collectives", "staged_collectives")}})
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="xs,s,m,l,xl")
    p.add_argument("--transports", default="", help="e.g. tensor,disk (empty: skip part 1)")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--measure-gather", action="store_true")
    p.add_argument("--links-gb-per-s", default="25,50,100,400")
    p.add_argument("--json", default=None, help="also write every result to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    report: Dict = {"transports": []}
    with tempfile.TemporaryDirectory() as disk_dir:
        for transport in filter(None, args.transports.split(",")):
            for size in args.sizes.split(","):
                report["transports"].append(bench_transport(size, transport, int(args.bucket_mb * 1e6),
                                                            args.repeats, disk_dir))
    if report["transports"]:
        print("| model | transport | params (M) | MB (fp32) | buckets | seconds | GB/s |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in report["transports"]:
            print(f"| {r['size']} | {r['transport']} | {r['params_m']:.1f} | {r['mb']:.1f} | "
                  f"{r['buckets']} | {r['seconds']:.4f} | {r['gb_per_s']:.2f} |")
    hw = Hardware()
    if args.measure_gather:
        g = report["gather"] = measure_gathers(args.repeats)
        print(f"\ngathers to rank 0, PP2 x EP2 on 4 gloo processes, {g['num_canonical']} canonical "
              f"tensors: old {g['old_s']:.3f} s, staged {g['staged_s']:.3f} s, "
              f"old / staged = {g['ratio']:.2f}; Python per tensor (1 process) "
              f"{g['python_per_tensor_s'] * 1e6:.0f} us")
        hw = replace(hw, python_per_tensor_s=g["python_per_tensor_s"])
    report["hardware"] = hw.__dict__
    report["prediction"] = prediction_table(hw, [float(x) for x in args.links_gb_per_s.split(",")])
    print(f"\nQwen3-30B-A3B bf16 (61.1 GB), TP2 EP8 PP1, 1 GiB buckets; {hw}")
    print("| link GB/s | floor s | old gather s | staged gather s | buckets | collectives old / staged |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in report["prediction"]:
        print(f"| {r['link_gb_per_s']:g} | {r['floor']:.2f} | {r['old']:.2f} | {r['staged']:.2f} | "
              f"{r['buckets']} | {r['old_collectives']:.0f} / {r['staged_collectives']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
