"""SGLang rollout engine: a fleet of SGLang (or reference) servers behind the RolloutEngine API.

Each sample is one non-streaming ``/generate`` request (with its own ``sampling_seed``), sent to
the live server with the fewest outstanding requests. Results come back as they finish
(:meth:`SGLangEngine.generate_iter`); :meth:`generate` collects and sorts them.

Failure handling, per sample: a connection error, timeout, HTTP 5xx, malformed body or an
``abort`` finish is retried on another server (up to ``max_retries`` more attempts); a server
that then fails its health probe is taken out of rotation until a later batch finds it healthy.
Each sample is owned by one task that accepts exactly one answer, so no sample is lost or
duplicated: an abandoned attempt that still completes on its server is ignored. A sample that
exhausts its retries fails the whole batch with an error naming it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Set

from gspo_megatron.rollout import sglang_api as api
from gspo_megatron.rollout.sglang_client import SGLangServerClient, ServerUnavailable
from gspo_megatron.rollout.types import (GenerationRequest, RolloutEngine, Sample, SamplingParams,
                                         expand_requests, sample_seed)

log = logging.getLogger(__name__)


class SampleFailed(RuntimeError):
    """A sample failed on every server it was tried on."""


@dataclass
class _Server:
    client: SGLangServerClient
    outstanding: int = 0
    alive: bool = True


class SGLangEngine(RolloutEngine):
    """Rollouts on N HTTP servers speaking SGLang's native API."""

    def __init__(self, addresses: Sequence[str], request_timeout_s: float = 600.0,
                 max_retries: int = 3, health_timeout_s: float = 900.0,
                 max_concurrency_per_server: int = 64, launcher=None) -> None:
        super().__init__()
        if not addresses:
            raise ValueError("SGLangEngine needs at least one server address (host:port)")
        self._servers = [_Server(SGLangServerClient(a, request_timeout_s)) for a in addresses]
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.health_timeout_s = health_timeout_s
        self.max_concurrency_per_server = max_concurrency_per_server
        self.launcher = launcher
        self._lock = threading.Lock()
        self._num_retries = 0

    @classmethod
    def from_config(cls, cfg, model_path: Optional[str] = None, log_dir: Optional[str] = None,
                    enable_memory_saver: bool = False) -> "SGLangEngine":
        """Attach to ``cfg.server_addresses``, or launch ``cfg.num_servers`` (needs model_path)."""
        launcher = None
        addresses = list(cfg.server_addresses)
        if not addresses:
            if model_path is None:
                raise ValueError("rollout.sglang.server_addresses is empty and no model path was "
                                 "given to launch servers from")
            from gspo_megatron.rollout.sglang_launcher import launch_sglang_fleet

            launcher = launch_sglang_fleet(cfg, model_path, log_dir=log_dir,
                                           enable_memory_saver=enable_memory_saver,
                                           deterministic=cfg.deterministic_inference)
            addresses = launcher.addresses
        engine = cls(addresses, cfg.request_timeout_s, cfg.max_retries, cfg.health_timeout_s,
                     max_concurrency_per_server=cfg.max_concurrency_per_server,
                     launcher=launcher)
        engine.wait_healthy(cfg.health_timeout_s)
        return engine

    @property
    def clients(self) -> List[SGLangServerClient]:
        return [s.client for s in self._servers]

    # --- health -----------------------------------------------------------------------------
    def wait_healthy(self, timeout_s: Optional[float] = None, poll_s: float = 0.5) -> None:
        """Block until every server answers ``/health``; raise naming those that did not."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.health_timeout_s)
        pending = list(self._servers)
        while pending:
            pending = [s for s in pending if not s.client.health(timeout_s=min(5.0, poll_s * 4))]
            if not pending:
                break
            if self.launcher is not None:
                dead = [p.address for p in self.launcher.servers if p.process.poll() is not None]
                if dead:
                    raise RuntimeError(f"rollout servers exited during start-up: {dead}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout servers not healthy after {timeout_s}s: "
                                   f"{[s.client.address for s in pending]}")
            time.sleep(poll_s)
        for s in self._servers:
            s.alive = True

    def health(self) -> bool:
        return all(s.client.health() for s in self._servers)

    def _refresh_dead_servers(self) -> None:
        for s in self._servers:
            if not s.alive and s.client.health(timeout_s=2.0):
                log.info("server %s is healthy again", s.client.address)
                s.alive = True

    # --- scheduling -------------------------------------------------------------------------
    def _acquire(self, tried: Set[str]) -> _Server:
        if not any(s.alive for s in self._servers):
            self._refresh_dead_servers()  # a transient failure may have marked them all down
        with self._lock:
            live = [s for s in self._servers if s.alive]
            fresh = [s for s in live if s.client.address not in tried] or live
            if not fresh:
                raise SampleFailed(f"no live rollout server among "
                                   f"{[s.client.address for s in self._servers]}")
            server = min(fresh, key=lambda s: s.outstanding)
            server.outstanding += 1
            return server

    def _release(self, server: _Server) -> None:
        with self._lock:
            server.outstanding -= 1

    def _on_failure(self, server: _Server, exc: Exception) -> None:
        alive = server.client.health(timeout_s=2.0)
        with self._lock:
            self._num_retries += 1
            if not alive and server.alive:
                log.warning("rollout server %s is down (%s); taking it out of rotation",
                            server.client.address, exc)
                server.alive = False

    def _run_sample(self, req: GenerationRequest, idx: int, params: SamplingParams) -> Sample:
        seed = sample_seed(params.seed, req.prompt_id, idx)
        tried: Set[str] = set()
        errors: List[str] = []
        start = time.perf_counter()
        for attempt in range(self.max_retries + 1):
            server = self._acquire(tried)
            rid = f"{req.prompt_id}/{idx}/{attempt}"
            try:
                result = server.client.generate(
                    api.generate_payload(rid, list(req.prompt_token_ids), params, seed))
                if result.finish_reason == "abort":
                    raise ServerUnavailable(f"{server.client.address}: request {rid} aborted")
            except (ServerUnavailable, api.ProtocolError) as exc:
                errors.append(str(exc))
                tried.add(server.client.address)
                self._on_failure(server, exc)
                continue
            finally:
                self._release(server)
            return Sample(prompt_id=req.prompt_id, sample_index=idx,
                          prompt_token_ids=list(req.prompt_token_ids),
                          response_token_ids=result.token_ids, response_logprobs=result.logprobs,
                          finish_reason=result.finish_reason,
                          latency_s=time.perf_counter() - start,
                          weight_version=result.weight_version)
        raise SampleFailed(f"sample (prompt_id={req.prompt_id!r}, sample_index={idx}) failed "
                           f"{self.max_retries + 1} attempts: {errors}")

    def generate_iter(self, requests: Sequence[GenerationRequest],
                      params: SamplingParams) -> Iterator[Sample]:
        """Yield each sample as soon as it is done (completion order)."""
        work = expand_requests(requests)
        if not work:
            return
        self._refresh_dead_servers()
        workers = min(len(work), self.max_concurrency_per_server * len(self._servers))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout")
        try:
            pending = {pool.submit(self._run_sample, req, idx, params) for req, idx in work}
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield fut.result()  # re-raises SampleFailed
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> List[Sample]:
        self._num_retries = 0
        samples = list(self.generate_iter(requests, params))
        self.metrics.num_retries = self._num_retries
        return samples

    # --- memory, cache, lifecycle -----------------------------------------------------------
    def flush_cache(self) -> None:
        for c in self.clients:
            c.flush_cache()

    def release_memory(self) -> None:
        for c in self.clients:
            c.release_memory()

    def resume_memory(self) -> None:
        for c in self.clients:
            c.resume_memory()

    def shutdown(self) -> None:
        super().shutdown()
        if self.launcher is not None:
            self.launcher.stop()
            self.launcher = None
