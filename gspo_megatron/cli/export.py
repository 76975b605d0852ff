"""``gspo-export --ckpt DIR --out DIR [--max-shard-size 5GB] [--tp N --pp N --ep N ...]``:
gspo-megatron checkpoint -> Hugging Face directory (sharded safetensors, index, config.json,
generation_config.json, tokenizer files).

The layout flags say how this run splits the model (any layout loads any checkpoint). Exit codes:
0 done; 2 bad input (not a checkpoint, a damaged or incomplete one, existing output, a bad
``--max-shard-size``: rejected while parsing the arguments, before anything is loaded); 4 the
output could not be written (disk full: the partial output is removed); 1 other failures.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from gspo_megatron.checkpoint import launch


def _shard_size(text: str) -> int:
    """argparse type of ``--max-shard-size``: a clear usage error (exit 2) for a bad size."""
    from gspo_megatron.checkpoint.export import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gspo-export", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True,
                        help="gspo-megatron checkpoint directory, or a run's checkpoints/ "
                             "directory (its newest complete step is exported)")
    parser.add_argument("--out", required=True, help="Hugging Face directory to create")
    parser.add_argument("--max-shard-size", default="5GB", type=_shard_size,
                        help="bytes per safetensors shard, e.g. 5GB, 500MB (default 5GB)")
    parser.add_argument("--tokenizer-dir", default=None,
                        help="copy tokenizer files from here (default: the HF directory the "
                             "checkpoint was converted from, if recorded)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                        help="cast on export (default: the checkpoint's dtype)")
    launch.add_parallel_args(parser)
    launch.add_common_args(parser)
    args = parser.parse_args(argv)
    parallel = launch.parallel_from_args(args)

    def run() -> None:
        from gspo_megatron.checkpoint.export import export_megatron_to_hf

        export_megatron_to_hf(args.ckpt, args.out, parallel, args.max_shard_size,
                              tokenizer_dir=args.tokenizer_dir, dtype=args.dtype,
                              overwrite=args.overwrite, log_every=args.log_every)

    return launch.run_collective(parallel, run)


if __name__ == "__main__":
    sys.exit(main())
