"""The control side of a weight sync and of colocated memory, fleet-wide, as SGLang 0.5.23 wants it.

Weight sync (``begin`` ... transport sends buckets ... ``finish``), each phase on every member
server in parallel and timed:

1. ``/pause_generation {mode: abort}``: new requests wait, running ones are aborted, and the call
   returns once nothing runs (tokenizer_manager.pause_generation). When requests of ours run,
   ``/abort_request {abort_all}`` first, until they answered (:meth:`FleetControl._cut_running`:
   SGLang's pause looks again only a second after aborting). Without it a flush after the
   update is refused while requests run (scheduler.flush_cache) and the update fails. The
   engine's own workers also wait, client-side, until the sync ends (:meth:`wait_open`): a
   request sent meanwhile would only wait at the server's gate (or, cut by the pause, be
   resumed: partial rollouts, ``rollout/sglang/partial_rollout.py``).
2. ``/abort_request {rid}`` for every request id the client sent and was not answered, including
   attempts it gave up on (those keep generating on their server otherwise).
3. ``/resume_memory_occupation {tags: [weights]}`` when the weights were released (colocated).
4. ``/begin_weight_update``: ``update_weights_from_distributed`` / ``_from_tensor`` return
   ``success: false`` outside a session (scheduler_components/weight_updater.py). The disk path
   needs no session (``update_weights_from_disk`` does its own post-load processing).
5. the transport sends the buckets;
6. ``/end_weight_update``: runs the post-load processing of the new weights;
7. ``/flush_cache``: the prefix cache holds KV of the old weights (skipped while the KV cache is
   released: releasing it flushed already). SGLang answers 400 while anything runs or waits in
   its queue (``scheduler.flush_cache``), so a refusal is retried every 0.5 s for up to
   ``flush_timeout_s`` (60 s, as slime does) before it fails the update naming the server;
8. ``/continue_generation`` (deferred while memory is released: ``resume_memory`` continues).

A member that is unreachable during a phase leaves the rotation and is reported in the metrics
(``weight_sync/num_skipped_servers``); a refusal raises :class:`api.ServerRefused` naming
the server, the endpoint and SGLang's message.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Set

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import ServerAuthError, ServerUnavailable
from gspo_megatron.rollout.sglang.fleet_pause import mark_fleet_paused
from gspo_megatron.rollout.sglang.server_pool import ServerPool, ServerState

log = logging.getLogger(__name__)


class FleetControl:
    """Pause / abort / session / flush / continue and memory release over a :class:`ServerPool`."""

    def __init__(self, pool: ServerPool, flush_timeout_s: float = 60.0,
                 flush_retry_s: float = 0.5) -> None:
        self.pool = pool
        self.flush_timeout_s = flush_timeout_s
        self.flush_retry_s = flush_retry_s
        self.cancel_timeout_s = 30.0
        """Per call of :meth:`cancel` (end session, flush, continue) after a failed update."""
        self.cut_timeout_s = 5.0
        self.cut_poll_s = 0.05
        """:meth:`_cut_running`: at most this long, aborting every ``cut_poll_s``."""
        self.released: Set[str] = set()
        """Memory tags released on the servers (colocated mode)."""
        self.paused = False
        self.pause_epoch = 0
        """Bumped at every pause: an ``abort`` finish of a request sent before it was ours."""
        self.phases: Dict[str, float] = {}
        self.num_interrupted = 0
        """Requests of ours in flight when the last sync paused (cut, or retried)."""
        self._session = False
        self._open = threading.Event()
        self._open.set()
        self._versions: List[Optional[str]] = [None]
        """Every version the engine served, in order (None: before its first sync)."""
        self._versions_lock = threading.Lock()

    def wait_open(self, timeout_s: float) -> bool:
        """Block while generation is paused by us (a sync, or released memory); False if it
        did not reopen within ``timeout_s``."""
        return self._open.wait(timeout_s)

    @property
    def weight_version(self) -> Optional[str]:
        """The version the engine serves: the last sync's (None before the first)."""
        with self._versions_lock:
            return self._versions[-1]

    @weight_version.setter
    def weight_version(self, version: Optional[str]) -> None:
        with self._versions_lock:
            self._versions.append(version)

    def version_index(self) -> int:
        """Where the engine's version history stands (:meth:`versions_since` takes it)."""
        with self._versions_lock:
            return len(self._versions) - 1

    def versions_since(self, index: int) -> List[Optional[str]]:
        """The versions served from history position ``index`` (a request's sending) to now."""
        with self._versions_lock:
            return list(self._versions[index:])

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def _all(self, name: str, call) -> None:
        with self._phase(name):
            self.pool.on_members(call, name)

    # --- pause / abort ----------------------------------------------------------------------
    def pause_and_abort(self) -> None:
        """Phases 1 and 2: nothing of ours runs on any member afterwards."""
        mark_fleet_paused(True)
        self._open.clear()
        self.pause_epoch += 1
        self.paused = True
        self.num_interrupted = self.pool.num_outstanding()
        with self._phase("pause"):
            if self.num_interrupted:
                self._cut_running()
            self.pool.on_members(lambda s: s.client.pause_generation("abort"), "pause")
        self._all("abort", self._abort_sent)

    def _cut_running(self) -> None:
        """Abort what runs and wait for our requests' answers, so that the pause finds nothing
        running. SGLang's ``/pause_generation {mode: abort}`` aborts everything, then looks
        again only a second later (tokenizer_manager.pause_generation: ``asyncio.sleep(1.0)``
        while its model_update_lock is held): ~1 s per sync that cuts requests, ~ms this way.
        The pause after it still catches a request that was on its way."""
        deadline = time.monotonic() + self.cut_timeout_s
        while self.pool.num_outstanding() and time.monotonic() < deadline:
            self.pool.on_members(lambda s: s.client.abort_request(abort_all=True, timeout_s=10.0),
                                 "abort")
            self.pool.wait_no_outstanding(self.cut_poll_s)

    def _abort_sent(self, s: ServerState) -> None:
        for rid in self.pool.take_sent(s):
            s.client.abort_request(rid)

    def _continue(self) -> None:
        self._all("continue", lambda s: s.client.continue_generation())
        self._reopen()

    def _reopen(self) -> None:
        self.paused = False
        self._open.set()
        mark_fleet_paused(False)

    # --- weight sync ------------------------------------------------------------------------
    def begin(self, session: bool = True) -> List[str]:
        """Phases 1-4; returns the member addresses the transport must send to."""
        self.phases = {}
        self.pool.readmit_for_sync()
        self.pause_and_abort()
        if "weights" in self.released:
            self._resume(["weights"])
        if session:
            self._all("begin", lambda s: s.client.begin_weight_update())
            self._session = True
        return [s.address for s in self.pool.members]

    def finish(self, weight_version: Optional[str]) -> None:
        """Phases 6-8, after the transport sent every bucket."""
        if self._session:
            self._all("end", lambda s: s.client.end_weight_update())
            self._session = False
        for s in self.pool.members:
            s.weight_version = weight_version
        self.weight_version = weight_version
        if "kv_cache" not in self.released:
            self._all("flush", self._flush)
        if not self.released:
            self._continue()

    def _flush(self, s: ServerState) -> None:
        """``/flush_cache``, retried while SGLang refuses it (requests running or queued)."""
        deadline = time.monotonic() + self.flush_timeout_s
        while True:
            try:
                s.client.flush_cache()
                return
            except ServerAuthError:
                raise  # the same key would be refused again
            except api.ServerRefused as exc:
                if time.monotonic() >= deadline:
                    raise api.ServerRefused(s.address, api.FLUSH_CACHE,
                                            f"{exc.message} (still refused after "
                                            f"{self.flush_timeout_s:g}s: requests running or "
                                            "queued on it)") from exc
                time.sleep(self.flush_retry_s)

    def cancel(self) -> None:
        """Best effort after a failed transfer: close the session, flush the prefix cache (the
        buckets that did arrive changed the weights its KV was computed with) and let
        generation go on. Each call waits at most ``cancel_timeout_s``: a server still blocked
        inside a broadcast cannot answer, and the job's error must not wait for it."""
        for s in self.pool.members:
            calls = (s.client.end_weight_update,) if self._session else ()
            if "kv_cache" not in self.released:
                calls += (s.client.flush_cache,)
            for call in calls + (s.client.continue_generation,):
                try:
                    call(timeout_s=self.cancel_timeout_s)
                except (ServerUnavailable, api.ServerRefused) as exc:
                    log.warning("cleanup on %s after a failed weight sync: %s", s.address, exc)
        self._session = False
        self._reopen()

    def metrics(self) -> Dict[str, float]:
        out = {f"weight_sync/{k}_s": v for k, v in self.phases.items()}
        out["weight_sync/num_servers"] = float(len(self.pool.members))
        out["weight_sync/num_interrupted_requests"] = float(self.num_interrupted)
        # servers out of rotation before or during this update: they did not get it
        out["weight_sync/num_skipped_servers"] = float(len(self.pool.dead))
        if self.pool.dead:
            log.warning("weight update %s skipped rollout servers out of rotation: %s",
                        self.weight_version, self.pool.dead)
        return out

    # --- colocated memory -------------------------------------------------------------------
    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Pause, abort, then release ``tags`` (all: weights, KV cache, CUDA graphs). SGLang
        asserts the server is idle (weight_updater.release_memory_occupation)."""
        tags = list(api.MEMORY_TAGS if tags is None else tags)
        self.phases = {}
        self.pause_and_abort()
        self._all("release", lambda s: s.client.release_memory(tags))
        self.released |= set(tags)

    def _resume(self, tags: Sequence[str]) -> None:
        self._all("resume", lambda s: s.client.resume_memory(list(tags)))
        self.released -= set(tags)

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Take back ``tags`` (default: all released); once nothing is released, flush (when the
        KV cache came back) and continue generation."""
        tags = sorted(self.released if tags is None else set(tags) & self.released)
        if tags:
            self._resume(tags)
        if not self.released and self.paused and not self._session:
            if "kv_cache" in tags:
                self._all("flush", self._flush)
            self._continue()
