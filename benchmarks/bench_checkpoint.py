#!/usr/bin/env python
"""Conversion and export throughput (GB/s) and peak host memory on a synthetic Qwen3-MoE.

Writes a random bf16 Qwen3-MoE Hugging Face checkpoint of about ``--size-gb`` (sharded
safetensors + config.json, streamed, never whole in memory), then runs HF -> Megatron conversion
and Megatron -> HF export, each in fresh processes (``--num-procs`` of them, through torchrun, with
the experts split by EP), and reports wall time, GB/s (HF bytes / wall time, including model
construction and dist_checkpointing I/O) and each process's peak RSS (its own plus the
dist_checkpointing writer processes it forks).

    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py --size-gb 1 --work /tmp/bench_ckpt
    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py --size-gb 1 --num-procs 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gspo_megatron.checkpoint import mapping  # noqa: E402
from gspo_megatron.checkpoint.hf_io import SafetensorsShardWriter  # noqa: E402
from gspo_megatron.config.schema import ModelConfig, ParallelConfig  # noqa: E402
from gspo_megatron.model.hf_config import hf_config_from_model_config  # noqa: E402

BASE = ModelConfig(arch="qwen3_moe", num_layers=8, hidden_size=1024, num_attention_heads=16,
                   num_query_groups=4, head_dim=64, vocab_size=32000, num_experts=32,
                   moe_router_topk=4, moe_ffn_hidden_size=512, max_position_embeddings=4096,
                   params_dtype="bf16", transformer_impl="local")


def synthetic_config(size_gb: float) -> ModelConfig:
    """Scale the layer count so the bf16 checkpoint is about ``size_gb``."""
    shapes = mapping.expected_hf_shapes(replace(BASE, num_layers=1))
    per_layer = sum(_numel(s) for n, s in shapes.items() if n.startswith("model.layers.")) * 2
    fixed = sum(_numel(s) for n, s in shapes.items() if not n.startswith("model.layers.")) * 2
    return replace(BASE, num_layers=max(1, round((size_gb * 1e9 - fixed) / per_layer)))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_synthetic(cfg: ModelConfig, hf_dir: Path) -> int:
    writer = SafetensorsShardWriter(hf_dir, max_shard_bytes=500 * 10**6)
    gen = torch.Generator().manual_seed(0)
    for name, shape in mapping.expected_hf_shapes(cfg).items():
        writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.finish()
    hf = hf_config_from_model_config(cfg)
    hf["torch_dtype"] = "bfloat16"
    (hf_dir / "config.json").write_text(json.dumps(hf))
    return writer.total_bytes


def _peak_rss_gb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1e6  # ru_maxrss is in KiB on Linux; report ~GB


def run_stage(args: argparse.Namespace) -> None:
    """One rank of a conversion or export (launched by torchrun or directly)."""
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.checkpoint.export import export_megatron_to_hf
    from gspo_megatron.distributed.runtime import init_distributed, shutdown_distributed

    work = Path(args.work)
    parallel = ParallelConfig(ep=args.nproc)
    init_distributed(parallel)
    start = time.monotonic()
    if args.stage == "convert":
        convert_hf_to_megatron(work / "hf", work / "mcore", parallel,
                               ModelConfig(transformer_impl="local"), overwrite=True)
    else:
        export_megatron_to_hf(work / "mcore", work / "hf_out", parallel, overwrite=True,
                              max_shard_bytes=500 * 10**6)
    seconds = time.monotonic() - start
    rank = torch.distributed.get_rank()
    shutdown_distributed()
    (work / f"{args.stage}_rank{rank}.json").write_text(
        json.dumps({"seconds": seconds, "peak_rss_gb": _peak_rss_gb()}))


def _launch(stage: str, args: argparse.Namespace) -> list:
    me = [str(Path(__file__).resolve()), "--stage", stage, "--work", args.work,
          "--num-procs", str(args.nproc)]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc}"] + me
           if args.nproc > 1 else [sys.executable] + me)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads((Path(args.work) / f"{stage}_rank{r}.json").read_text())
            for r in range(args.nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--work", default="/tmp/bench_ckpt")
    parser.add_argument("--num-procs", dest="nproc", type=int, default=1)
    parser.add_argument("--stage", choices=["convert", "export"], default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.stage else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    if args.stage:
        return run_stage(args)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = synthetic_config(args.size_gb)
    num_bytes = write_synthetic(cfg, work / "hf")
    rows = {stage: _launch(stage, args) for stage in ("convert", "export")}
    print(f"synthetic Qwen3-MoE: {cfg.num_layers} layers, {cfg.num_experts} experts, "
          f"{num_bytes / 1e9:.2f} GB bf16; {args.nproc} process(es), EP={args.nproc}")
    print("| stage | wall s | GB/s | peak RSS per process (GB) |\n|---|---|---|---|")
    for stage, ranks in rows.items():
        wall = max(r["seconds"] for r in ranks)
        rss = ", ".join(f"{r['peak_rss_gb']:.2f}" for r in ranks)
        print(f"| {stage} | {wall:.1f} | {num_bytes / 1e9 / wall:.2f} | {rss} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
