"""Start and stop the distributed runtime of a learner process, on GPU or CPU.

One place reads the launcher's environment (torchrun or Slurm ``srun``), picks NCCL on GPU and
gloo on CPU (applying the Megatron-Core CPU compatibility layer only there), initialises
``torch.distributed`` and Megatron's ``parallel_state`` for the configured TP/PP/VPP/CP/EP/ETP
layout, and seeds every RNG reproducibly. Everything else asks :class:`RuntimeInfo`, never the
environment.

    rt = init_distributed(cfg.parallel, seed=cfg.trainer.seed)   # rt.device, rt.rank, rt.is_main
    try:
        ...
    finally:
        shutdown_distributed()

Parallel sizes are not copied here: Megatron's ``parallel_state`` is their one source at run time
(the learner asks it), and ``config.validate.world_size_errors`` the one check of the layout
against the launched processes.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from gspo_megatron.config.schema import ParallelConfig
from gspo_megatron.config.validate import ConfigError, world_size_errors
from gspo_megatron.distributed.ports import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str
    """``torchrun``, ``slurm`` or ``single``."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What the rest of the program needs to know about the running job."""

    launch: LaunchEnv
    device: torch.device
    backend: str
    """``nccl`` on GPU, ``gloo`` on CPU."""

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0


def _first_slurm_host(nodelist: str) -> str:
    """First hostname of a Slurm node list, via ``scontrol`` when present (it knows the syntax)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                             capture_output=True, text=True, timeout=30).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    head = nodelist.split(",")[0]
    if "[" in head:  # node[01-04] -> node01
        prefix, rest = head.split("[", 1)
        head = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    return head


def detect_launch_env(environ: Optional[dict] = None) -> LaunchEnv:
    """Read rank/world/master from torchrun variables, else Slurm's, else a single process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                         "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "localhost"))
        default_port = 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)), addr,
                         int(env.get("MASTER_PORT", default_port)), "slurm")
    # One process (a plain call, or a one-task Slurm step) needs no reachable master: loopback.
    return LaunchEnv(0, 1, 0, "127.0.0.1", free_port(), "single")


def _init_default_group(launch: LaunchEnv, backend: str, timeout: timedelta) -> None:
    """The default process group. One process rendezvouses with itself through an in-process
    store: a TCP store on a port picked ahead (``free_port``) loses when another process binds
    that port first (EADDRINUSE; seen when trainers start side by side). Several processes meet
    at ``MASTER_ADDR:MASTER_PORT``; a port that cannot be bound is a clear error naming it."""
    if launch.launcher == "single":
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    try:
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
            rank=launch.rank, world_size=launch.world_size, timeout=timeout)
    except dist.DistNetworkError as exc:
        raise ConfigError(
            f"rank {launch.rank} of {launch.world_size} ({launch.launcher}) could not meet the "
            f"others at {launch.master_addr}:{launch.master_port} (MASTER_ADDR / MASTER_PORT): "
            f"{str(exc).splitlines()[0]}") from None


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int, rank_offset: int = 0) -> None:
    """Seed Python, NumPy and torch; Megatron's model-parallel RNG tracker is seeded separately."""
    random.seed(seed + rank_offset)
    np.random.seed((seed + rank_offset) % (2**32))
    torch.manual_seed(seed + rank_offset)


def init_distributed(parallel: ParallelConfig, seed: int = 1234,
                     timeout_minutes: int = 30, environ: Optional[dict] = None) -> RuntimeInfo:
    """Initialise torch.distributed + Megatron parallel state; idempotent per process."""
    launch = detect_launch_env(environ)
    problems = world_size_errors(parallel, launch.world_size)
    if problems:
        raise ConfigError(f"{launch.world_size} processes launched ({launch.launcher}) cannot run "
                          "this layout:\n  " + "\n  ".join(problems))

    device = pick_device(launch.local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cpu":
        from gspo_megatron.distributed.cpu_compat import apply_cpu_compat

        apply_cpu_compat()  # before the first Megatron import (see its jit_fuser patch)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        _init_default_group(launch, backend, timedelta(minutes=timeout_minutes))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            virtual_pipeline_model_parallel_size=parallel.vpp,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp,
            distributed_timeout_minutes=timeout_minutes,
        )
    seed_everything(seed)
    model_parallel_cuda_manual_seed(seed)
    info = RuntimeInfo(launch=launch, device=device, backend=backend)
    if info.is_main:
        log.info("distributed runtime up: %s", info)
    return info


def shutdown_distributed() -> None:
    """Tear down Megatron groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _drop_groups_left_in(parallel_state)
    if dist.is_initialized():
        dist.destroy_process_group()


def _drop_groups_left_in(module) -> None:
    """Forget the process groups ``destroy_model_parallel`` leaves in ``parallel_state``.

    Megatron-Core 0.16.1 never resets ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its
    ``_GLOO`` twin (megatron/core/parallel_state.py: set in ``initialize_model_parallel``, absent
    from ``destroy_model_parallel``), so a gloo group, with its sockets, epoll and pipes, outlived
    each runtime (8 descriptors per init/shutdown, measured). Every module-level group is
    dropped, not only those two, so a group a later version leaves behind is dropped too."""
    for name, value in list(vars(module).items()):
        if name.startswith("_") and name.isupper() and _holds_a_group(value):
            setattr(module, name, None)


def _holds_a_group(value) -> bool:
    if isinstance(value, dist.ProcessGroup):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, dist.ProcessGroup) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, dist.ProcessGroup) for v in value.values())
    return False
