"""Partial rollouts across weight updates: one sample built from the segments SGLang generated
between our pauses (opt-in, ``SGLangEngine.keep_partial_rollouts``; docs/rollout.md, "Partial
rollouts across weight updates").

A weight sync pauses the fleet with ``/pause_generation {mode: abort}``. Every running request
then answers HTTP 200 with ``finish_reason {type: abort}`` and the tokens it had, their
log-probs and ``meta_info.weight_versions`` (SGLang 0.5.23: ``scheduler.abort_request`` sets
``Req.to_finish``; the next decode step ends it and the output streamer sends it like any
finished request, ``scheduler_components/output_streamer.py: accept``). The engine keeps that
partial response on the client, and after ``/continue_generation`` sends prompt + partial as the
next segment's prompt, with ``max_new_tokens`` reduced by what it keeps: the new weights
recompute the KV of prompt + partial and sample the rest.

The last token of a cut segment is dropped. SGLang samples it in the decode step that takes
the abort and then ends the request without looking at it: ``Req.update_finish_state`` returns
at ``to_finish`` before its EOS, stop-id, stop-string and length checks
(``schedule_batch.py``; called from ``scheduler_components/batch_result_processor.py:
process_batch_result_decode`` right after the token is appended). That token may be an EOS the
server never acted on; every earlier token passed the checks. So a segment cut after ``k``
tokens contributes ``k - 1`` (none when ``k <= 1``: the segment is simply sent again, with the
same seed). Stop strings are refused with partial rollouts: SGLang matches them against the
request's own output (``Req.tail_str``, ``decoded_text``), so one split across two segments
would go unseen.

The version of every token comes from the server's spans (``[{version, start, end}]``,
``srt/utils/weight_versions.py``; the scheduler records one at every weight update whose
``weight_version`` changes its version, for every live request). Each segment's spans are
checked against what the client knows: only versions the engine served between sending the
segment and its answer, in that order.

Seeds: segment 0 uses the sample's own seed (``rollout.types.sample_seed``), so an uncut sample
is the same request as without partial rollouts; segment ``j > 0`` a seed derived from it and
``j`` (:func:`segment_seed`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.types import SamplingParams


class MissingWeightVersions(RuntimeError):
    """A server answered without ``meta_info.weight_versions``, which partial rollouts need to
    know which weights generated each token (SGLang < 0.5.19 has no spans). Not retried."""


def segment_seed(seed: Optional[int], segment: int) -> Optional[int]:
    """The seed of segment ``segment`` of a sample whose own seed is ``seed``: ``seed`` itself
    for segment 0, else a stable 31-bit hash of both (FNV-1a, as ``sample_seed``)."""
    if seed is None or segment == 0:
        return seed
    h = 1469598103934665603
    for byte in f"{seed}\x00segment\x00{segment}".encode():
        h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFF


def version_order_error(versions: Sequence[Optional[str]],
                        allowed: Sequence[Optional[str]]) -> Optional[str]:
    """Why the ``versions`` of one answer (per token, in order) cannot come from a request that
    was sent while ``allowed[0]`` was served and answered while ``allowed[-1]`` was (None when
    they can): each must be one of ``allowed``, in that order. None in ``allowed`` (before the
    engine's first sync) stands for any version."""
    position = 0
    for v, _ in itertools.groupby(versions):
        while position < len(allowed) and allowed[position] not in (None, v):
            position += 1
        if position == len(allowed):
            return (f"weight version {v!r} in the answer, but the engine served "
                    f"{list(allowed)} between sending this request and its answer")
    return None


def integer_versions(versions: Optional[Sequence[str]]) -> Optional[List[int]]:
    """``versions`` as learner steps (our versions are ``str(learner.step)``); None when one is
    not an integer (versions named otherwise: no per-token versions)."""
    if versions is None:
        return None
    try:
        return [int(v) for v in versions]
    except (TypeError, ValueError):
        return None


@dataclass
class PartialRollout:
    """The response of one sample so far: every kept token with its log-prob and version."""

    prompt: List[int]
    params: SamplingParams
    seed: Optional[int]
    """The sample's own seed (``sample_seed``); segment ``j`` uses ``segment_seed(seed, j)``."""
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: Optional[List[str]] = field(default_factory=list)
    """One per token; None once a segment came without spans (only without partial rollouts)."""
    segment: int = 0
    servers: Dict[str, int] = field(default_factory=dict)
    """Tokens kept per server address that generated them (a partial rollout may have moved)."""

    @property
    def remaining(self) -> int:
        """New tokens the next segment may generate: ``max_new_tokens`` counts the whole response."""
        return self.params.max_new_tokens - len(self.tokens)

    def payload(self, rid: str, return_routed_experts: bool) -> Dict:
        """The ``/generate`` body of the next segment: prompt + kept tokens, what is left of
        ``max_new_tokens``; the first is exactly the request of an uncut sample."""
        params = self.params
        if self.tokens:
            params = dataclasses.replace(params, max_new_tokens=self.remaining)
        return api.generate_payload(rid, self.prompt + self.tokens, params,
                                    segment_seed(self.seed, self.segment),
                                    return_routed_experts=return_routed_experts)

    def extend(self, tokens: Sequence[int], logprobs: Sequence[float],
               versions: Optional[Sequence[str]], server: Optional[str] = None) -> None:
        """Append a segment's tokens (the last segment: all of them), generated by ``server``."""
        if server is not None and tokens:
            self.servers[server] = self.servers.get(server, 0) + len(tokens)
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        if self.versions is not None and versions is not None:
            self.versions.extend(versions)
        else:
            self.versions = None

    def keep_cut(self, tokens: Sequence[int], logprobs: Sequence[float],
                 versions: Sequence[str], server: Optional[str] = None) -> int:
        """Keep a segment our pause cut: all but its last token (sampled but never checked
        for a finish, see the module docstring); returns how many were kept. Keeping any
        starts the next segment."""
        kept = max(0, min(len(tokens) - 1, self.remaining - 1))
        if kept:
            self.extend(tokens[:kept], logprobs[:kept], versions[:kept], server)
            self.segment += 1
        return kept


class PartialRolloutStats:
    """What partial rollouts kept, since the engine started (thread-safe; read a difference
    between two :meth:`as_metrics` for one step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("num_cut_segments", "num_resumed_segments", "num_kept_tokens",
             "num_dropped_tokens", "num_samples", "num_multi_version_samples"), 0)

    def record_cut(self, num_tokens: int, kept: int) -> None:
        """A segment our pause cut after ``num_tokens`` tokens, of which ``kept`` were kept."""
        with self._lock:
            c = self._counts
            c["num_cut_segments"] += 1
            c["num_resumed_segments"] += 1 if kept else 0
            c["num_kept_tokens"] += kept
            c["num_dropped_tokens"] += num_tokens - kept

    def record_sample(self, versions: Optional[Sequence[str]]) -> None:
        with self._lock:
            self._counts["num_samples"] += 1
            if versions is not None and len(set(versions)) > 1:
                self._counts["num_multi_version_samples"] += 1

    def as_metrics(self) -> Dict[str, float]:
        """``rollout/partial/<count>``: segments cut by our pauses, those resumed with kept
        tokens (the rest were sent again from where they started), tokens kept and dropped,
        finished samples and those whose tokens come from more than one weight version."""
        with self._lock:
            return {f"rollout/partial/{k}": float(v) for k, v in self._counts.items()}
