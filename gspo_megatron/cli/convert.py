"""``gspo-convert --hf-dir DIR --out DIR [--tp N --pp N --ep N ...]``: HF -> gspo-megatron checkpoint.

Run one process per rank of the chosen layout (``torchrun --nproc_per_node=N`` or ``srun``); a
plain call is one process. More processes means less host memory per process. Exit codes: 0 done,
2 bad input (missing shard, truncated file, config that does not match the weights, unsupported
architecture, existing output), 4 the output could not be written (disk full: checked against
the checkpoint's size first; the partial output is removed), 1 other failures.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from gspo_megatron.checkpoint import launch


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gspo-convert", description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True, help="Hugging Face Qwen3 / Qwen3-MoE directory")
    parser.add_argument("--out", required=True, help="checkpoint directory to create")
    launch.add_parallel_args(parser)
    launch.add_common_args(parser)
    args = parser.parse_args(argv)
    parallel = launch.parallel_from_args(args)

    def run() -> None:
        from gspo_megatron.checkpoint.convert import convert_hf_to_megatron

        convert_hf_to_megatron(args.hf_dir, args.out, parallel, launch.base_model_config(args),
                               overwrite=args.overwrite, log_every=args.log_every)

    return launch.run_collective(parallel, run)


if __name__ == "__main__":
    sys.exit(main())
