#!/usr/bin/env python
"""Write the tiny CPU demo's assets: a random-init tiny Qwen3-MoE with its character tokenizer,
and a task's train / held-out eval JSONL files (2-digit addition, or the long-tail repeat task).

    python tools/make_tiny_assets.py runs/tiny_assets
    # -> runs/tiny_assets/model/, runs/tiny_assets/data/{train,eval}.jsonl (addition)
    python tools/make_tiny_assets.py runs/tiny_longtail_assets --task repeat
    # the same model; data/ of the repeat task ("7*12=" -> twelve 7s, configs/tiny_longtail.yaml)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from gspo_megatron.tiny_task.assets import make_tiny_assets
from gspo_megatron.tiny_task.repeat_task import RepeatTaskConfig
from gspo_megatron.tiny_task.task import AdditionTaskConfig


def task_config(args: argparse.Namespace):
    """The task's config: its own defaults, overridden by the options given."""
    sizes = {k: v for k, v in (("num_train", args.num_train), ("num_eval", args.num_eval))
             if v is not None}
    if args.task == "addition":
        if args.max_count is not None:
            raise ValueError("--max-count belongs to --task repeat")
        digits = {} if args.num_digits is None else {"num_digits": args.num_digits}
        return AdditionTaskConfig(**sizes, **digits)
    if args.num_digits is not None:
        raise ValueError("--num-digits belongs to --task addition")
    count = {} if args.max_count is None else {"max_count": args.max_count}
    return RepeatTaskConfig(**sizes, **count)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write model/ and data/ into")
    parser.add_argument("--task", choices=("addition", "repeat"), default="addition",
                        help="addition (default, configs/tiny_cpu.yaml) or the long-tail repeat "
                             "task (configs/tiny_longtail.yaml)")
    parser.add_argument("--num-train", type=int, help="train rows (addition 4000, repeat 4096)")
    parser.add_argument("--num-eval", type=int, help="eval rows (addition 200, repeat 192)")
    parser.add_argument("--num-digits", type=int,
                        help=f"addition: digits per operand ({AdditionTaskConfig().num_digits})")
    parser.add_argument("--max-count", type=int,
                        help=f"repeat: longest answer ({RepeatTaskConfig().max_count})")
    parser.add_argument("--seed", type=int, default=0, help="model init seed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        assets = make_tiny_assets(args.out_dir, task=task_config(args), seed=args.seed)
    except (OSError, ValueError) as exc:
        logging.error("could not write tiny assets: %s", exc)
        return 1
    logging.info("wrote %s, %s, %s", assets.model_dir, assets.train_path, assets.eval_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
