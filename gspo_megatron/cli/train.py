"""``gspo-train CONFIG [key=value ...] [--resume]``: run GSPO (or GRPO) training.

Launch one process per learner rank (``torchrun`` or Slurm ``srun``; a plain call is one rank).
Exit codes: 0 done; 2 bad configuration or input (message names the file / key); 3 training
stopped on repeated non-finite losses (last good state saved); 124 checkpointed after a
preemption signal, requeue to resume.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from typing import List, Optional

EXIT_CONFIG = 2
EXIT_NONFINITE = 3


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("megatron", "matplotlib", "urllib3"):  # their INFO lines bury the run's own
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gspo-train", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML file in configs/ (may start from others via defaults:)")
    parser.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. algo.loss=grpo")
    parser.add_argument("--resume", action="store_true",
                        help="require resuming from the run directory's last checkpoint")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    _setup_logging(rank)
    log = logging.getLogger("gspo-train")

    from gspo_megatron.config import ConfigError, save_config
    from gspo_megatron.planner.fit_check import load_fitting_config
    from gspo_megatron.data.records import DataLoadError
    from gspo_megatron.rewards.registry import RewardLookupError
    from gspo_megatron.distributed.runtime import detect_launch_env, init_distributed, shutdown_distributed

    overrides = list(args.overrides) + (["checkpoint.resume=always"] if args.resume else [])
    try:
        cfg = load_fitting_config(args.config, overrides, world_size=detect_launch_env().world_size)
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    runtime = init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    try:
        from gspo_megatron.learner.learner import NonFiniteTrainingError
        from gspo_megatron.trainer.build import build_parts
        from gspo_megatron.trainer.loop import run_training

        if runtime.is_main:
            save_config(cfg, os.path.join(cfg.logging.run_dir, "config.yaml"))
        try:
            parts = build_parts(cfg, runtime)
            return run_training(parts)
        except (ConfigError, DataLoadError, RewardLookupError) as exc:
            log.error("%s", exc)
            return EXIT_CONFIG
        except NonFiniteTrainingError as exc:
            log.error("%s", exc)
            return EXIT_NONFINITE
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
