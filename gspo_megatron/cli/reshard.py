"""``gspo-reshard --ckpt DIR --out DIR --tp N --pp N --ep N ...``: re-save a checkpoint under the
target layout given by the flags (launch that many processes). Exit codes: 0 done, 2 bad input,
1 other failures.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from gspo_megatron.checkpoint import launch


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gspo-reshard", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="source gspo-megatron checkpoint")
    parser.add_argument("--out", required=True, help="checkpoint directory to create")
    launch.add_parallel_args(parser)
    launch.add_common_args(parser)
    args = parser.parse_args(argv)
    parallel = launch.parallel_from_args(args)

    def run() -> None:
        from gspo_megatron.checkpoint.reshard import reshard_checkpoint

        reshard_checkpoint(args.ckpt, args.out, parallel, overwrite=args.overwrite)

    return launch.run_collective(parallel, run)


if __name__ == "__main__":
    sys.exit(main())
