"""Benchmark: weight-sync seconds and GB/s vs model size, into the embedded engine.

Builds tiny-to-small Qwen3-MoE policies (fp32, random weights), then times
``engine.update_weights(stream)`` through the in-process transport (and optionally the disk
transport) with the configured bucket size; the stream is a fresh copy of every parameter, as
the learner's HF-named gather would hand over. Prints a Markdown table (for docs/rollout.md),
and the Qwen3-30B-A3B broadcast calculator for the given link bandwidths.

    OMP_NUM_THREADS=1 python benchmarks/bench_weight_sync.py --transports tensor,disk
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from typing import Dict, List

import torch

from gspo_megatron.config.schema import WeightSyncConfig
from gspo_megatron.rollout.embedded import EmbeddedEngine
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.weight_sync import build_transport
from gspo_megatron.weight_sync.estimate import QWEN3_30B_A3B, estimate_broadcast, qwen3_moe_num_params

SIZES = {  # name: (hidden, layers, experts, moe_ffn)
    "xs": (64, 2, 4, 64), "s": (128, 4, 8, 256), "m": (256, 4, 16, 512),
    "l": (512, 4, 16, 1024), "xl": (768, 4, 16, 1536)}


def bench_one(size: str, transport: str, bucket_bytes: int, repeats: int, disk_dir: str) -> Dict:
    hidden, layers, experts, ffn = SIZES[size]
    model, tok = build_tiny_policy(seed=0, hidden_size=hidden, num_layers=layers,
                                   num_experts=experts, moe_ffn_hidden_size=ffn)
    source = {n: t.detach().clone() for n, t in model.state_dict().items()}
    engine = EmbeddedEngine(model, tok)
    build_transport(WeightSyncConfig(transport=transport, bucket_bytes=bucket_bytes,
                                     disk_dir=disk_dir), engine)
    runs = [engine.update_weights(iter(source.items())) for _ in range(repeats)]
    seconds = statistics.median(r.seconds for r in runs)
    num_bytes = runs[0].num_bytes
    return {"size": size, "transport": transport, "params_m": num_bytes / 4 / 1e6,
            "mb": num_bytes / 1e6, "buckets": runs[0].num_buckets, "seconds": seconds,
            "gb_per_s": num_bytes / 1e9 / seconds}


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="xs,s,m,l,xl")
    p.add_argument("--transports", default="tensor")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--links-gb-per-s", default="25,50,100,400")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as disk_dir:
        for transport in args.transports.split(","):
            for size in args.sizes.split(","):
                rows.append(bench_one(size, transport, int(args.bucket_mb * 1e6), args.repeats, disk_dir))
    print("| model | transport | params (M) | MB (fp32) | buckets | seconds | GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['transport']} | {r['params_m']:.1f} | {r['mb']:.1f} | "
              f"{r['buckets']} | {r['seconds']:.4f} | {r['gb_per_s']:.2f} |")
    num_bytes = qwen3_moe_num_params(**QWEN3_30B_A3B) * 2
    print(f"\nQwen3-30B-A3B, bf16: {num_bytes / 1e9:.1f} GB, 512 MiB buckets")
    print("| link GB/s | floor s | estimate s (80% eff., 5 ms/bucket) |")
    print("|---:|---:|---:|")
    for link in (float(x) for x in args.links_gb_per_s.split(",")):
        e = estimate_broadcast(num_bytes, link)
        print(f"| {link:g} | {e.floor_s:.2f} | {e.estimate_s:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
