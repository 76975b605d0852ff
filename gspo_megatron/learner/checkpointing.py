"""Learner checkpoints through ``megatron.core.dist_checkpointing``, loadable under any layout.

Format ``gspo-megatron-v1`` (the HF -> Megatron converter writes the same):

* a directory written by ``dist_checkpointing.save(sharded_state_dict, dir)`` whose model part is
  under ``"model"`` (``chunk.sharded_state_dict()``; with virtual pipeline ``"model0"``,
  ``"model1"``, ...). Training checkpoints add ``"optimizer"``, ``"scheduler"``, ``"rng"`` (one
  object per rank, restored only under the same layout), ``"step"`` and ``"extra"``;
* ``gspo_meta.json``: ``{"format", "step", "model", "parallel", "has_optimizer",
  "optimizer_form"}`` (training checkpoints add what the trainer passes, e.g. the dataset it was
  trained on);
* ``manifest.json``: every file with its size, written last (``learner/checkpoint_files.py``).

The distributed optimizer's state is written in one of two forms (``optimizer_form``):

* ``dp_sharded`` (:data:`FAST_FORM`, what training saves): megatron-core 0.16.1's
  ``dp_reshardable`` (``optimizer/distrib_optimizer.py``, ``sharded_param_state_dp_reshardable``):
  every rank writes its own shard of the fp32 main weights and Adam moments, views of the
  optimizer's own buffers, with no gather and no copy; the writes are spread over all ranks
  (``FullyParallelSaveStrategyWrapper``, ``strategies/fully_parallel.py``). It loads under the
  same TP / PP / VPP / EP / ETP / CP only (its keys follow the optimizer's buckets); the data
  parallel size may change.
* ``portable`` (:data:`PORTABLE_FORM`): ``fully_reshardable``, keyed by parameter, loadable under
  any layout; each rank gathers its data-parallel group's state to write it (12 bytes per
  parameter of the whole group on every rank), so it is made on demand
  (``gspo-reshard --portable-optimizer``) for a resume under another layout.

Checkpoints without ``optimizer_form`` (before issue 49) are portable. A fast-form checkpoint
loaded under another layout is refused with the command that converts it.

Writes go to ``<dir>.partial`` after a free-space check and are renamed into place when every
rank has finished, so a directory named like a checkpoint is a complete one; a failed write
removes its partial directory and raises :class:`OutputWriteError` naming the path and cause.
Loads verify the manifest first and turn dist_checkpointing's errors into
:class:`CheckpointError` naming the directory.

    save_model_weights(chunks, "ckpt/hf_import", meta)   # weights only (converter, exports)
    load_model_weights(chunks, "ckpt/hf_import")
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from gspo_megatron.learner.checkpoint_files import META_FILE, CheckpointError, require_complete
from gspo_megatron.learner.checkpoint_write import (FORMAT, SaveCache, atomic_save, begin_save,
                                                   jsonable)

FAST_FORM, PORTABLE_FORM = "dp_sharded", "portable"
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable",
                      "chained_optim_avoid_prefix": True}
"""The portable form's metadata for Megatron's ``sharded_state_dict``."""
FAST_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable",
                 "chained_optim_avoid_prefix": True}
LAYOUT_KEYS = ("tp", "pp", "vpp", "num_layers_in_first_pipeline_stage",
               "num_layers_in_last_pipeline_stage", "ep", "etp", "cp")
"""What the fast form's optimizer keys depend on (not the data-parallel size)."""

log = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _model_keys(num_chunks: int) -> List[str]:
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def model_sharded_state_dict(chunks) -> Dict[str, Any]:
    """``{"model": ...}`` (or ``model0``, ``model1``, ... with virtual pipeline).

    Always taken from the bare ``GPTModel`` (DDP wrappers unwrapped), so training checkpoints
    and converted ones share keys.
    """
    return {key: _unwrap(chunk).sharded_state_dict()
            for key, chunk in zip(_model_keys(len(chunks)), chunks)}


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def read_meta(directory: str | Path) -> Dict[str, Any]:
    """``gspo_meta.json`` of a checkpoint; a clear error when it is missing or not ours."""
    path = Path(directory) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a gspo-megatron checkpoint (no {META_FILE})") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path}: format {found!r}, expected {FORMAT!r}")
    return meta


def save_model_weights(model_chunks, directory: str | Path, meta: Dict[str, Any]) -> None:
    """Weights only. ``meta`` should hold ``step``, ``model`` and ``parallel`` (dataclasses ok)."""
    meta = {"step": 0, **meta, "has_optimizer": False}
    atomic_save(model_sharded_state_dict(model_chunks), directory, meta)


def _load_chunks(model_chunks, loaded: Dict[str, Any], directory) -> None:
    for key, chunk in zip(_model_keys(len(model_chunks)), model_chunks):
        if key not in loaded:
            raise KeyError(f"{directory}: checkpoint has no {key!r} (virtual pipeline layout "
                           f"with {len(model_chunks)} chunks expects {_model_keys(len(model_chunks))})")
        _unwrap(chunk).load_state_dict(loaded[key], strict=True)


def load_model_weights(model_chunks, directory: str | Path) -> Dict[str, Any]:
    """Load the model part of any gspo-megatron checkpoint into ``model_chunks``; returns meta."""
    require_complete(directory, require_manifest=False)
    meta = read_meta(directory)
    loaded = _load(model_sharded_state_dict(model_chunks), directory)
    _load_chunks(model_chunks, loaded, directory)
    return meta


def _tile(parts, data: torch.Tensor) -> bool:
    """Whether ``torch.cat(parts)`` would equal ``data`` because the parts *are* its memory:
    contiguous views of it, one after the other, covering it."""
    if not (torch.is_tensor(data) and data.is_contiguous() and isinstance(parts, (list, tuple))
            and parts and all(torch.is_tensor(p) and p.is_contiguous() for p in parts)):
        return False
    offset = data.data_ptr()
    for part in parts:
        if (part.data_ptr() != offset or part.shape[1:] != data.shape[1:]
                or part.dtype != data.dtype):
            return False
        offset += part.numel() * part.element_size()
    return offset == data.data_ptr() + data.numel() * data.element_size()


def _merge_in_place(node):
    """``node`` with every ShardedTensorFactory's merge skipped when it would copy a tensor onto
    itself.

    Megatron's fused SwiGLU factory (``megatron/core/transformer/mlp.py``) saves ``linear_fc1``
    as two halves and merges them after loading with ``torch.cat``. The halves are views of the
    parameter and dist_checkpointing loads into them in place, so the cat builds a second copy
    of two thirds of the expert weights only for ``load_state_dict`` to copy it back.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(node, dict):
        return {k: _merge_in_place(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_merge_in_place(v) for v in node]
    if not isinstance(node, ShardedTensorFactory):
        return node
    merge, data = node.merge_fn, node.data
    return replace(node, merge_fn=lambda sub: data if _tile(sub, data) else merge(sub))


def _load(state: Dict[str, Any], directory: str | Path) -> Dict[str, Any]:
    """``dist_checkpointing.load`` with its errors turned into one :class:`CheckpointError`."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load(_merge_in_place(state), str(directory))
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException: BaseException
        cause = exc
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            cause = first[0] if isinstance(first, tuple) else first
        text = str(cause).strip().splitlines()
        raise CheckpointError(f"{directory}: cannot load checkpoint: {type(cause).__name__}: "
                              f"{text[0] if text else ''}") from None


def _rng_object(key: str):
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return ShardedObject(f"rng_state.{key}", state, (_world(),), (_rank(),), replica_id=0)


def _restore_rng(state: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def layout_key(parallel, world_size: Optional[int] = None) -> str:
    """Names a layout; RNG states are only meaningful between identical ones."""
    p = jsonable(parallel)
    return "w{}_tp{}_pp{}_vpp{}_ep{}_etp{}_cp{}".format(
        world_size or _world(), p["tp"], p["pp"], p["vpp"], p["ep"], p["etp"], p["cp"])


# ---- optimizer state, independent of how Megatron splits the optimizer ------------------------
#
# Megatron builds one distributed optimizer for dense parameters and, depending on the layout,
# a second one for expert parameters (a ChainedOptimizer), and its own state dict nests them by
# index, so a checkpoint saved with one split cannot be loaded with another. The per-parameter
# state tensors in the ``fully_reshardable`` format carry global, layout-free keys
# (``optimizer.state.exp_avg.<param>``), so they are stored here flat by key, with the Adam step
# beside them; the rest of each sub-optimizer's state dict is rebuilt by the loading optimizer.


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _collect_sharded(obj, out: Dict[str, Any]) -> None:
    """Append every sharded leaf of ``obj`` to ``out`` under a position-ordered unique name.

    Storage is addressed by each leaf's own key and offsets, not by these names (local experts
    of one layer share a key with different offsets), so the names only need to be unique and
    sortable back into traversal order on this rank.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(obj, ShardedBase):
        out[f"{len(out):08d}|{obj.key}"] = obj
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect_sharded(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect_sharded(value, out)


def _fill_sharded(obj, loaded_in_order):
    """Replace the sharded leaves of ``obj`` (same traversal as ``_collect_sharded``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(obj, ShardedBase):
        return next(loaded_in_order)
    if isinstance(obj, dict):
        return {k: _fill_sharded(v, loaded_in_order) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill_sharded(v, loaded_in_order) for v in obj]
    return obj


def _adam_step(sub_state: Dict[str, Any]) -> int:
    steps = {int(g["step"]) for g in sub_state["optimizer"]["param_groups"] if "step" in g}
    return max(steps) if steps else 0


def _optimizer_state_for_save(optimizer, model_sd) -> Dict[str, Any]:
    tensors: Dict[str, Any] = {}
    step = 0
    for sub in _sub_optimizers(optimizer):
        sub_state = sub.sharded_state_dict(model_sd, is_loading=False, metadata=OPTIMIZER_SHARDING)
        _collect_sharded(sub_state["param_state"], tensors)
        step = max(step, _adam_step(sub_state))
    return {"tensors": tensors, "adam_step": step}


def _optimizer_state_for_load(optimizer, model_sd):
    structures = [sub.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIMIZER_SHARDING)
                  for sub in _sub_optimizers(optimizer)]
    tensors: Dict[str, Any] = {}
    for sub_state in structures:
        _collect_sharded(sub_state["param_state"], tensors)
    return structures, {"tensors": tensors, "adam_step": 0}


def _restore_optimizer(optimizer, structures, loaded: Dict[str, Any]) -> None:
    step = int(loaded["adam_step"])
    tensors = loaded["tensors"]
    in_order = iter([tensors[name] for name in sorted(tensors)])
    for sub, sub_state in zip(_sub_optimizers(optimizer), structures):
        sub_state["param_state"] = _fill_sharded(sub_state["param_state"], in_order)
        for group in sub_state["optimizer"]["param_groups"]:
            group["step"] = step
        sub.load_state_dict(sub_state)


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(sub, DistributedOptimizer) for sub in _sub_optimizers(optimizer))


def optimizer_form(meta: Dict[str, Any]) -> str:
    """The optimizer form a checkpoint's ``gspo_meta.json`` records (portable before it did)."""
    return meta.get("optimizer_form", PORTABLE_FORM)


def save_training_checkpoint(model_chunks, optimizer, scheduler, directory: str | Path,
                             meta: Dict[str, Any], extra: Optional[Dict[str, Any]] = None,
                             form: str = FAST_FORM, background: bool = False,
                             caches: Optional[Dict[str, SaveCache]] = None):
    """Model, optimizer (``form``; see the module docstring), scheduler, RNG, step and trainer
    ``extra`` (plain Python values). Returns the save's ``SaveReport``; with ``background``
    the ``PendingSave`` whose ``finish()`` (collective) completes it, which must come before the
    model or the optimizer change (``learner/checkpoint_write.py``). ``caches``: one
    ``SaveCache`` per form, kept by the caller across saves."""
    if form not in (FAST_FORM, PORTABLE_FORM):
        raise ValueError(f"unknown optimizer form {form!r}")
    if not _is_distributed(optimizer):
        form = PORTABLE_FORM  # per-parameter keys already: no gather to avoid
    model_sd = model_sharded_state_dict(model_chunks)
    state = dict(model_sd)
    if form == FAST_FORM:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=False,
                                                          metadata=FAST_SHARDING)
    else:
        state["optimizer"] = _optimizer_state_for_save(optimizer, model_sd)
    state["scheduler"] = scheduler.state_dict()
    state["rng"] = _rng_object(layout_key(meta["parallel"]))
    state["step"] = int(meta.get("step", 0))
    state["extra"] = dict(extra or {})
    cache = caches.setdefault(form, SaveCache()) if caches is not None else None
    pending = begin_save(state, directory, {**meta, "has_optimizer": True,
                                            "world_size": _world(), "optimizer_form": form},
                         spread_writes=form == FAST_FORM, background=background, cache=cache)
    return pending if background else pending.finish()


def fast_form_mismatch(meta: Dict[str, Any], parallel) -> Optional[str]:
    """Why a fast-form checkpoint cannot be loaded under ``parallel`` (None when it can)."""
    if optimizer_form(meta) != FAST_FORM:
        return None
    saved, now = jsonable(meta["parallel"]), jsonable(parallel)
    differs = [f"parallel.{k}={saved.get(k)} -> {now.get(k)}" for k in LAYOUT_KEYS
               if saved.get(k) != now.get(k)]
    return ", ".join(differs) or None


def conversion_hint(directory: str | Path, meta: Dict[str, Any],
                    config: str = "<the run's config.yaml>") -> str:
    """The command that writes a checkpoint's optimizer in the portable form, in place (on the
    layout it was saved with: its world size, or any other data-parallel size)."""
    return (f"torchrun --nproc-per-node={meta.get('world_size', 1)} -m gspo_megatron.cli.reshard "
            f"--portable-optimizer --ckpt {directory} --config {config}")


def load_training_checkpoint(model_chunks, optimizer, scheduler, directory: str | Path,
                             parallel, load_optimizer: bool = True) -> Dict[str, Any]:
    """Restore what :func:`save_training_checkpoint` wrote; returns ``{"meta", "step", "extra"}``.

    Under a different layout the model and optimizer are resharded; RNG states (one per rank)
    are only restored when the layout is the same, since ranks do not correspond otherwise.
    """
    require_complete(directory, require_manifest=False)
    meta = read_meta(directory)
    model_sd = model_sharded_state_dict(model_chunks)
    state: Dict[str, Any] = dict(model_sd)
    with_optimizer = load_optimizer and meta.get("has_optimizer", False)
    if load_optimizer and not meta.get("has_optimizer", False):
        raise CheckpointError(f"{directory}: weights-only checkpoint has no optimizer state; "
                         "load it with load_weights / load_optimizer=False")
    saved_layout = layout_key(meta["parallel"], meta.get("world_size"))
    same_layout = saved_layout == layout_key(parallel)
    fast = with_optimizer and optimizer_form(meta) == FAST_FORM
    if fast:
        mismatch = fast_form_mismatch(meta, parallel)
        if mismatch:
            raise CheckpointError(
                f"{directory}: its optimizer state is in the fast form of the layout it was saved "
                f"under ({mismatch}): load it under that layout, or write the portable form "
                f"first: {conversion_hint(directory, meta)}")
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                          metadata=FAST_SHARDING)
    elif with_optimizer:
        structures, state["optimizer"] = _optimizer_state_for_load(optimizer, model_sd)
    if with_optimizer:
        state["scheduler"] = scheduler.state_dict()
        state["step"] = 0
        state["extra"] = {}
        if same_layout:
            state["rng"] = _rng_object(layout_key(parallel))
    loaded = _load(state, directory)
    _load_chunks(model_chunks, loaded, directory)
    if fast:  # megatron-core's dp_reshardable load copies into the fp32 main weights in place,
        with torch.no_grad():  # which autograd refuses on leaves that require grad
            optimizer.load_state_dict(loaded["optimizer"])
    elif with_optimizer:
        _restore_optimizer(optimizer, structures, loaded["optimizer"])
    if with_optimizer:
        scheduler.num_steps = 0  # Megatron's load_state_dict *adds* the saved step count
        scheduler.load_state_dict(loaded["scheduler"])
        if same_layout:
            _restore_rng(loaded["rng"])
        else:
            log.info("%s: saved under layout %s, running %s; RNG states not restored",
                     directory, saved_layout, layout_key(parallel))
    return {"meta": meta, "step": int(loaded.get("step", meta.get("step", 0))),
            "extra": loaded.get("extra", {})}
