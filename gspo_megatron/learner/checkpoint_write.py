"""Write a checkpoint directory so that it is either complete or absent.

Collective (every rank calls :func:`atomic_save`):

1. rank 0 checks the free space against the checkpoint's size (the sharded tensors' bytes,
   summed over ranks) and creates ``<dir>.partial``; if that fails, every rank raises the same
   :class:`OutputWriteError`, so no rank enters the save alone;
2. ``dist_checkpointing.save`` plans the save with every rank and writes into
   ``<dir>.partial`` in this process, one tensor at a time (``learner/streaming_save.py``: no
   copy of the model, no writer processes), in the foreground or in a background thread
   (:func:`begin_save`: the trainer's periodic saves, written while the next step's rollout
   is generated); a failure there (a shard write, reported on every rank by
   ``save_state_dict_async_finalize`` in megatron-core 0.16.1 ``strategies/state_dict_saver.py``
   when the save is finished) removes the partial directory and raises one readable
   :class:`OutputWriteError` (``learner/disk_space.py``);
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
import threading
import time
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from gspo_megatron.distributed.host_heap import resident_bytes
from gspo_megatron.faults import kill_points
from gspo_megatron.learner.checkpoint_files import META_FILE, STEP_PREFIX, write_manifest
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


class SaveCache:
    """What repeated saves of one state's structure keep (one per learner and optimizer form):
    the save strategy, which then reuses its save plan (megatron-core's ``cached_metadata``,
    ``strategies/torch.py``, checked against each new local plan) and its spread of the writes
    (``do_cache_distribution``), and whether the structure's sharding was validated (the first
    save validates it, ``validate_access_integrity``). These exchanges over every rank are most
    of the time a save holds the step for."""

    def __init__(self) -> None:
        self.strategies: Dict[bool, Any] = {}
        self.validated = False

    def strategy(self, spread_writes: bool):
        if spread_writes not in self.strategies:
            self.strategies[spread_writes] = save_strategy(spread_writes, cached=True)
        return self.strategies[spread_writes]


def save_strategy(spread_writes: bool, cached: bool = False):
    """The in-process streaming writer (``learner/streaming_save.py``); with ``spread_writes``
    wrapped in megatron-core's ``FullyParallelSaveStrategyWrapper`` over the whole world
    (``strategies/fully_parallel.py``): each tensor that several ranks hold (data-parallel
    replicas of the weights) is written by one of them, chosen so that every rank writes about
    as much, instead of always by the first replica."""
    from gspo_megatron.learner.streaming_save import StreamingSaveStrategy

    strategy = StreamingSaveStrategy(cached_metadata=cached)
    if not spread_writes or _world() == 1:
        return strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)

    return FullyParallelSaveStrategyWrapper(strategy, dist.group.WORLD,
                                            do_cache_distribution=cached)


def atomic_save(state: Dict[str, Any], directory: str | Path, meta: Dict[str, Any],
                spread_writes: bool = False) -> "SaveReport":
    """Write ``state`` into ``<dir>.partial`` and rename it into place once it is complete.

    Collective. Before writing, the expected size is checked against the free space; if any
    write fails, the partial directory is removed and every rank raises one
    :class:`OutputWriteError` that names the path and the cause. The manifest is written last.
    ``spread_writes``: see :func:`save_strategy`.
    """
    return begin_save(state, directory, meta, spread_writes, background=False).finish()


@dataclass
class SaveReport:
    """One finished save, as this rank saw it (``checkpoint/*`` metrics, ``checkpoints.jsonl``)."""

    directory: str
    blocking_s: float
    """Seconds the caller was held: planning, ``common.pt`` and, for a save in the foreground,
    the shard writes; the finalisation is added when :meth:`PendingSave.finish` is called."""
    total_s: float
    """From the start to the checkpoint's rename into place."""
    bytes_written: int
    """This rank's shard files (each rank writes its own: the save's spread)."""
    checkpoint_bytes: int
    """The whole checkpoint's expected size, every rank's writes together."""
    peak_rss_bytes: int
    """This process's highest resident set seen during the save (at its start, while each
    tensor was being written, at its end)."""


class PendingSave:
    """A checkpoint whose shard files are being written (a background thread, or already, in
    the foreground); :meth:`finish` (collective) makes it a complete checkpoint.

    In the background the thread reads the model's and the optimizer's own tensors while they
    are written, so nothing may change them before :meth:`finish`: the loop finishes a pending
    save before the next optimizer step (the rollout it waits for meanwhile only reads them)."""

    def __init__(self, request, partial: Path, final: Path, meta: Dict[str, Any],
                 checkpoint_bytes: int, started: float, background: bool) -> None:
        self.partial, self.final, self.meta = partial, final, meta
        self.checkpoint_bytes = checkpoint_bytes
        self._request = request
        self._started = started
        self._rss_at_start = resident_bytes()
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if request.async_fn is not None and background:
            self._thread = threading.Thread(target=self._write, name="checkpoint-writer",
                                            daemon=True)
            self._thread.start()
        elif request.async_fn is not None:
            self._write()
        self.blocking_s = time.perf_counter() - started
        self.finished: Optional[SaveReport] = None

    def _write(self) -> None:
        try:
            self._request.async_fn(*self._request.async_fn_args,
                                   **self._request.async_fn_kwargs)
        except BaseException as exc:  # handed to the finalisation, which tells every rank
            self._error = exc
            writer = getattr(self._request.async_fn, "__self__", None)
            if getattr(writer, "results_queue", None) is not None:
                writer.results_queue.put(exc if isinstance(exc, Exception)
                                         else RuntimeError(f"checkpoint writer: {exc!r}"))

    @property
    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def finish(self) -> SaveReport:
        """Collective: wait for this rank's writes, agree on the outcome, write the metadata,
        the manifest, and rename the directory into place. A failed write anywhere removes the
        partial directory and raises one :class:`OutputWriteError` on every rank."""
        if self.finished is not None:
            return self.finished
        waited = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        what = f"checkpoint {self.final.name}"
        try:
            for fn in self._request.finalize_fns:  # gathers every rank's results (.metadata)
                fn()
        except (Exception, CheckpointException) as exc:
            message = describe_write_failure(exc, self.final, what)
            if _rank() == 0:
                shutil.rmtree(self.partial, ignore_errors=True)
                log.error("%s; removed %s", message, self.partial)
            raise OutputWriteError(message) from None
        _barrier()
        _rank0_then_agree(self._publish_on_rank0, self.final, what)
        _barrier()
        written = sum(f.stat().st_size for f in self.final.glob(f"__{_rank()}_*.distcp"))
        now = time.perf_counter()
        writer = getattr(self._request.async_fn, "__self__", None)
        peak = max(self._rss_at_start, getattr(writer, "peak_rss_bytes", 0), resident_bytes())
        self.finished = SaveReport(str(self.final), self.blocking_s + now - waited,
                                   now - self._started, written, self.checkpoint_bytes, peak)
        return self.finished

    def abandon(self) -> None:
        """This rank only (the run is ending on an error): wait for the writes, remove the
        partial directory (rank 0); the checkpoint never counts."""
        if self._thread is not None:
            self._thread.join()
        if _rank() == 0:
            shutil.rmtree(self.partial, ignore_errors=True)
            log.warning("abandoned the unfinished checkpoint %s", self.partial)

    def _publish_on_rank0(self) -> None:
        partial, final, meta = self.partial, self.final, self.meta
        what = f"checkpoint {final.name}"
        try:
            body = {"format": FORMAT, **{k: jsonable(v) for k, v in meta.items()}}
            (partial / META_FILE).write_text(json.dumps(body, indent=2, sort_keys=True))
            step = _step_of(final)
            if kill_points.armed("checkpoint", step):  # test hook: dies, manifest unwritten
                kill_points.kill("checkpoint", f"{partial}: "
                                 f"{sorted(p.name for p in partial.iterdir())} written, no manifest",
                                 step)
            write_manifest(partial)
            _publish(partial, final)
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise OutputWriteError(describe_write_failure(exc, final, what)) from None
        log.info("saved checkpoint %s (step %s)", final, meta.get("step"))


def _step_of(directory: Path) -> Optional[int]:
    """The RL step a ``step_<N>`` checkpoint directory holds (None for other names)."""
    number = directory.name[len(STEP_PREFIX):]
    return int(number) if directory.name.startswith(STEP_PREFIX) and number.isdigit() else None


def begin_save(state: Dict[str, Any], directory: str | Path, meta: Dict[str, Any],
               spread_writes: bool = False, background: bool = True,
               cache: Optional[SaveCache] = None) -> PendingSave:
    """Collective: check the space, plan the save with every rank (megatron-core's
    ``dist_checkpointing.save(..., async_sharded_save=True)``, ``serialization.py``: the
    sharded part comes back as an ``AsyncRequest``), write ``common.pt``, and start this rank's
    shard writes, in a thread when ``background``. Finish it with :meth:`PendingSave.finish`.
    ``cache``: what earlier saves of the same structure planned (:class:`SaveCache`)."""
    from megatron.core import dist_checkpointing

    started = time.perf_counter()
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
        strategy = cache.strategy(spread_writes) if cache else save_strategy(spread_writes)
        request = dist_checkpointing.save(
            state, str(partial), sharded_strategy=strategy, async_sharded_save=True,
            validate_access_integrity=not (cache and cache.validated))
        if cache is not None:
            cache.validated = True
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        message = describe_write_failure(exc, final, what)
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            log.error("%s; removed %s", message, partial)
        raise OutputWriteError(message) from None
    return PendingSave(request, partial, final, meta, expected, started, background)


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
