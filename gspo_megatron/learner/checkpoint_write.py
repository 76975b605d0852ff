"""Write a checkpoint directory so that it is either complete or absent.

Collective (every rank calls :func:`atomic_save`):

1. rank 0 checks the free space against the checkpoint's size (the sharded tensors' bytes,
   summed over ranks) and creates ``<dir>.partial``; if that fails, every rank raises the same
   :class:`OutputWriteError`, so no rank enters the save alone;
2. ``dist_checkpointing.save`` writes into ``<dir>.partial`` in this process, one tensor at a
   time (``learner/streaming_save.py``: no copy of the model, no writer processes); a failure
   there (a shard write, reported on every rank by ``save_state_dict_async_finalize`` in
   megatron-core 0.16.1 ``strategies/state_dict_saver.py``) removes the partial directory and
   raises one readable :class:`OutputWriteError` (``learner/disk_space.py``);
3. rank 0 writes ``gspo_meta.json``, then ``manifest.json`` (``learner/checkpoint_files.py``),
   then renames the directory into place (an older version is kept as ``<dir>.old`` until the
   rename is done; ``clean_leftovers`` finishes or undoes an interrupted rename).

A failure on rank 0 alone inside step 2 (``common.pt``, ``.metadata``) leaves the other ranks
waiting in a collective; the launcher (torchrun, srun) ends them when rank 0 exits.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from gspo_megatron.faults import kill_points
from gspo_megatron.learner.checkpoint_files import META_FILE, write_manifest
from gspo_megatron.learner.disk_space import (OutputWriteError, check_free_space,
                                              describe_write_failure)

FORMAT = "gspo-megatron-v1"

log = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def jsonable(value):
    """Dataclasses and OmegaConf nodes as plain JSON values; anything else unchanged."""
    if is_dataclass(value):
        return asdict(value)
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return value


def _rank0_then_agree(fn: Callable[[], None], path: Path, what: str) -> None:
    """Run ``fn`` on rank 0; if it fails, every rank raises the same :class:`OutputWriteError`."""
    message = None
    if _rank() == 0:
        try:
            fn()
        except OutputWriteError as exc:
            message = str(exc)
        except OSError as exc:
            message = describe_write_failure(exc, path, what)
    if _world() > 1:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message:
        raise OutputWriteError(message)


PER_TENSOR_BYTES = 2300
"""What dist_checkpointing writes per sharded tensor or object beyond its data and key: its
record in a ``.distcp`` file and its entry in ``.metadata`` (torch 2.13 / megatron-core 0.16.1).
Measured: 2430 bytes per record in the tiny trainer's checkpoint (153 records), 2720 in its
converted model (61), 1900-2080 for lone 1-D tensors; 2300 keeps the estimate of the first two
within 4% (docs/reliability.md, disk rows) and never far above a real one."""
FIXED_BYTES = 6 << 10
"""``common.pt``, ``metadata.json``, our manifest and meta, ``.metadata``'s own header."""


def _state_nbytes(state: Dict[str, Any]) -> int:
    """Bytes the checkpoint of ``state`` will take, summed over ranks (collective): tensor data
    plus the format's per-record and fixed overhead (within a few percent of what is written)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase, is_main_replica

    local, todo = (FIXED_BYTES if _rank() == 0 else 0), [state]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            todo.extend(node.values())
        elif isinstance(node, (list, tuple)):
            todo.extend(node)
        elif isinstance(node, ShardedBase):
            data = getattr(node, "data", None)
            if not is_main_replica(node.replica_id):
                continue
            if torch.is_tensor(data):
                local += data.numel() * data.element_size() + PER_TENSOR_BYTES + len(node.key)
            elif data is not None:  # a ShardedObject (e.g. TE's _extra_state), pickled
                local += len(pickle.dumps(data)) + PER_TENSOR_BYTES + len(node.key)
        elif torch.is_tensor(node) and _rank() == 0:  # common state, written by rank 0
            local += node.numel() * node.element_size()
    if _world() > 1:
        on_gpu = dist.get_backend() == "nccl"  # NCCL reduces device tensors only
        total = torch.tensor([local], dtype=torch.int64,
                             device=torch.cuda.current_device() if on_gpu else "cpu")
        dist.all_reduce(total)
        return int(total.item())
    return local


def save_strategy(spread_writes: bool):
    """The in-process streaming writer (``learner/streaming_save.py``); with ``spread_writes``
    wrapped in megatron-core's ``FullyParallelSaveStrategyWrapper`` over the whole world
    (``strategies/fully_parallel.py``): each tensor that several ranks hold (data-parallel
    replicas of the weights) is written by one of them, chosen so that every rank writes about
    as much, instead of always by the first replica."""
    from gspo_megatron.learner.streaming_save import StreamingSaveStrategy

    strategy = StreamingSaveStrategy()
    if not spread_writes or _world() == 1:
        return strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)

    return FullyParallelSaveStrategyWrapper(strategy, dist.group.WORLD)


def atomic_save(state: Dict[str, Any], directory: str | Path, meta: Dict[str, Any],
                spread_writes: bool = False) -> None:
    """Write ``state`` into ``<dir>.partial`` and rename it into place once it is complete.

    Collective. Before writing, the expected size is checked against the free space; if any
    write fails, the partial directory is removed and every rank raises one
    :class:`OutputWriteError` that names the path and the cause. The manifest is written last.
    ``spread_writes``: see :func:`save_strategy`.
    """
    from megatron.core import dist_checkpointing

    final = Path(directory)
    partial = final.with_name(final.name + ".partial")
    what = f"checkpoint {final.name}"
    expected = _state_nbytes(state)

    def prepare() -> None:
        shutil.rmtree(partial, ignore_errors=True)
        check_free_space(partial.parent, expected, what)
        partial.mkdir(parents=True)

    _rank0_then_agree(prepare, final, what)
    _barrier()
    try:
        dist_checkpointing.save(state, str(partial), sharded_strategy=save_strategy(spread_writes))
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        message = describe_write_failure(exc, final, what)
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            log.error("%s; removed %s", message, partial)
        raise OutputWriteError(message) from None
    _barrier()

    def finish() -> None:
        try:
            body = {"format": FORMAT, **{k: jsonable(v) for k, v in meta.items()}}
            (partial / META_FILE).write_text(json.dumps(body, indent=2, sort_keys=True))
            if kill_points.armed("checkpoint"):  # test hook: dies with the manifest unwritten
                kill_points.kill("checkpoint", f"{partial}: "
                                 f"{sorted(p.name for p in partial.iterdir())} written, no manifest")
            write_manifest(partial)
            _publish(partial, final)
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise OutputWriteError(describe_write_failure(exc, final, what)) from None
        log.info("saved checkpoint %s (step %s)", final, meta.get("step"))

    _rank0_then_agree(finish, final, what)
    _barrier()


def _publish(partial: Path, final: Path) -> None:
    """Rename a complete ``partial`` to ``final``, replacing an older ``final`` (kept until then)."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
