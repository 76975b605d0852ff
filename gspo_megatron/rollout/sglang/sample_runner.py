"""One sample on the fleet: its attempts, what each answer means, and (opt-in) the segments
of a partial rollout. :class:`SampleRunner` is the part of :class:`rollout.sglang.engine.
SGLangEngine` that runs in its worker threads, one call of :meth:`SampleRunner._run_sample` per
sample.

Per attempt: wait while a sync of ours holds generation paused, take a member (least-loaded, or
the prompt's home server: ``rollout/sglang/server_pool.py``),
send, read the answer. A connection error, timeout, HTTP 5xx or malformed body is a failure
(another server is tried, up to ``max_retries`` more attempts, and a server that then fails
its health probe leaves the rotation). An ``abort`` finish caused by our own pause, or an answer
from weights the engine was not serving while the request ran (that server leaves the
rotation), is run again without counting. With ``keep_partial_rollouts`` the tokens of a
request our pause cut are kept and the next attempt continues them
(:mod:`rollout.sglang.partial_rollout`).

Thread-safe: counters under the engine's lock, the pool's state under its own; each sample is
owned by the one thread that runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import torch

from gspo_megatron.faults import kill_points
from gspo_megatron.rollout.routed_experts import MalformedRouting, decode_sglang
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import ServerUnavailable
from gspo_megatron.rollout.sglang.partial_rollout import (MissingWeightVersions, PartialRollout,
                                                          integer_versions, version_order_error)
from gspo_megatron.rollout.sglang.server_pool import NoLiveServer, ServerState
from gspo_megatron.rollout.types import GenerationRequest, Sample, SamplingParams, sample_seed


class SampleFailed(RuntimeError):
    """A sample failed on every server it was tried on."""


HEALTH_PROBE_S = 5.0
"""The health probe after a failed attempt (``_on_failure``)."""


class _Retry(Exception):
    """An attempt to run again elsewhere; ``free``: caused by our own pause, not a failure;
    ``cut``: the answer of a request our pause aborted (its partial response)."""

    def __init__(self, message: str, free: bool = False,
                 cut: Optional[api.GenerateResult] = None) -> None:
        super().__init__(message)
        self.free = free
        self.cut = cut


@dataclass
class BatchCounts:
    """What one generate call counts (calls may run at once)."""

    num_retries: int = 0


def _prompt_cache(req: GenerationRequest, rollout: PartialRollout,
                  result: api.GenerateResult) -> Optional[Tuple[int, int]]:
    """``(cached, input)`` tokens of the last request: its input was the prompt and the tokens
    kept before its own segment."""
    if result.cached_tokens is None:
        return None
    sent = len(req.prompt_token_ids) + len(rollout.tokens) - len(result.token_ids)
    return result.cached_tokens, sent


class SampleRunner:
    """The attempts of one sample (a mixin of the engine). Reads the engine's ``pool``,
    ``control``, ``warmup``, ``max_retries``, ``request_timeout_s``, ``routing_shape``,
    ``keep_partial_rollouts``, ``partial_stats``, ``cancelled``, ``_count_lock``,
    ``_num_retries`` and ``_sglang_versions`` (set in its ``__init__``)."""

    def _attempt(self, server: ServerState, rid: str, payload: Dict, epoch: int) -> api.GenerateResult:
        self.pool.sent(server, rid)
        try:
            result = server.client.generate(payload)
        except ServerUnavailable as exc:
            if exc.timed_out:  # the server may still be generating it: tell it to stop
                try:
                    server.client.abort_request(rid, timeout_s=5.0)
                    self.pool.answered(server, rid)
                except (ServerUnavailable, api.ServerRefused):
                    pass  # stays in sent_rids; the next sync aborts it
            else:
                self.pool.answered(server, rid)
            raise
        self.pool.answered(server, rid)
        if kill_points.armed("rollout"):
            self._kill_if_others_in_flight(rid)
        if result.finish_reason == "abort":
            ours = self.control.pause_epoch != epoch
            raise _Retry(f"{server.address}: request {rid} aborted", free=ours,
                         cut=result if ours else None)
        return result

    def _kill_if_others_in_flight(self, rid: str) -> None:
        """The ``rollout`` kill point (test hook, ``faults/kill_points.py``): dies once an answer
        came back while other requests of ours are still running on a server."""
        in_flight = self.pool.in_flight()
        if in_flight:
            kill_points.kill("rollout", f"{rid} answered, {len(in_flight)} requests in flight: "
                                        f"{in_flight[:3]}")

    def _run_sample(self, req: GenerationRequest, idx: int, params: SamplingParams,
                    counts: BatchCounts) -> Sample:
        name = f"sample (prompt_id={req.prompt_id!r}, sample_index={idx})"
        rollout = PartialRollout(list(req.prompt_token_ids), params,
                                 sample_seed(params.seed, req.prompt_id, idx))
        tried: Set[str] = set()
        errors: List[str] = []
        start = time.perf_counter()
        attempt = failures = 0
        warmed = False
        while failures <= self.max_retries:
            # read before the gate: a pause that begins after it cuts this attempt (pause_and_abort
            # closes the gate, then bumps the epoch)
            epoch, sent_at = self.control.pause_epoch, self.control.version_index()
            server = self._acquire(name, tried, errors, req)
            if not warmed and self.warmup is not None:
                warmed = True
                try:
                    self.warmup.before_first_attempt(server, req)
                finally:
                    self.pool.release(server)
                continue  # a sync may have begun meanwhile: the gate and epoch are read again
            rid = f"{req.prompt_id}/{idx}/{attempt}"
            attempt += 1
            try:
                result = self._attempt(server, rid, rollout.payload(rid, self.routing_shape is not None),
                                       epoch)
                versions = self._segment_versions(server, rid, result, sent_at)
            except _Retry as exc:
                errors.append(str(exc))
                failures += 0 if exc.free else 1
                self._count_retry(counts)
                if exc.cut is not None and self.keep_partial_rollouts:
                    self._keep_cut(server, rid, exc.cut, rollout, sent_at, errors)
                continue
            except (ServerUnavailable, api.ProtocolError) as exc:
                errors.append(str(exc))
                tried.add(server.address)
                failures += 1
                self._on_failure(server, exc, counts)
                continue
            finally:
                self.pool.release(server)
            rollout.extend(result.token_ids, result.logprobs, versions, server.address)
            return self._sample(req, idx, rollout, result, server, rid, start, errors)
        raise SampleFailed(f"{name} failed {self.max_retries + 1} attempts: {errors}")

    def _acquire(self, name: str, tried: Set[str], errors: List[str],
                 req: GenerationRequest) -> ServerState:
        """A server for the next attempt, once no sync of ours holds generation paused (the
        prompt and its group's size steer ``prompt_affinity`` routing)."""
        if self.cancelled.is_set():
            raise SampleFailed(f"{name}: generation cancelled (the run is leaving)")
        if not self.control.wait_open(self.request_timeout_s):
            raise SampleFailed(f"{name}: generation stayed paused for {self.request_timeout_s:g}s "
                               "(a weight sync or memory release that did not end); errors so "
                               f"far: {errors}")
        try:
            return self.pool.acquire(tried, self.control.weight_version, req.prompt_id, req.n)
        except NoLiveServer as exc:
            raise SampleFailed(f"{name}: {exc}; errors so far: {errors}") from exc

    def _segment_versions(self, server: ServerState, rid: str, result: api.GenerateResult,
                          sent_at: int) -> Optional[List[str]]:
        """The version of each token of an answer (None: the server sent no spans), checked with
        the answer's ``weight_version`` against the versions the engine served from sending it
        to now: a server on other weights (stale, or restarted) leaves the rotation and the
        attempt runs again. Partial rollouts need the spans: a server without them ends the
        batch (:class:`MissingWeightVersions`)."""
        versions = result.token_versions
        if versions is None and self.keep_partial_rollouts:
            raise MissingWeightVersions(
                f"rollout server {server.address} (SGLang {self._sglang_version(server)}) "
                f"answered request {rid} without meta_info.weight_versions, which partial "
                "rollouts (keep_partial_rollouts, for rollout.max_staleness >= 2) need for "
                "the weight version of every token; SGLang returns them from 0.5.19, this "
                f"client speaks {api.SGLANG_VERSION}")
        problem = version_order_error(list(versions or []) + [result.weight_version],
                                      self.control.versions_since(sent_at))
        if problem:
            self.pool.mark_dead(server, f"request {rid}: {problem}")
            raise _Retry(f"{server.address}: request {rid}: stale weights: {problem}", free=True)
        return versions

    def _keep_cut(self, server: ServerState, rid: str, cut: api.GenerateResult,
                  rollout: PartialRollout, sent_at: int, errors: List[str]) -> None:
        """Keep what a request cut by our pause generated (partial rollouts)."""
        try:
            versions = self._segment_versions(server, rid, cut, sent_at)
        except _Retry as exc:  # another server's weights: nothing of it is kept
            errors.append(str(exc))
            return
        kept = rollout.keep_cut(cut.token_ids, cut.logprobs, versions, server.address)
        self.partial_stats.record_cut(len(cut.token_ids), kept)

    def _sglang_version(self, server: ServerState) -> str:
        if server.address not in self._sglang_versions:
            try:
                self._sglang_versions[server.address] = str(server.client.server_info(5.0).get("version"))
            except (ServerUnavailable, api.ServerRefused, ValueError):
                return "unknown"
        return self._sglang_versions[server.address]

    def _sample(self, req: GenerationRequest, idx: int, rollout: PartialRollout,
                result: api.GenerateResult, server: ServerState, rid: str, start: float,
                errors: List[str]) -> Sample:
        token_versions = integer_versions(rollout.versions)
        if self.keep_partial_rollouts:
            self.partial_stats.record_sample(rollout.versions)
            if token_versions is None:
                raise ValueError(f"keep_partial_rollouts: sample (prompt_id={req.prompt_id!r}, "
                                 f"sample_index={idx}) has tokens of weight versions "
                                 f"{sorted(set(rollout.versions or []))}; partial rollouts "
                                 "record learner steps (sync with weight_version=str(step))")
        return Sample(prompt_id=req.prompt_id, sample_index=idx,
                      prompt_token_ids=list(req.prompt_token_ids),
                      response_token_ids=rollout.tokens, response_logprobs=rollout.logprobs,
                      finish_reason=result.finish_reason,
                      latency_s=time.perf_counter() - start,
                      weight_version=result.weight_version,
                      routed_experts=self._routed_experts(server, rid, result),
                      token_versions=token_versions,
                      served_by=dict(rollout.servers), resent=list(errors),
                      prompt_cache=_prompt_cache(req, rollout, result))

    def _routed_experts(self, server: ServerState, rid: str,
                        result: api.GenerateResult) -> Optional[torch.Tensor]:
        """The sample's routing (R3), decoded; a server that left it out was started without the
        capture flag, which no retry mends: :class:`MalformedRouting` ends the batch. A partial
        rollout's last segment covers prompt + every kept token + its own: SGLang's routing of
        the whole sequence under the weights of that segment (the earlier segments' KV, and
        routing, was recomputed by them)."""
        if self.routing_shape is None:
            return None
        where = f"{server.address}, request {rid}"
        if result.routed_experts is None:
            raise MalformedRouting(f"{where}: the answer has no meta_info.routed_experts, which "
                                   "algo.routing_replay=rollout replays; start the server with "
                                   "--enable-return-routed-experts")
        return decode_sglang(result.routed_experts, self.routing_shape, where)

    def _count_retry(self, counts: BatchCounts) -> None:
        with self._count_lock:
            self._num_retries += 1
            counts.num_retries += 1

    def _on_failure(self, server: ServerState, exc: Exception, counts: BatchCounts) -> None:
        self._count_retry(counts)
        if not server.client.health(timeout_s=HEALTH_PROBE_S):
            self.pool.mark_dead(server, str(exc))

