"""``gspo-reshard --ckpt DIR --out DIR --tp N --pp N --ep N ...``: re-save a checkpoint under the
target layout given by the flags (launch that many processes), weights only.

``gspo-reshard --portable-optimizer --ckpt DIR --config RUN_CONFIG``: rewrite a training
checkpoint's optimizer state, saved in the fast form of its layout, in the portable form that
loads under any layout, in place (launch the checkpoint's layout: its TP x PP x CP x DP
processes, any DP; ``checkpoint/portable.py``). Exit codes: 0 done, 2 bad input, 4 the output
could not be written, 1 other failures.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from gspo_megatron.checkpoint import launch


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gspo-reshard", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="source gspo-megatron checkpoint")
    parser.add_argument("--out", help="checkpoint directory to create (weights-only reshard)")
    parser.add_argument("--portable-optimizer", action="store_true",
                        help="rewrite the optimizer state of --ckpt in the portable form, in place")
    parser.add_argument("--config", help="with --portable-optimizer: the run's config.yaml "
                                         "(its optimizer settings build the optimizer to load)")
    launch.add_parallel_args(parser)
    launch.add_common_args(parser)
    args = parser.parse_args(argv)
    if args.portable_optimizer:
        if not args.config:
            parser.error("--portable-optimizer needs --config (the run's config.yaml)")
        return _portable(args.ckpt, args.config)
    if not args.out:
        parser.error("--out is required (or --portable-optimizer)")
    parallel = launch.parallel_from_args(args)

    def run() -> None:
        from gspo_megatron.checkpoint.reshard import reshard_checkpoint

        reshard_checkpoint(args.ckpt, args.out, parallel, overwrite=args.overwrite)

    return launch.run_collective(parallel, run)


def _portable(ckpt: str, config: str) -> int:
    """The checkpoint's own layout (from its gspo_meta.json) with the run's config."""
    from omegaconf import OmegaConf

    from gspo_megatron.config import ConfigError, load_config
    from gspo_megatron.config.schema import ParallelConfig
    from gspo_megatron.learner.checkpoint_files import CheckpointError
    from gspo_megatron.learner.checkpointing import read_meta

    try:
        meta = read_meta(ckpt)
        cfg = load_config(config, validate=False)
    except (CheckpointError, ConfigError, OSError) as exc:
        print(f"gspo-reshard: {exc}", file=sys.stderr)
        return launch.EXIT_BAD_INPUT
    saved = {k: v for k, v in meta["parallel"].items() if k != "world_size"}
    cfg.parallel = OmegaConf.structured(ParallelConfig(**saved))

    def run() -> None:
        from gspo_megatron.checkpoint.portable import make_portable
        from gspo_megatron.distributed.runtime import init_distributed

        make_portable(ckpt, cfg, init_distributed(cfg.parallel, seed=cfg.trainer.seed))

    return launch.run_collective(cfg.parallel, run)


if __name__ == "__main__":
    sys.exit(main())
