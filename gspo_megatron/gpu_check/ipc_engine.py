"""The embedded rollout engine in a process of its own, receiving weights as SGLang 0.5.23 does.

CUDA IPC handles only open in another process, so the engine (``rollout.embedded.engine.EmbeddedEngine``
on the same GPU) runs in a spawned child. The learner side sends exactly what the project's
``weight_sync.in_process.CudaIpcTransport`` sends to an SGLang server's
``/update_weights_from_tensor``; :class:`EngineClient` carries those bodies over a pipe instead
of HTTP. The child then does what SGLang does with them (read in sglang 0.5.23):

- ``srt/utils/common.py`` ``MultiprocessingSerializer``: ``ForkingPickler`` (torch's reductions:
  CUDA tensors travel as IPC handles, CPU tensors as shared-memory file descriptors) and base64;
  the receiver decodes with ``validate=True`` and unpickles through ``SafeUnpickler``, which
  refuses every global outside an allowlist. :data:`ALLOWED_GLOBALS` here is a *subset* of that
  allowlist (only what dense tensors need), so this stand-in is stricter than SGLang.
- ``srt/managers/tp_worker.py`` ``deserialize_own_rank``: each TP rank unpickles only its own
  entry of ``serialized_named_tensors`` (one per server TP rank).
- ``srt/model_executor/model_runner_components/weight_updater.py``
  ``update_weights_from_tensor``: ``load_format`` None loads by name after ``tensor.to(device)``.
- ``srt/managers/io_struct.py`` ``UpdateWeightsFromTensorReqInput``: the body's fields; unknown
  fields are refused here (SGLang ignores them).

Not played here: SGLang's begin/end weight-update session around the request (server state,
covered by the rollout tests), and ``load_format="flattened_bucket"``.
"""

from __future__ import annotations

import base64
import io
import logging
import pickle
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Dict, Tuple

import torch
import torch.multiprocessing  # noqa: F401  registers torch's tensor reductions with ForkingPickler

from gspo_megatron.rollout.sglang import api

log = logging.getLogger(__name__)

_REDUCTIONS = "torch.multiprocessing.reductions"
_DTYPES = ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
           "uint8", "bool")
ALLOWED_GLOBALS = frozenset(
    {(_REDUCTIONS, name) for name in (
        "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_filename",
        "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")}
    | {("torch", d) for d in _DTYPES}
    | {("torch", "Tensor"), ("torch.nn.parameter", "Parameter"), ("torch", "Size"),
       ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
       ("multiprocessing.resource_sharer", "DupFd")})
"""Globals a weight payload may name; every entry is in sglang 0.5.23's SafeUnpickler list."""

UPDATE_TENSOR_FIELDS = frozenset({"serialized_named_tensors", "load_format", "flush_cache",
                                  "abort_all_requests", "weight_version", "selector",
                                  "torch_empty_cache", "rid", "http_worker_ipc"})
"""Fields of sglang 0.5.23's UpdateWeightsFromTensorReqInput (with BaseReq's)."""


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"blocked global {module}.{name} in a weight payload")


def serialize(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def deserialize(data: Any) -> Any:
    """SGLang's ``MultiprocessingSerializer.deserialize``, with the stricter allowlist."""
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    return _AllowlistUnpickler(io.BytesIO(raw)).load()


def _fail(message: str) -> Tuple[int, Dict[str, Any]]:
    return 400, {"success": False, "message": message}


def update_weights_from_tensor(engine, body: Dict[str, Any], tp_rank: int = 0,
                               tp_size: int = 1) -> Tuple[int, Dict[str, Any]]:
    """What an SGLang TP rank does with one ``/update_weights_from_tensor`` body."""
    unknown = set(body) - UPDATE_TENSOR_FIELDS
    if unknown:
        return _fail(f"unknown fields {sorted(unknown)}")
    blobs = body.get("serialized_named_tensors")
    if not isinstance(blobs, list) or len(blobs) != tp_size:
        return _fail(f"serialized_named_tensors must hold one entry per TP rank ({tp_size})")
    if body.get("load_format") is not None:
        return _fail(f"load_format={body['load_format']!r}: only loading by name is played here")
    named = [(name, tensor.to(engine.device)) for name, tensor in deserialize(blobs[tp_rank])]
    engine.load_weights(named)
    del named  # drop the IPC mappings before answering, as SGLang does after loading
    if body.get("weight_version") is not None:
        engine.weight_version = str(body["weight_version"])
    return 200, {"success": True, "message": "Success"}


def engine_main(conn, hf_dir: str, device: str, dtype_name: str) -> None:
    """Child process: load the HF model into an EmbeddedEngine, then answer commands."""
    try:
        from transformers import AutoModelForCausalLM

        from gspo_megatron.rollout.embedded.engine import EmbeddedEngine

        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device)
        engine = EmbeddedEngine(model)
        conn.send(("ok", {"load_s": time.perf_counter() - t0}))
    except BaseException:  # report start-up failures instead of dying silently
        conn.send(("error", traceback.format_exc()))
        return
    shared = None  # weights lent to the parent; kept alive until it says "release"
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "stop":
                conn.send(("ok", None))
                return
            if cmd == "update_weights_from_tensor":
                reply: Any = update_weights_from_tensor(engine, arg)
            elif cmd == "perturb":  # make every weight differ from the learner's
                with torch.no_grad():
                    for p in engine.model.parameters():
                        p.add_(1.0)
                reply = None
            elif cmd == "share_weights":
                shared = [(n, t.detach()) for n, t in engine.model.state_dict().items()]
                reply = serialize(shared)
            elif cmd == "release":
                shared, reply = None, None
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", reply))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class EngineProcess:
    """Start, talk to and stop the engine child (spawned: CUDA cannot be forked).

    Time limits (start 300 s, each call 180 s) stay inside the device run's own limit, so a hung
    IPC call becomes this check's error and the kit goes on.
    """

    def __init__(self, hf_dir, device: torch.device, dtype_name: str) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, name="gpu-check-engine", daemon=True,
                                args=(child_conn, str(hf_dir), str(device), dtype_name))
        self.proc.start()
        self.ready: Dict[str, Any] = {}

    def _receive(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            self.proc.terminate()  # a late answer would desynchronise the pipe: end the child
            raise TimeoutError(f"engine process gave no answer within {timeout_s:.0f} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine process failed:\n{value}")
        return value

    def wait_ready(self, timeout_s: float = 300.0) -> Dict[str, Any]:
        if not self.ready:
            self.ready = self._receive(timeout_s)
        return self.ready

    def call(self, cmd: str, arg: Any = None, timeout_s: float = 180.0) -> Any:
        self.wait_ready(timeout_s)
        self._conn.send((cmd, arg))
        return self._receive(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        if self.proc.is_alive():
            try:
                if self.ready:
                    self.call("stop", timeout_s=timeout_s)
            except (OSError, RuntimeError, TimeoutError) as exc:
                log.warning("engine process did not stop cleanly: %s", exc)
            self.proc.join(timeout_s)
        if self.proc.is_alive():  # our own child, by its handle
            self.proc.terminate()
            self.proc.join(timeout_s)


class EngineClient:
    """The slice of ``SGLangClient`` that ``CudaIpcTransport`` calls, over the engine's pipe."""

    address = "engine-process"

    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine

    def update_weights_from_tensor(self, payload: Dict[str, Any]) -> str:
        status, body = self.engine.call("update_weights_from_tensor", payload)
        if status != 200 and body.get("success", False):
            raise api.ProtocolError(f"HTTP {status} with success=true: {body}")
        return api.check_success(api.UPDATE_FROM_TENSOR, body)
