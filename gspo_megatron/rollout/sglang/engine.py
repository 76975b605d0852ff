"""SGLang rollout engine: a fleet of SGLang (or reference) servers behind the RolloutEngine API.

Each sample is one non-streaming ``/generate`` request (with its own ``sampling_seed``), sent to
the member server with the fewest outstanding requests. Results come back as they finish
(:meth:`SGLangEngine.generate_iter`); :meth:`generate` collects and sorts them.

Failure handling, per sample: a connection error, timeout, HTTP 5xx, malformed body, an
``abort`` finish or an answer from stale weights is retried on another server (up to
``max_retries`` more attempts); a server that then fails its health probe leaves the rotation
(:mod:`rollout.sglang.server_pool`). Each sample is owned by one task that accepts exactly one answer,
so no sample is lost or duplicated; an attempt the client gave up on (timeout) is aborted on its
server by request id, since SGLang would otherwise keep generating it. An abort caused by our own
weight-sync pause is retried without counting as a failure; with ``keep_partial_rollouts`` its
partial response is kept and continued under the new weights instead
(:mod:`rollout.sglang.partial_rollout`). A sample that exhausts its retries fails the batch with
an error naming it.

Thread-safe: several threads may call :meth:`SGLangEngine.generate` at once (each call runs its
own workers; a sample key may be in one call at a time) while another runs a weight sync; the
workers then wait, client-side, until the sync has continued generation. ``metrics`` describes
the last call to finish.

Weight syncs and colocated memory go through :mod:`rollout.sglang.control` (pause, abort,
session, flush, continue; release / resume).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

from gspo_megatron.rollout.routed_experts import RoutingShape
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import SGLangServerClient, ServerUnavailable
from gspo_megatron.rollout.sglang.control import FleetControl
from gspo_megatron.rollout.sglang.partial_rollout import PartialRolloutStats, integer_versions
from gspo_megatron.rollout.sglang.prefix_warmup import PrefixWarmup
from gspo_megatron.rollout.sglang.sample_runner import (HEALTH_PROBE_S, BatchCounts, SampleFailed,
                                                        SampleRunner)
from gspo_megatron.rollout.sglang.server_pool import NoLiveServer, ServerPool
from gspo_megatron.rollout.types import (GenerationRequest, RolloutEngine, Sample, SamplingParams,
                                         expand_requests)

log = logging.getLogger(__name__)


class RolloutStalled(SampleFailed):
    """No sample of a batch finished within the longest time one sample's attempts may take."""


class ServerSetupError(RuntimeError):
    """A server that is up but was started in a way this run cannot use (checked at attach)."""


BIND_FAILURE = "error while attempting to bind on address"
"""What SGLang 0.5.23's HTTP server (uvicorn) logs when its port is taken; the process does not
exit after it (its scheduler and detokenizer keep it alive), so health polls would go to the
port's other owner until the start-up deadline."""


def _failed_to_bind(log_path: Optional[str]) -> bool:
    if not log_path:
        return False
    try:
        with open(log_path, errors="replace") as f:
            return BIND_FAILURE in f.read()
    except OSError:
        return False


class SGLangEngine(SampleRunner, RolloutEngine):
    """Rollouts on N HTTP servers speaking SGLang's native API."""

    def __init__(self, addresses: Sequence[str], request_timeout_s: float = 600.0,
                 max_retries: int = 3, health_timeout_s: float = 900.0,
                 max_concurrency_per_server: int = 64, launcher=None, server_tp_size: int = 1,
                 keep_partial_rollouts: bool = False, routing: str = "least_loaded") -> None:
        super().__init__()
        if not addresses:
            raise ValueError("SGLangEngine needs at least one server address (host:port)")
        self.pool = ServerPool([SGLangServerClient(a, request_timeout_s) for a in addresses], routing)
        self.control = FleetControl(self.pool)
        self.warmup = PrefixWarmup(self.pool, request_timeout_s) if routing == "prompt_affinity" else None
        """``prompt_affinity``: each prompt is prefilled once per server before its samples."""
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.health_timeout_s = health_timeout_s
        self.max_concurrency_per_server = max_concurrency_per_server
        self.server_tp_size = server_tp_size
        self.launcher = launcher
        self.require_memory_saver = False
        """Attached servers of a colocated run must run with ``--enable-memory-saver``."""
        self.routing_shape: Optional[RoutingShape] = None
        """Set (R3): ask every sample's routed experts and decode them to this shape."""
        self.keep_partial_rollouts = keep_partial_rollouts
        """A request cut by our own weight-sync pause keeps what it generated and continues
        under the new weights (``rollout/sglang/partial_rollout.py``); off: it starts again
        from its prompt. The trainer sets it for ``rollout.max_staleness >= 2``."""
        self.partial_stats = PartialRolloutStats()
        self._count_lock = threading.Lock()
        self._num_retries = 0
        """Retried attempts since the engine started (every call)."""
        self._active: Set[Tuple[str, int]] = set()
        """Sample keys some generate call is working on (their request ids name them)."""
        self._sglang_versions: Dict[str, str] = {}
        self.cancelled = threading.Event()
        """Set by :meth:`cancel_generation`: every attempt after it fails at once."""

    @classmethod
    def from_config(cls, cfg, model_path: Optional[str] = None, log_dir: Optional[str] = None,
                    enable_memory_saver: bool = False, launch=None,
                    key_file: Optional[str] = None,
                    routing_shape: Optional[RoutingShape] = None,
                    keep_partial_rollouts: bool = False) -> "SGLangEngine":
        """Attach to ``cfg.server_addresses``, or start ``cfg.num_servers`` with ``launch(cfg,
        model_path, log_dir=..., enable_memory_saver=..., key_file=...)`` (SGLang by default;
        launched servers require the keys in ``key_file``, ``rollout/sglang/server_keys.py``); then wait
        for health and check every server runs SGLang :data:`api.SGLANG_VERSION`.
        ``routing_shape`` (R3): launched servers capture routed experts and every sample returns
        them (attached servers must run with ``--enable-return-routed-experts``).
        ``keep_partial_rollouts``: see the attribute."""
        launcher, addresses = None, list(cfg.server_addresses)
        if not addresses:
            if model_path is None:
                raise ValueError("rollout.sglang.server_addresses is empty and no model path was "
                                 "given to launch servers from (model.hf_path)")
            if launch is None:
                from gspo_megatron.rollout.sglang.launcher import launch_sglang_fleet as launch
            launcher = launch(cfg, model_path, log_dir=log_dir, enable_memory_saver=enable_memory_saver,
                              key_file=key_file, return_routed_experts=routing_shape is not None)
            addresses = launcher.addresses
        engine = cls(addresses, cfg.request_timeout_s, cfg.max_retries, cfg.health_timeout_s,
                     max_concurrency_per_server=cfg.max_concurrency_per_server,
                     launcher=launcher, server_tp_size=cfg.tp,
                     keep_partial_rollouts=keep_partial_rollouts, routing=cfg.routing)
        engine.require_memory_saver = enable_memory_saver and launcher is None
        engine.routing_shape = routing_shape
        return engine._start(recover=launcher is None)

    @classmethod
    def attach(cls, addresses: Sequence[str], **kwargs) -> "SGLangEngine":
        """An engine on servers that are already running (perhaps left by a trainer that died):
        recover them, wait for health, check the version."""
        return cls(addresses, **kwargs)._start(recover=True)

    def _start(self, recover: bool) -> "SGLangEngine":
        try:
            if recover:
                self.recover_servers()
            self.wait_healthy(self.health_timeout_s)
            self.check_versions()
        except Exception:
            self.shutdown()
            raise
        return self

    def recover_servers(self) -> None:
        """Undo what a killed predecessor may have left on servers we did not start: an open
        weight-update session (``/begin_weight_update`` would be refused) and paused generation
        (every request would wait at the gate; ``/ready`` says so without generating), each
        logged when found. Its broadcast group is destroyed at our first sync when the run
        recorded its name (``weight_sync/distributed_broadcast.py``). The weights may be half
        updated: the trainer syncs its own before the first rollout, since this engine has no
        weight version yet. Unreachable servers are left to the health check."""
        for s in self.pool.servers:
            try:
                s.client.end_weight_update()
                log.warning("rollout server %s had a weight-update session open (a previous "
                            "trainer died inside a sync): ended it", s.address)
            except api.ServerRefused:
                pass  # none open: the normal case
            except ServerUnavailable as exc:
                log.warning("rollout server %s: %s", s.address, exc)
                continue
            try:
                paused = not s.client.ready()
                s.client.continue_generation()
                if paused:
                    log.warning("rollout server %s had generation paused (a previous trainer "
                                "died inside a sync): continued it", s.address)
            except (api.ServerRefused, ServerUnavailable) as exc:
                log.warning("rollout server %s: continuing generation: %s", s.address, exc)

    @property
    def clients(self) -> List[SGLangServerClient]:
        return [s.client for s in self.pool.servers]

    @property
    def weight_version(self) -> Optional[str]:
        return self.control.weight_version

    # --- health and version -----------------------------------------------------------------
    def wait_healthy(self, timeout_s: Optional[float] = None, poll_s: float = 0.5) -> None:
        """Block until every server answers ``/health_generate``; raise naming those that did not."""
        timeout_s = self.health_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending = list(self.pool.servers)
        while pending:
            pending = [s for s in pending if not s.client.health(timeout_s=min(30.0, max(1.0, poll_s * 4)))]
            if not pending:
                break
            if self.launcher is not None:
                dead = [p.address for p in self.launcher.servers if p.process.poll() is not None]
                if dead:
                    raise RuntimeError(f"rollout servers exited during start-up: {dead}")
                unbound = [p for p in self.launcher.servers if _failed_to_bind(p.log_path)]
                if unbound:  # SGLang logs it and lives on; its port answers for someone else
                    raise RuntimeError(
                        "rollout servers could not listen on their ports (another process holds "
                        f"them): {[p.address for p in unbound]}; see {unbound[0].log_path}; "
                        "choose another rollout.sglang.port")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout servers not healthy after {timeout_s}s: "
                                   f"{[s.address for s in pending]}")
            time.sleep(poll_s)
        for s in self.pool.servers:
            s.alive = True

    def check_versions(self) -> None:
        """Refuse servers that do not run the SGLang version this client was written against,
        and (colocated runs on servers we did not start) servers without the memory saver:
        SGLang would answer their first release with 200 and free nothing."""
        for s in self.pool.servers:
            info = s.client.server_info()
            if self.require_memory_saver and not info.get("enable_memory_saver"):
                raise ServerSetupError(
                    f"rollout server {s.address} runs without --enable-memory-saver, which "
                    "rollout.mode=colocated needs to release its memory while the learner "
                    "trains; restart it with the flag, or set rollout.mode=disaggregated")
            version = info.get("version")
            self._sglang_versions[s.address] = str(version)
            if version != api.SGLANG_VERSION:
                raise RuntimeError(f"rollout server {s.address} runs SGLang {version}; this client "
                                   f"speaks SGLang {api.SGLANG_VERSION} (its pause / weight-update "
                                   "protocol); use the project's image")

    def health(self) -> bool:
        return all(s.client.health() for s in self.pool.servers)

    def probe_servers(self, prompt_token_ids: Sequence[int],
                      params: SamplingParams) -> Dict[str, tuple]:
        """One sample from ``prompt_token_ids`` on every member server: ``{address: (token ids,
        log-probs)}`` (``trainer/sync_check.py`` compares them with the learner's). A server
        that cannot be reached leaves the rotation, as in generation."""
        out: Dict[str, tuple] = {}
        for s in list(self.pool.members):
            payload = api.generate_payload(f"sync-probe/{self.control.weight_version}",
                                           list(prompt_token_ids), params, params.seed)
            try:
                result = s.client.generate(payload)
            except ServerUnavailable as exc:
                self.pool.mark_dead(s, f"sync probe: {exc}")
                continue
            out[s.address] = (result.token_ids, result.logprobs)
        return out

    # --- generation -------------------------------------------------------------------------
    def stall_timeout_s(self) -> float:
        """The longest wait for a batch's next sample: each attempt of a sample is bounded by
        ``request_timeout_s`` and the health probe after it, ``max_retries + 1`` counted attempts
        and one re-send after a pause. Past it a worker is stuck where none of its own deadlines
        can fire, and :meth:`generate_iter` raises instead of waiting forever."""
        return (self.max_retries + 2) * (self.request_timeout_s + HEALTH_PROBE_S)

    def fleet_metrics(self) -> Dict[str, float]:
        """``rollout/live_servers``: members of the pool now (serving the current weights);
        ``rollout/dead_servers``: out of rotation until a sync re-admits them."""
        live = len(self.pool.members)
        return {"rollout/live_servers": float(live),
                "rollout/dead_servers": float(len(self.pool.servers) - live)}

    def partial_rollout_metrics(self) -> Dict[str, float]:
        """Partial rollouts since the engine started (``rollout/partial/*``: segments cut by our
        pauses, resumed, tokens kept and dropped, samples, samples of more than one version);
        the difference of two reads is one step's. Per sync, ``finish_weight_update`` reports
        ``weight_sync/num_interrupted_requests``."""
        return self.partial_stats.as_metrics()

    def _check_partial(self, params: SamplingParams) -> None:
        """What partial rollouts cannot do, refused before anything is sent."""
        if params.stop:
            raise ValueError("keep_partial_rollouts: stop strings are not supported: SGLang "
                             "matches a stop string against one request's own output "
                             "(schedule_batch.Req.tail_str), so one split across two segments "
                             "of a resumed rollout would go unseen; use stop_token_ids")
        if integer_versions([self.control.weight_version]) is None:
            raise ValueError(f"keep_partial_rollouts: the engine serves weight version "
                             f"{self.control.weight_version!r}; partial rollouts record every "
                             "token's version as a learner step: sync weights with "
                             "weight_version=str(step) before generating")

    def _claim(self, work) -> List[Tuple[str, int]]:
        keys = [(req.prompt_id, idx) for req, idx in work]
        with self._count_lock:
            busy = sorted(self._active.intersection(keys))
            if busy:
                raise ValueError(f"samples {busy[:4]} are being generated by another generate() "
                                 "call on this engine (their request ids would collide)")
            self._active.update(keys)
        return keys

    def generate_iter(self, requests: Sequence[GenerationRequest],
                      params: SamplingParams) -> Iterator[Sample]:
        """Yield each sample as soon as it is done (completion order)."""
        return self._iter(requests, params, BatchCounts())

    def _iter(self, requests: Sequence[GenerationRequest], params: SamplingParams,
              counts: BatchCounts) -> Iterator[Sample]:
        if self.control.released:
            raise RuntimeError(f"rollout servers hold no memory for {sorted(self.control.released)}; "
                               "call resume_memory() before generating")
        if self.keep_partial_rollouts:
            self._check_partial(params)
        work = expand_requests(requests)
        if not work:
            return
        self.pool.readmit_current(self.control.weight_version)
        keys = self._claim(work)
        workers = min(len(work), self.max_concurrency_per_server * len(self.pool.servers))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout")
        try:
            pending = {pool.submit(self._run_sample, req, idx, params, counts) for req, idx in work}
            stall_s = self.stall_timeout_s()
            while pending:
                done, pending = wait(pending, timeout=stall_s, return_when=FIRST_COMPLETED)
                if not done:
                    raise RolloutStalled(
                        f"no sample of the batch finished in {stall_s:.0f}s ({len(pending)} pending "
                        f"on {[s.address for s in self.pool.servers]}): longer than "
                        f"{self.max_retries + 1} attempts of {self.request_timeout_s:.0f}s each "
                        "may take (rollout.sglang.request_timeout_s, max_retries)")
                for fut in done:
                    yield fut.result()  # re-raises SampleFailed
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            with self._count_lock:
                self._active.difference_update(keys)
            if self.warmup is not None:
                self.warmup.forget(r.prompt_id for r in requests)

    def _generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> List[Sample]:
        counts = BatchCounts()
        samples = list(self._iter(requests, params, counts))
        self.metrics.num_retries = counts.num_retries
        return samples

    # --- weight sync protocol and memory (rollout/sglang/control.py) ------------------------
    def begin_weight_update(self, session: bool = True) -> List[str]:
        return self.control.begin(session)

    def finish_weight_update(self, weight_version: Optional[str]) -> Dict[str, float]:
        self.control.finish(weight_version)
        return self.control.metrics()

    def cancel_weight_update(self) -> None:
        self.control.cancel()

    def flush_cache(self) -> None:
        self.pool.on_members(lambda s: s.client.flush_cache(), "flush_cache")

    def release_memory(self) -> None:
        self.control.release_memory()

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        self.control.resume_memory(tags)

    def cancel_generation(self) -> None:
        """No further attempt starts, and every server aborts what runs (SGLang's
        ``/abort_request {abort_all}``), so the workers of a generate call in flight end within
        one answer instead of generating to ``max_new_tokens``."""
        self.cancelled.set()
        try:
            self.pool.on_members(lambda s: s.client.abort_request(abort_all=True, timeout_s=10.0),
                                 "abort (the run is leaving)")
        except (NoLiveServer, api.ServerRefused) as exc:
            log.warning("cancelling the generation in flight: %s", exc)

    def shutdown(self) -> None:
        super().shutdown()
        if self.launcher is not None:
            self.launcher.stop()
            self.launcher = None
