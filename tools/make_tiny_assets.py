#!/usr/bin/env python
"""Write the tiny CPU demo's assets: a random-init tiny Qwen3-MoE with its character tokenizer,
and the addition train / held-out eval JSONL files.

    python tools/make_tiny_assets.py runs/tiny_assets
    # -> runs/tiny_assets/model/, runs/tiny_assets/data/{train,eval}.jsonl
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from gspo_megatron.tiny_task.assets import make_tiny_assets
from gspo_megatron.tiny_task.task import AdditionTaskConfig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write model/ and data/ into")
    defaults = AdditionTaskConfig()
    parser.add_argument("--num-digits", type=int, default=defaults.num_digits)
    parser.add_argument("--num-train", type=int, default=defaults.num_train)
    parser.add_argument("--num-eval", type=int, default=defaults.num_eval)
    parser.add_argument("--seed", type=int, default=0, help="model init seed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    task = AdditionTaskConfig(num_digits=args.num_digits, num_train=args.num_train,
                              num_eval=args.num_eval)
    try:
        assets = make_tiny_assets(args.out_dir, task=task, seed=args.seed)
    except (OSError, ValueError) as exc:
        logging.error("could not write tiny assets: %s", exc)
        return 1
    logging.info("wrote %s, %s, %s", assets.model_dir, assets.train_path, assets.eval_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
