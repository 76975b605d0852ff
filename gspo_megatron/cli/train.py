"""``gspo-train CONFIG [key=value ...] [--resume]``: run GSPO (or GRPO) training.

Launch one process per learner rank (``torchrun`` or Slurm ``srun``; a plain call is one rank).
Exit codes: 0 done; 2 bad configuration or input (message names the file / key; nothing is
written); 3 training stopped on repeated non-finite losses (last good state saved); 4 an output
could not be written (disk full or I/O error: the message names the path, the partial output is
removed, and a rerun resumes from the last complete checkpoint); 5 the rollout servers failed:
a sample failed on every server it was tried on (a killed or wedged fleet), or a server does not
serve the learner's weights after a sync (``rollout.weight_sync.verify``); the message names the
server or the sample, and the last complete checkpoint stays;
124 preempted (checkpointed after the current step, or after the last completed one when the
job's deadline left no room to finish the open step, or signalled during start-up): requeue to
resume; 125 preempted with no room for a checkpoint before the job's deadline: requeue, and the
resumed run redoes the steps since the last complete checkpoint (the log names it). A missing, unreadable or world-readable server key file, or servers that refuse the
job's keys (401 / 403, named), are bad input: 2.

Start-up order, each step before anything slower: preemption handlers (SIGUSR1 would otherwise
end the job with no requeue); config; the run directory's lock (one job per run directory);
leftovers of interrupted writes cleaned; inputs checked and parts built; only then is
``config.yaml`` written and training started.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, List, Optional

EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_WRITE_FAILED = 4
EXIT_ROLLOUT = 5
# Write failures that end a run with EXIT_WRITE_FAILED wherever they happen (a metrics line,
# the lock file): full disk, quota, read-only file system.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


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


def _main_rank_first(runtime, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the main rank; re-raise its exception on every rank (collective)."""
    error = None
    if runtime.is_main:
        try:
            fn()
        except Exception as exc:  # handed to every rank, then classified by the caller
            error = exc
    if runtime.world_size > 1:
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error


def _any_rank(runtime, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any (collective)."""
    if runtime.world_size == 1:
        return flag
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)], device=runtime.device)  # NCCL reduces device tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def main(argv: Optional[List[str]] = None) -> int:
    from gspo_megatron.trainer.preemption import PreemptionFlag

    preemption = PreemptionFlag()  # first of all: SIGUSR1's default action ends the job (138)
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    _setup_logging(rank)
    log = logging.getLogger("gspo-train")

    from gspo_megatron.config import ConfigError
    from gspo_megatron.planner.fit_check import load_fitting_config

    overrides = list(args.overrides) + (["checkpoint.resume=always"] if args.resume else [])
    try:
        from gspo_megatron.distributed.runtime import detect_launch_env

        cfg = load_fitting_config(args.config, overrides, world_size=detect_launch_env().world_size)
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    code = preemption.exit_code_if_requested("loading the config")
    if code is not None:
        return code
    from gspo_megatron.distributed.cpu_bf16_matmul import bf16_matmuls_in_fp32, setting_from_env
    from gspo_megatron.distributed.startup_gc import thaw_start_up

    try:
        setting = setting_from_env()
    except ValueError as exc:  # the variable's value, named
        log.error("%s", exc)
        return EXIT_CONFIG
    computes_bf16 = cfg.model.params_dtype == "bf16" or cfg.rollout.embedded_dtype == "bf16"
    try:
        with bf16_matmuls_in_fp32(computes_bf16, setting):  # a CPU without bf16 dot products
            return _run(cfg, preemption, log)
    finally:  # after the run's frame is gone, or its parts could not be collected
        thaw_start_up()
        preemption.close()


def _prepare_run_dir(cfg, runtime, lock) -> None:
    """Take the run directory (main rank), then tidy interrupted writes before anything else
    is written: a leftover ``.partial`` may be what fills the disk."""
    from gspo_megatron.learner.checkpoint_files import checkpoint_root, clean_leftovers

    run_dir = Path(cfg.logging.run_dir)
    _main_rank_first(runtime, lock.acquire)

    def tidy() -> None:
        clean_leftovers(checkpoint_root(cfg.checkpoint, run_dir))
        clean_leftovers(run_dir)

    _main_rank_first(runtime, tidy)


def _write_config(cfg, runtime) -> None:
    from gspo_megatron.config import save_config
    from gspo_megatron.learner.disk_space import OutputWriteError, describe_write_failure

    def write() -> None:
        path = Path(cfg.logging.run_dir) / "config.yaml"
        try:
            save_config(cfg, path)
        except OSError as exc:
            raise OutputWriteError(describe_write_failure(exc, path, "config.yaml")) from None

    _main_rank_first(runtime, write)


def _exit_code(exc: BaseException, run_dir: Path, log: logging.Logger) -> Optional[int]:
    """The exit code of an expected failure (logged as one line); None for anything else."""
    from gspo_megatron.config import ConfigError
    from gspo_megatron.data.records import DataLoadError
    from gspo_megatron.learner.checkpoint_files import CheckpointError
    from gspo_megatron.learner.disk_space import OutputWriteError, describe_write_failure
    from gspo_megatron.learner.learner import NonFiniteTrainingError
    from gspo_megatron.rewards.registry import RewardLookupError
    from gspo_megatron.rollout.sglang.server_keys import KeyFileError
    from gspo_megatron.rollout.routed_experts import MalformedRouting
    from gspo_megatron.rollout.types import MalformedLogprobs
    from gspo_megatron.rollout.sglang.server_pool import NoLiveServer
    from gspo_megatron.rollout.sglang.client import ServerAuthError
    from gspo_megatron.rollout.sglang.engine import SampleFailed, ServerSetupError
    from gspo_megatron.trainer.run_lock import RunDirLockedError
    from gspo_megatron.trainer.sync_check import WeightsDidNotArrive
    from gspo_megatron.weight_sync.sync import BucketFailed

    bad_input = (ConfigError, DataLoadError, RewardLookupError, RunDirLockedError, CheckpointError,
                 KeyFileError, ServerAuthError, ServerSetupError)
    if isinstance(exc, bad_input):
        code, message = EXIT_CONFIG, str(exc)
    elif isinstance(exc, (WeightsDidNotArrive, SampleFailed, NoLiveServer, BucketFailed,
                          MalformedRouting, MalformedLogprobs)):
        code, message = EXIT_ROLLOUT, f"rollout servers: {exc}"
    elif isinstance(exc, NonFiniteTrainingError):
        code, message = EXIT_NONFINITE, str(exc)
    elif isinstance(exc, OutputWriteError):
        code, message = EXIT_WRITE_FAILED, str(exc)
    elif isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
        code = EXIT_WRITE_FAILED
        message = describe_write_failure(exc, exc.filename or run_dir, "the run's outputs")
    else:
        return None
    log.error("%s", message)
    return code


def _run(cfg, preemption, log: logging.Logger) -> int:
    from gspo_megatron.config import ConfigError
    from gspo_megatron.distributed.child_processes import children_die_with_this_process
    from gspo_megatron.distributed.runtime import init_distributed, shutdown_distributed
    from gspo_megatron.distributed.startup_gc import collector_paused_for_start_up
    from gspo_megatron.trainer.preemption import REQUEUE_EXIT_CODE
    from gspo_megatron.trainer.run_lock import RunDirLock

    children_die_with_this_process()
    run_dir = Path(cfg.logging.run_dir)
    created_run_dir = not run_dir.exists()
    lock = RunDirLock(run_dir)
    try:
        with collector_paused_for_start_up():  # imports and model building: no garbage to find
            runtime = init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    except ConfigError as exc:  # a layout these processes cannot run, a rendezvous that failed
        log.error("%s", exc)
        return EXIT_CONFIG
    finished = False
    parts = None
    try:
        from gspo_megatron.trainer.build import build_parts
        from gspo_megatron.trainer.loop import run_training

        _prepare_run_dir(cfg, runtime, lock)
        with collector_paused_for_start_up():
            parts = build_parts(cfg, runtime, preemption)
        if _any_rank(runtime, preemption.requested):  # signalled while building: requeue
            return preemption.exit_code_if_requested("building the run") or REQUEUE_EXIT_CODE
        _write_config(cfg, runtime)
        code = run_training(parts)
        finished = True
        return code
    except Exception as exc:  # expected failures become one line and an exit code
        code = _exit_code(exc, run_dir, log)
        if code is None:
            raise
        return code
    finally:
        if parts is not None:  # run_training closed them already unless something failed first
            parts.close()
        lock.release()
        if created_run_dir and not finished and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # a start that failed leaves no trace
        shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
