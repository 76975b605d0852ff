"""The weight-update endpoints of the reference server, with SGLang 0.5.23's rules and messages.

Rules (``managers/scheduler_components/weight_updater.py``, ``managers/tokenizer_control_mixin.py``,
``model_executor/model_runner_components/weight_updater.py``):

- ``/begin_weight_update`` opens a session (refused if one is open); ``/end_weight_update``
  closes it (refused if none is open) and runs the post-load processing.
- ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` answer
  ``success: false`` outside a session, before receiving anything.
- an update with ``flush_cache: true`` that finds requests running loads the weights but answers
  ``success: false`` (the flush was refused).
- an update while generation is not paused first waits for every running request (SGLang's
  writer lock).
- ``/update_weights_from_disk`` needs no session. Loading into released weights memory is
  refused (stricter: SGLang would fault).

``/init_weights_update_group`` joins a broadcast group as rank ``rank_offset`` (one TP rank)
and answers once every rank joined; ``/update_weights_from_distributed`` receives the bucket
from group rank 0 (one flat tensor with ``load_format="flattened_bucket"``, else one broadcast
per tensor); ``/update_weights_from_tensor`` opens tensor handles (CUDA IPC, or shared memory on
CPU) with :mod:`rollout.standin.handle_unpickler`; ``/get_weights_by_name`` returns a parameter's first
values.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Tuple

import torch

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang import flat_bucket
from gspo_megatron.rollout.sglang.update_group import (broadcast_from_learner, create_update_group,
                                                destroy_update_group)
from gspo_megatron.rollout.standin.handle_unpickler import load_named_tensors
from gspo_megatron.rollout.standin.scheduler import ReferenceScheduler

log = logging.getLogger(__name__)

NO_FLUSH = ("Weights were updated, but the cache was not flushed because requests are still "
            "running or queued. Retract or finish them, then call /flush_cache.")


def _ok(message: str) -> Tuple[int, Dict[str, Any]]:
    return 200, {"success": True, "message": message}


def _fail(message: str) -> Tuple[int, Dict[str, Any]]:
    return 400, {"success": False, "message": message}


class WeightReceiver:
    """Routes weight-update requests for one engine; one update at a time."""

    def __init__(self, scheduler: ReferenceScheduler, idle_timeout_s: float = 600.0) -> None:
        self.scheduler = scheduler
        self.engine = scheduler.engine
        self.groups: Dict[str, Any] = {}
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()

    def route(self, path: str, body: Dict[str, Any]) -> Tuple[int, Any]:
        handlers = {api.INIT_GROUP: self.init_group, api.DESTROY_GROUP: self.destroy_group,
                    api.BEGIN_UPDATE: self.begin, api.END_UPDATE: self.end,
                    api.UPDATE_FROM_DISTRIBUTED: self.update_from_distributed,
                    api.UPDATE_FROM_DISK: self.update_from_disk,
                    api.UPDATE_FROM_TENSOR: self.update_from_tensor,
                    api.GET_WEIGHTS_BY_NAME: self.get_weights_by_name}
        handler = handlers.get(path)
        if handler is None:
            return 404, {"detail": "Not Found"}
        try:
            return handler(body)
        except KeyError as exc:  # a required field is missing (FastAPI answers 400 as well)
            return 400, {"error": {"message": f"field required: {exc}"}}
        except (ValueError, TypeError, RuntimeError, FileNotFoundError) as exc:
            log.exception("%s failed", path)
            return _fail(f"{type(exc).__name__}: {exc}")

    # --- session ----------------------------------------------------------------------------
    @property
    def session(self) -> bool:
        return self.scheduler.session_open

    def begin(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        with self._lock:
            if self.session:
                return _fail("a weight-update session is already open; call end_weight_update() first")
            self.scheduler.session_open = True
        return _ok("Success")

    def end(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        with self._lock:
            if not self.session:
                return _fail("no weight-update session is open; call begin_weight_update() first")
            self.scheduler.session_open = False
        return _ok("Success")

    def _before_load(self, endpoint: str, body: Dict[str, Any], needs_session: bool):
        """The refusals that come before any byte is received; None when the load may go on."""
        if needs_session and not self.session:
            return _fail(f"{endpoint.lstrip('/')} must run between begin_weight_update() and "
                         "end_weight_update()")
        if "weights" in self.scheduler.released:
            return _fail("the server's weights memory is released; /resume_memory_occupation "
                         "with tag 'weights' first (reference server rule: SGLang would fault)")
        if body.get("abort_all_requests"):
            self.scheduler.abort(abort_all=True)
        if not self.scheduler.paused and not self.scheduler.wait_idle(self.idle_timeout_s):
            return _fail(f"requests still running after {self.idle_timeout_s}s")
        return None

    def _after_load(self, body: Dict[str, Any], message: str) -> Tuple[int, Any]:
        self.scheduler.weights_loaded()
        if body.get("weight_version") is not None:
            self.engine.weight_version = str(body["weight_version"])
        if body.get("flush_cache", True) and not self.scheduler.flush():
            return _fail(NO_FLUSH)
        return _ok(message)

    # --- groups -----------------------------------------------------------------------------
    def init_group(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        name = body.get("group_name", api.DEFAULT_GROUP_NAME)
        if name in self.groups:
            return _fail("Failed to initialize custom process group: The specified group name has "
                         "already been created, please use a different group name.")
        backend = body.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # the reference server runs on CPU
        self.groups[name] = create_update_group(
            body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
            int(body["world_size"]), name, backend)
        return _ok("Succeeded to initialize custom process group.")

    def destroy_group(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        group = self.groups.pop(body.get("group_name", api.DEFAULT_GROUP_NAME), None)
        if group is None:
            return _fail("The group to be destroyed does not exist.")
        destroy_update_group(group)
        return _ok("Succeeded to destroy custom process group.")

    # --- loads ------------------------------------------------------------------------------
    @staticmethod
    def _load(load: Callable[[], Any]) -> None:
        """Run ``load``; a weight name the model lacks is the request's fault (``success:
        false``), not a missing field (what ``route`` makes of a bare ``KeyError``)."""
        try:
            load()
        except KeyError as exc:
            raise ValueError(exc.args[0]) from exc

    def update_from_distributed(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        with self._lock:
            refused = self._before_load(api.UPDATE_FROM_DISTRIBUTED, body, needs_session=True)
            if refused:
                return refused
            name = body.get("group_name", api.DEFAULT_GROUP_NAME)
            group = self.groups.get(name)
            if group is None:
                return _fail(f"Failed to receive weights: Group {name} not in {sorted(self.groups)}. "
                             "Please call `init_weights_update_group` first.")
            if body.get("load_format") == api.FLATTENED_BUCKET:
                flat = flat_bucket.empty_flat(dtypes, shapes)
                broadcast_from_learner(flat, group)
                tensors = flat_bucket.unflatten(flat, names, dtypes, shapes)
            else:
                tensors = []
                for n, d, s in zip(names, dtypes, shapes):
                    t = torch.empty(list(s), dtype=flat_bucket.parse_dtype(d))
                    broadcast_from_learner(t, group)
                    tensors.append((n, t))
            self._load(lambda: self.engine.load_weights(tensors))
            return self._after_load(body, "Succeeded to update parameter online.")

    def update_from_tensor(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        blobs = body["serialized_named_tensors"]
        if not isinstance(blobs, list) or not blobs:
            return 400, {"error": {"message": "serialized_named_tensors must be a non-empty list"}}
        with self._lock:
            refused = self._before_load(api.UPDATE_FROM_TENSOR, body, needs_session=True)
            if refused:
                return refused
            if body.get("load_format") not in (None, "direct"):
                return _fail(f"Unknown load_format={body.get('load_format')}")
            self._load(lambda: self.engine.load_weights(load_named_tensors(blobs[0])))  # one TP rank
            return self._after_load(body, "Success")

    def update_from_disk(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        with self._lock:
            refused = self._before_load(api.UPDATE_FROM_DISK, body, needs_session=False)
            if refused:
                return refused[0], {**refused[1], "num_paused_requests": 0}
            self._load(lambda: self.engine.load_weights_from_disk(body["model_path"]))
            status, out = self._after_load(body, "Succeeded to update model weights.")
            return status, {**out, "num_paused_requests": 0}

    def get_weights_by_name(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        """The first ``truncate_size`` values of a parameter, flattened (SGLang's answer)."""
        params = self.engine.model.state_dict()
        name = body["name"]
        if name not in params:
            return 400, {"error": {"message": f"unknown parameter {name!r}"}}
        flat = params[name].detach().float().reshape(-1)[: int(body.get("truncate_size", 100))]
        return 200, flat.tolist()
