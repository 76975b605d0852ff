"""The embedded engine in a child process, so that a rollout runs while the learner trains.

Why a process and not a thread: a tiny model's generation is mostly Python (one small op after
another), and so is a Megatron update. In one interpreter the two take turns on the GIL: a
background rollout thread measured 1.06 s against 1.02 s for the rollout and the update run one
after the other (4-layer tiny MoE, docs/performance.md). In its own process the rollout gets its
own interpreter and its own torch thread pool (``num_threads``).

How: :class:`EmbeddedProcessEngine` spawns a child that loads
:class:`~gspo_megatron.rollout.embedded.engine.EmbeddedEngine` from an HF directory, moves the model's
tensors into shared memory and sends them back once. The parent keeps those shared tensors, so
:meth:`load_weights` (what the in-process weight transport calls) copies new weights straight
into the child's parameters: no pickling, one memcpy. Weights are only written between
generations (a lock orders the two); ``generate`` sends the requests and waits for the samples.
The child is started at construction and its handshake read at first use, so its start-up
(imports, model load) overlaps whatever the parent does meanwhile.

    engine = EmbeddedProcessEngine("runs/tiny_assets/model", num_threads=1)
    samples = engine.generate(requests, SamplingParams(seed=1))
    engine.load_weights(hf_named_tensors)      # between generate() calls
    engine.shutdown()
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import Dict, List, Optional, Sequence

import torch
import torch.multiprocessing as mp

from gspo_megatron.rollout.types import (GenerationRequest, NamedTensors, RolloutEngine, Sample,
                                         SamplingParams, WeightSyncStats)

log = logging.getLogger(__name__)


def _serve(conn, model_path: str, max_batch_size: int, num_threads: int, logprob_mode: str,
           lean_decode: bool, record_routing: bool, dtype: torch.dtype) -> None:
    """Child process: load the engine, share its tensors, then answer requests until 'stop'."""
    try:
        torch.set_num_threads(num_threads)
        from gspo_megatron.rollout.embedded.engine import EmbeddedEngine

        engine = EmbeddedEngine.from_pretrained(model_path, dtype=dtype,
                                                max_batch_size=max_batch_size,
                                                logprob_mode=logprob_mode, lean_decode=lean_decode,
                                                record_routing=record_routing)
        engine.model.share_memory()
        tensors = {name: t.detach() for name, t in engine.model.state_dict(keep_vars=True).items()}
        conn.send(("ready", tensors, os.getpid()))
    except BaseException:  # report why, the parent raises it
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
            if message[0] == "stop":
                return
            _, requests, params, version = message
            engine.weight_version = version
            try:
                reply = ("ok", _routing_as_arrays(engine.generate(requests, params)))
            except Exception:
                reply = ("error", traceback.format_exc())
            conn.send(reply)
        except (EOFError, OSError):  # the parent is gone (exited or killed)
            return


def _routing_as_arrays(samples: List[Sample]) -> List[Sample]:
    """Routed experts as numpy arrays for the pipe: a tensor would travel as one shared-memory
    file descriptor per sample (hundreds per batch), an array as plain bytes."""
    for s in samples:
        if s.routed_experts is not None:
            s.routed_experts = s.routed_experts.numpy()
    return samples


class EmbeddedProcessEngine(RolloutEngine):
    """:class:`EmbeddedEngine` served by a child process, weights in shared memory."""

    def __init__(self, model_path: str, max_batch_size: int = 256, num_threads: int = 1,
                 logprob_mode: str = "scaled", lean_decode: bool = True,
                 record_routing: bool = False, dtype: torch.dtype = torch.float32,
                 start_timeout_s: float = 600.0) -> None:
        super().__init__()
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise FileNotFoundError(f"{model_path}: not a Hugging Face model directory (no config.json)")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.model_path = model_path
        self.start_timeout_s = start_timeout_s
        self.weight_version: Optional[str] = None
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, name="embedded-engine", daemon=True,
                                 args=(child_conn, model_path, max_batch_size, num_threads,
                                       logprob_mode, lean_decode, record_routing, dtype))
        self._proc.start()
        child_conn.close()
        self._tensors: Optional[Dict[str, torch.Tensor]] = None
        self._lock = threading.Lock()  # one generate() or weight load at a time

    # ---- plumbing --------------------------------------------------------------------------
    def _receive(self, timeout_s: Optional[float] = None):
        if timeout_s is not None and not self._conn.poll(timeout_s):
            raise TimeoutError(f"embedded engine process gave no answer in {timeout_s:.0f}s")
        try:
            message = self._conn.recv()
        except (EOFError, ConnectionError) as exc:
            code = self._proc.exitcode if self._proc.exitcode is not None else "unknown"
            raise RuntimeError(f"embedded engine process died (exit code {code})") from exc
        if message[0] == "error":
            raise RuntimeError(f"embedded engine process failed:\n{message[1]}")
        return message

    def wait_ready(self) -> None:
        """Block until the child has loaded the model (done lazily by every other call)."""
        if self._tensors is None:
            _, self._tensors, pid = self._receive(self.start_timeout_s)
            log.info("embedded engine serving %s in process %d", self.model_path, pid)

    # ---- RolloutEngine -----------------------------------------------------------------------
    def _generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> List[Sample]:
        with self._lock:
            self.wait_ready()
            self._conn.send(("generate", list(requests), params, self.weight_version))
            samples = self._receive()[1]
        for s in samples:
            if s.routed_experts is not None:
                s.routed_experts = torch.from_numpy(s.routed_experts)
        return samples

    def load_weights(self, named_tensors: NamedTensors) -> WeightSyncStats:
        """Copy tensors into the child's parameters of the same HF name (between generations)."""
        stats = WeightSyncStats()
        t0 = time.perf_counter()
        with self._lock, torch.no_grad():
            self.wait_ready()
            for name, tensor in named_tensors:
                target = self._tensors.get(name)
                if target is None:
                    raise KeyError(f"weight {name!r} is not a parameter of the rollout model")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match "
                                     f"the rollout model's {tuple(target.shape)}")
                target.copy_(tensor.to(dtype=target.dtype))
                stats.num_tensors += 1
                stats.num_bytes += tensor.numel() * tensor.element_size()
        stats.seconds = time.perf_counter() - t0
        return stats

    def health(self) -> bool:
        return self._proc.is_alive()

    def shutdown(self) -> None:
        super().shutdown()
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():  # our own child, by its handle
                self._proc.kill()
                self._proc.join(timeout=10)
        self._tensors = None
        self._conn.close()
