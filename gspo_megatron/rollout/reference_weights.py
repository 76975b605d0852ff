"""The weight-update endpoints of the reference server, on an :class:`EmbeddedEngine`.

Same semantics as SGLang's: ``/init_weights_update_group`` joins a broadcast group as rank
``rank_offset`` (the server has one TP rank) and answers once every rank has joined;
``/update_weights_from_distributed`` receives the described tensors from group rank 0 (one
flat bucket with ``load_format="flattened_bucket"``, else one broadcast per tensor in list
order) and loads them by HF name; ``/update_weights_from_disk`` loads the safetensors files of
``model_path``; ``/get_weights_by_name`` returns a parameter's first values (for checks).
``/update_weights_from_tensor`` carries CUDA IPC handles, so it is refused here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Tuple

import torch

from gspo_megatron.rollout import flat_bucket
from gspo_megatron.rollout import sglang_api as api
from gspo_megatron.rollout.update_group import (broadcast_from_learner, create_update_group,
                                                destroy_update_group)

log = logging.getLogger(__name__)


def _ok(message: str) -> Tuple[int, Dict[str, Any]]:
    return 200, {"success": True, "message": message}


def _fail(message: str) -> Tuple[int, Dict[str, Any]]:
    return 400, {"success": False, "message": message}


class WeightReceiver:
    """Routes weight-update requests for one engine; one update at a time."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.groups: Dict[str, Any] = {}
        self._lock = threading.Lock()

    def route(self, path: str, body: Dict[str, Any]) -> Tuple[int, Any]:
        handlers = {api.INIT_GROUP: self.init_group, api.DESTROY_GROUP: self.destroy_group,
                    api.UPDATE_FROM_DISTRIBUTED: self.update_from_distributed,
                    api.UPDATE_FROM_DISK: self.update_from_disk,
                    api.UPDATE_FROM_TENSOR: self.update_from_tensor,
                    api.GET_WEIGHTS_BY_NAME: self.get_weights_by_name}
        handler = handlers.get(path)
        if handler is None:
            return 404, {"error": {"message": f"unknown endpoint {path}"}}
        try:
            return handler(body)
        except (KeyError, ValueError, TypeError, RuntimeError, FileNotFoundError) as exc:
            log.exception("%s failed", path)
            return _fail(f"{type(exc).__name__}: {exc}")

    def init_group(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        name = body.get("group_name", api.DEFAULT_GROUP_NAME)
        if name in self.groups:
            return _fail(f"group {name!r} already exists")
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

    def update_from_distributed(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        name = body.get("group_name", api.DEFAULT_GROUP_NAME)
        group = self.groups.get(name)
        if group is None:
            return _fail(f"Group {name} not initialized; call {api.INIT_GROUP} first.")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        with self._lock:
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
            self.engine.load_weights(tensors)
            self._set_version(body)
        return _ok("Succeeded to update parameter online.")

    def update_from_disk(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        with self._lock:
            self.engine.load_weights_from_disk(body["model_path"])
            self._set_version(body)
        return 200, {"success": True, "message": "Succeeded to update model weights.",
                     "num_paused_requests": 0}

    def update_from_tensor(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        return _fail("update_weights_from_tensor carries CUDA IPC handles; the reference server "
                     "supports the distributed and disk transports only")

    def get_weights_by_name(self, body: Dict[str, Any]) -> Tuple[int, Any]:
        """The first ``truncate_size`` values of a parameter, flattened (SGLang's answer)."""
        params = self.engine.model.state_dict()
        name = body["name"]
        if name not in params:
            return 400, {"error": {"message": f"unknown parameter {name!r}"}}
        flat = params[name].detach().float().reshape(-1)[: int(body.get("truncate_size", 100))]
        return 200, flat.tolist()

    def _set_version(self, body: Dict[str, Any]) -> None:
        if body.get("weight_version") is not None:
            self.engine.weight_version = str(body["weight_version"])
