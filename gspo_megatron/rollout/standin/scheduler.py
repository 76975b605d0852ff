"""The generation side of the reference server, with SGLang 0.5.23's state rules.

A worker thread takes queued requests (up to ``max_batch_size``) and generates them in one pass
of the embedded engine, checking before every decoding step which requests were cancelled.
State that SGLang's tokenizer manager and scheduler keep, and the rules the stand-in enforces
(file names are sglang's; "stricter" marks a refusal where SGLang would misbehave silently):

- pause (``tokenizer_manager.pause_generation``, mode ``abort``): new requests wait at the gate
  until ``/continue_generation``; running ones are aborted; the call returns once none runs.
  Modes ``retract`` / ``in_place`` are refused (stricter: not emulated).
- abort (``abort_request``): by request id or all; an aborted request finishes with
  ``finish_reason {type: abort}``, the tokens it had and their log-probs, and, as SGLang ends a
  running request it aborts (``Req.to_finish``), one more token it sampled without checking it
  for EOS, a stop or the length. A client that disconnects is aborted too.
- idle (``scheduler.is_fully_idle``): no admitted request; what a flush, a weight update's flush
  and ``release_memory_occupation`` require.
- memory (``weight_updater.release/resume_memory_occupation``): released tags; generating or
  loading weights into released memory is refused (stricter: SGLang would fault).
- weight-update session: generating while one is open is refused (stricter: the post-load
  processing of ``end_weight_update`` has not run yet).
- prefix cache: finished requests leave KV in the cache; a weight update makes it stale until
  ``/flush_cache`` (or a KV release); generating from a stale cache is refused (stricter: SGLang
  would silently reuse KV of the old weights).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from gspo_megatron.rollout.embedded.engine import EmbeddedEngine, GeneratedRow
from gspo_megatron.rollout.types import SamplingParams

log = logging.getLogger(__name__)


class Refused(ValueError):
    """A request the server answers with HTTP 400 and this message."""


@dataclass
class Job:
    rid: str
    prompt: List[int]
    seed: Optional[int]
    params: SamplingParams
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    result: Optional[GeneratedRow] = None
    error: Optional[str] = None


class ReferenceScheduler:
    """Admission, batching, cancellation and the pause / memory / cache state of one server."""

    def __init__(self, engine: EmbeddedEngine, max_batch_size: int = 64) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.cond = threading.Condition()
        self.paused = False
        self.running: Dict[str, Job] = {}
        self.released: Set[str] = set()
        self.cache_entries = 0
        self.cache_stale = False
        self.session_open = False
        """A weight-update session is open (set by the weight endpoints)."""
        self.last_progress = 0.0
        self.stopped = False
        """Set by :meth:`stop`: nothing is admitted any more, and nobody waits at the gate."""
        self._queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="reference-batch")
        self._thread.start()

    def stop(self) -> None:
        """Cancel what runs and turn away what waits at the pause gate: a request paused there
        (a health check waits up to its timeout) would otherwise hold its connection's thread,
        which the server's close joins (15 s per stopped paused server, measured)."""
        with self.cond:
            self.stopped = True
            for job in self.running.values():
                job.cancelled.set()
            self.cond.notify_all()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- admission --------------------------------------------------------------------------
    def submit(self, job: Job, gate_timeout_s: Optional[float] = None) -> bool:
        """Wait at the pause gate, then admit ``job`` and queue it for generation; False if the
        gate did not open in time. Refused once the server stops."""
        if not self.admit(job, gate_timeout_s):
            return False
        self._queue.put(job)
        return True

    def admit(self, job: Job, gate_timeout_s: Optional[float] = None) -> bool:
        """The gate and the rules of :meth:`submit` without generating: a prefill-only request
        (``max_new_tokens`` 0) is admitted so and then :meth:`finished`."""
        with self.cond:
            if not self.cond.wait_for(lambda: not self.paused or self.stopped, timeout=gate_timeout_s):
                return False
            if self.stopped:
                raise Refused("the server is shutting down")
            missing = sorted(self.released & {"weights", "kv_cache"})
            if missing:
                raise Refused(f"the server's {', '.join(missing)} memory is released "
                              "(/release_memory_occupation); /resume_memory_occupation first "
                              "(reference server rule: SGLang would fault)")
            if self.session_open:
                raise Refused("a weight-update session is open: /end_weight_update first (reference "
                              "server rule: the new weights' post-load processing has not run)")
            if self.cache_stale:
                raise Refused("the prefix cache holds KV computed with the weights before the last "
                              "update; /flush_cache after updating weights (reference server rule: "
                              "SGLang would reuse it silently)")
            if job.rid in self.running:
                raise Refused(f"request id {job.rid!r} is already running")
            self.running[job.rid] = job
        return True

    def finished(self, job: Job) -> None:
        with self.cond:
            if self.running.get(job.rid) is job:
                del self.running[job.rid]
                if job.result is not None:
                    self.cache_entries += 1  # the radix cache keeps the finished sequence
            self.cond.notify_all()

    # --- control ----------------------------------------------------------------------------
    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        with self.cond:
            jobs = list(self.running.values()) if abort_all else \
                [j for r, j in self.running.items() if r == rid]
        for job in jobs:
            job.cancelled.set()

    def pause(self, mode: str, timeout_s: float = 600.0) -> None:
        if mode != "abort":
            raise Refused(f"pause mode {mode!r} is not emulated by the reference server "
                          "(mode 'abort' only)")
        with self.cond:
            self.paused = True
        self.abort(abort_all=True)
        with self.cond:
            if not self.cond.wait_for(lambda: not self.running, timeout=timeout_s):
                raise RuntimeError(f"requests still running {timeout_s}s after pause")

    def resume_generation(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def is_idle(self) -> bool:
        with self.cond:
            return not self.running

    def wait_idle(self, timeout_s: float) -> bool:
        """SGLang's writer lock: an unpaused weight update waits for every running request."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.running, timeout=timeout_s)

    def flush(self) -> bool:
        with self.cond:
            if self.running:
                return False
            self.cache_entries, self.cache_stale = 0, False
            return True

    def weights_loaded(self) -> None:
        with self.cond:
            self.cache_stale = self.cache_entries > 0

    # --- the batch loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            batch = [job]
            while len(batch) < self.max_batch_size:
                try:
                    nxt = self._queue.get(timeout=0.005)
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            self._run(batch)

    def _run(self, batch: List[Job]) -> None:
        groups: Dict[SamplingParams, List[Job]] = {}
        for job in batch:
            groups.setdefault(job.params, []).append(job)
        size = self.engine.max_batch_size
        chunks = [(p, js[i:i + size]) for p, js in groups.items() for i in range(0, len(js), size)]
        for params, jobs in chunks:
            def should_stop(jobs=jobs) -> List[bool]:
                self.last_progress = time.monotonic()
                return [j.cancelled.is_set() for j in jobs]
            try:
                rows = self.engine.generate_token_ids([j.prompt for j in jobs], [j.seed for j in jobs],
                                                      params, should_stop=should_stop,
                                                      abort_takes_a_step=True)
                for j, row in zip(jobs, rows):
                    j.result = row
            except Exception as exc:  # report to every waiting request, keep serving
                log.exception("generation failed")
                for j in jobs:
                    j.error = f"{type(exc).__name__}: {exc}"
            self.last_progress = time.monotonic()
            for j in jobs:
                self.finished(j)
                j.done.set()
