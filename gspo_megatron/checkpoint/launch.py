"""Shared command-line plumbing of the convert / export / reshard tools.

Parallel-layout flags, logging (rank 0 at INFO), the distributed runtime around the collective
operation, and exit codes: 0 done, 2 bad input (the message names the file or key), 4 the output
could not be written (disk full or I/O error; the message names the path and the partial output
is removed), 1 anything else. The CLIs in :mod:`gspo_megatron.cli` stay a few lines each.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Callable

from gspo_megatron.config.schema import ModelConfig, ParallelConfig

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_WRITE_FAILED = 0, 1, 2, 4
log = logging.getLogger("gspo_megatron.checkpoint")


def positive_int(text: str) -> int:
    """argparse type for sizes and counts: a usage error (exit 2) unless an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallel layout of this run (launch tp*pp*cp*dp processes; "
                                  "the checkpoint itself loads under any layout)")
    for flag in ("tp", "pp", "ep", "etp"):
        g.add_argument(f"--{flag}", type=positive_int, default=1, help=f"{flag} size (default 1)")
    g.add_argument("--vpp", type=positive_int, default=None,
                   help="virtual pipeline stages per rank")
    g.add_argument("--first-stage-layers", type=int, default=None,
                   help="uneven pipeline: layers on the first stage (default: even split, or "
                        "a balanced uneven one when --pp does not divide the layer count)")
    g.add_argument("--last-stage-layers", type=int, default=None,
                   help="uneven pipeline: layers on the last stage")
    g.add_argument("--sp", action="store_true",
                   help="sequence parallelism (always on when tp > 1: Megatron needs it for "
                        "MoE + TP, and it does not change the checkpoint)")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--log-every", type=positive_int, default=100,
                        help="log progress every N tensors (default 100)")
    parser.add_argument("--transformer-impl", default="auto",
                        choices=["auto", "local", "transformer_engine"],
                        help="layer spec to build (default: TE on GPU, local on CPU)")


def parallel_from_args(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp,
                          sp=args.sp or args.tp > 1,
                          num_layers_in_first_pipeline_stage=args.first_stage_layers,
                          num_layers_in_last_pipeline_stage=args.last_stage_layers)


def base_model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(transformer_impl=args.transformer_impl)


def _is_bad_input(exc: BaseException) -> bool:
    from gspo_megatron.checkpoint.hf_io import HFCheckpointError
    from gspo_megatron.checkpoint.mapping import MappingError
    from gspo_megatron.config.validate import ConfigError
    from gspo_megatron.learner.checkpoint_files import CheckpointError

    return isinstance(exc, (HFCheckpointError, MappingError, ConfigError, CheckpointError,
                            FileExistsError, FileNotFoundError))


def run_collective(parallel: ParallelConfig, fn: Callable[[], object]) -> int:
    """Initialise the runtime for ``parallel``, call ``fn`` on every rank, map errors to codes."""
    from gspo_megatron.distributed.runtime import init_distributed, shutdown_distributed
    from gspo_megatron.distributed.startup_gc import collector_paused_for_start_up, thaw_start_up

    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from gspo_megatron.distributed.child_processes import children_die_with_this_process

    children_die_with_this_process()  # checkpoint writer processes end with this tool
    try:
        with collector_paused_for_start_up():  # Megatron-Core's import: no garbage to find
            init_distributed(parallel)
        fn()
        return EXIT_OK
    except Exception as exc:  # the tool's contract is an exit code plus one clear line
        from gspo_megatron.learner.disk_space import OutputWriteError

        if _is_bad_input(exc):
            log.error("%s", exc)
            return EXIT_BAD_INPUT
        if isinstance(exc, OutputWriteError):
            log.error("%s", exc)
            return EXIT_WRITE_FAILED
        log.exception("failed: %s", exc)
        return EXIT_ERROR
    finally:
        shutdown_distributed()
        thaw_start_up()
