"""The contract between the trainer and every rollout engine.

The trainer builds :class:`GenerationRequest` objects (one prompt, ``n`` samples, or one chosen
sample index), passes them with one :class:`SamplingParams` to :meth:`RolloutEngine.generate`,
and gets back one :class:`Sample` per (prompt_id, sample_index), sorted by that key, whatever
order the engine finished them in. Engines: :mod:`rollout.embedded.engine` (transformers, in-process,
the CPU default) and :mod:`rollout.sglang.engine` (a fleet of SGLang servers, or the CPU
reference server of :mod:`rollout.standin.server`).

New weights reach an engine through :meth:`RolloutEngine.update_weights`, an iterator of
``(hf_name, tensor)`` pairs. How they travel is a :class:`WeightTransport` (implemented in
``gspo_megatron.weight_sync``; this package never imports Megatron nor weight_sync).

Log-prob semantics (all engines): ``response_logprobs[t] = log softmax(logits_t / T)[y_t]``,
the log-prob of the sampled token under the temperature-scaled distribution *before* top-p
truncation; this is what SGLang returns and what the learner recomputes. With ``top_p < 1``
the embedded engine can instead return the log-prob under the truncated, renormalised
distribution actually sampled from (``logprob_mode="sampled"``); see docs/rollout.md.
"""

from __future__ import annotations

import abc
import math
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

NamedTensors = Iterable[Tuple[str, torch.Tensor]]

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one rollout batch (SGLang's names where they exist)."""

    temperature: float = 1.0
    """Softmax temperature; > 0 (greedy log-probs are not a policy)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    max_new_tokens: int = 64
    stop: Tuple[str, ...] = ()
    """Stop strings; the response ends after the token that completes one (kept, not trimmed)."""
    stop_token_ids: Tuple[int, ...] = ()
    """Token ids that end a response (in addition to the model's EOS); the id is kept."""
    seed: Optional[int] = None
    """Base seed; sample (prompt_id, sample_index) uses a seed derived from it, so a batch is
    reproducible whatever the batching, server or retry. None: not reproducible."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @classmethod
    def from_config(cls, cfg, seed: Optional[int] = None) -> "SamplingParams":
        """Build from a ``RolloutConfig`` (temperature, top_p, max_new_tokens, stop)."""
        return cls(temperature=cfg.temperature, top_p=cfg.top_p,
                   max_new_tokens=cfg.max_new_tokens, stop=tuple(cfg.stop), seed=seed)


def sample_seed(base_seed: Optional[int], prompt_id: str, sample_index: int) -> Optional[int]:
    """A per-sample seed that depends only on (base seed, prompt id, sample index).

    Uses a stable hash (not Python's salted ``hash``) so that every process agrees.
    """
    if base_seed is None:
        return None
    h = 1469598103934665603  # FNV-1a, 64 bit
    for byte in f"{base_seed}\x00{prompt_id}\x00{sample_index}".encode():
        h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFF  # SGLang validates sampling_seed as a (32-bit safe) int


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt and how many samples to draw from it.

    ``sample_index`` set: draw exactly that one sample (used for retries and resharding);
    otherwise draw samples ``0 .. n-1``.
    """

    prompt_id: str
    prompt_token_ids: Tuple[int, ...]
    n: int = 1
    sample_index: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError(f"GenerationRequest {self.prompt_id!r}: empty prompt_token_ids")
        if self.n < 1:
            raise ValueError(f"GenerationRequest {self.prompt_id!r}: n must be >= 1, got {self.n}")

    def sample_indices(self) -> List[int]:
        return [self.sample_index] if self.sample_index is not None else list(range(self.n))


class MalformedLogprobs(ValueError):
    """A sample's engine log-probs are missing, short or not finite; names the sample."""


def check_sample_logprobs(sample: "Sample") -> None:
    """One finite log-prob per response token, or :class:`MalformedLogprobs` naming the sample:
    the losses read them as pi_rollout (the importance correction's denominator, and pi_old
    itself under ``algo.old_logprob_source=rollout``)."""
    got, want = len(sample.response_logprobs), len(sample.response_token_ids)
    if got != want:
        raise MalformedLogprobs(f"sample {sample.key}: the engine returned {got} log-probs for "
                                f"{want} response tokens; every token needs the log-prob it was "
                                "sampled with (the importance correction and the old policy "
                                "read them)")
    bad = [i for i, v in enumerate(sample.response_logprobs) if not math.isfinite(v)]
    if bad:
        raise MalformedLogprobs(f"sample {sample.key}: the engine's log-prob of response token "
                                f"{bad[0]} is {sample.response_logprobs[bad[0]]} ({len(bad)} not "
                                "finite)")


@dataclass
class Sample:
    """One generated response with the engine's log-probs of its tokens."""

    prompt_id: str
    sample_index: int
    prompt_token_ids: List[int]
    response_token_ids: List[int]
    response_logprobs: List[float]
    """One per response token; see the module docstring for the semantics."""
    finish_reason: str
    """``stop`` (EOS, stop id or stop string), ``length`` (max_new_tokens) or ``abort``."""
    latency_s: float
    """Seconds from submission to completion of this sample (as the engine saw it)."""
    weight_version: Optional[str] = None
    routed_experts: Optional[torch.Tensor] = None
    """MoE routing replay from the rollout (R3), when asked for: int16 ``[P + R - 1, layers,
    top_k]``, the experts every MoE layer routed positions ``0 .. P + R - 2`` of prompt +
    response to (SGLang's ``routed_experts``; the last token is never fed back). See
    :mod:`rollout.routed_experts`."""
    token_versions: Optional[List[int]] = None
    """One per response token: the weight version (the learner step whose weights the engine
    served) that generated it, when the engine tracks it (SGLang: ``meta_info.weight_versions``).
    A partial rollout that went on across a weight update holds more than one version; the
    staleness bound and lag metrics read the oldest (``rollout.max_staleness``)."""
    served_by: Optional[Dict[str, int]] = None
    """Response tokens per server address that generated them (server engines; a sample cut
    by a sync or a server's death may have gone on elsewhere)."""
    resent: List[str] = field(default_factory=list)
    """Why each earlier attempt of this sample ended without its answer (a server lost, a
    timeout, our own pause), in order: the sample was sent again after each."""
    prompt_cache: Optional[Tuple[int, int]] = None
    """``(cached, input)`` tokens of the request that generated its last tokens: how many of
    the tokens it sent (the prompt, plus the tokens kept from a cut attempt) the server's
    prefix cache already held (SGLang's ``meta_info.cached_tokens``); None where the engine
    does not say. Routing a group's samples to one server raises it (rollout.sglang.routing)."""

    @property
    def key(self) -> Tuple[str, int]:
        return (self.prompt_id, self.sample_index)


def prefix_cache_hit(samples: Sequence[Sample]) -> Optional[float]:
    """Cached / input tokens summed over the samples that report them (None: none does)."""
    counts = [s.prompt_cache for s in samples if s.prompt_cache is not None]
    total = sum(n for _, n in counts)
    return sum(c for c, _ in counts) / total if total else None


def expand_requests(requests: Sequence[GenerationRequest]) -> List[Tuple[GenerationRequest, int]]:
    """Every (request, sample_index) to produce, refusing duplicate keys."""
    seen: Dict[Tuple[str, int], None] = {}
    out: List[Tuple[GenerationRequest, int]] = []
    for req in requests:
        for idx in req.sample_indices():
            if (req.prompt_id, idx) in seen:
                raise ValueError(f"duplicate sample key (prompt_id={req.prompt_id!r}, "
                                 f"sample_index={idx}) in one generate() call")
            seen[(req.prompt_id, idx)] = None
            out.append((req, idx))
    return out


def sort_samples(samples: Iterable[Sample]) -> List[Sample]:
    return sorted(samples, key=lambda s: s.key)


@dataclass
class WeightSyncStats:
    """What one weight update moved, how long it took, and how long each protocol phase took."""

    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0
    phases: Dict[str, float] = field(default_factory=dict)
    """``weight_sync/<phase>_s`` and server counts reported by the engine (pause, abort, begin,
    transfer, end, flush, continue; num_servers, num_skipped_servers)."""

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def add_bucket(self, num_tensors: int, num_bytes: int) -> None:
        self.num_buckets += 1
        self.num_tensors += num_tensors
        self.num_bytes += num_bytes

    def as_metrics(self, prefix: str = "weight_sync/") -> Dict[str, float]:
        out = {f"{prefix}total_s": self.seconds, f"{prefix}gb_per_s": self.gb_per_s,
               f"{prefix}gb": self.num_bytes / 1e9, f"{prefix}num_buckets": float(self.num_buckets),
               f"{prefix}num_tensors": float(self.num_tensors)}
        out.update(self.phases)
        return out


@dataclass
class RolloutMetrics:
    """Throughput of the last generate() call and of the last weight update."""

    batch_seconds: float = 0.0
    num_samples: int = 0
    num_generated_tokens: int = 0
    num_retries: int = 0
    prefix_cache_hit: Optional[float] = None
    """Of the input tokens of the batch's requests, the fraction the servers' prefix caches held
    (samples that report it, :attr:`Sample.prompt_cache`)."""
    last_weight_sync: WeightSyncStats = field(default_factory=WeightSyncStats)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.batch_seconds if self.batch_seconds > 0 else 0.0

    def as_dict(self) -> Dict[str, float]:
        out = {"rollout/batch_seconds": self.batch_seconds, "rollout/tokens_per_s": self.tokens_per_s,
               "rollout/num_samples": float(self.num_samples),
               "rollout/num_generated_tokens": float(self.num_generated_tokens),
               "rollout/num_retries": float(self.num_retries)}
        if self.prefix_cache_hit is not None:
            out["rollout/prefix_cache_hit"] = self.prefix_cache_hit
        out.update(self.last_weight_sync.as_metrics())
        return out


class WeightTransport(abc.ABC):
    """Moves ``(hf_name, tensor)`` pairs from the learner into one engine (see weight_sync)."""

    @abc.abstractmethod
    def send(self, named_tensors: NamedTensors, weight_version: Optional[str] = None) -> WeightSyncStats:
        """Run the whole update (protocol and buckets); returns once the engine serves the new
        weights."""

    def close(self) -> None:
        """Release groups, files or handles held by the transport."""


class RolloutEngine(abc.ABC):
    """What the trainer may ask of a rollout engine."""

    def __init__(self) -> None:
        self.metrics = RolloutMetrics()
        self._transport: Optional[WeightTransport] = None

    @abc.abstractmethod
    def _generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> List[Sample]:
        """Produce every requested sample, in any order."""

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> List[Sample]:
        """Every requested sample exactly once, sorted by (prompt_id, sample_index)."""
        wanted = {(r.prompt_id, i) for r, i in expand_requests(requests)}
        start = time.perf_counter()
        samples = sort_samples(self._generate(requests, params))
        got = [s.key for s in samples]
        if len(got) != len(set(got)) or set(got) != wanted:
            raise RuntimeError(f"{type(self).__name__} returned samples {sorted(set(got) ^ wanted)[:8]} "
                               f"that differ from the requested set (or duplicates)")
        self.metrics.batch_seconds = time.perf_counter() - start
        self.metrics.num_samples = len(samples)
        self.metrics.num_generated_tokens = sum(len(s.response_token_ids) for s in samples)
        self.metrics.prefix_cache_hit = prefix_cache_hit(samples)
        return samples

    def attach_weight_transport(self, transport: WeightTransport) -> None:
        """Route :meth:`update_weights` through ``transport`` (built by weight_sync)."""
        if getattr(transport, "engine", self) is None:
            transport.engine = self  # a transport built before its engine drives this one
        self._transport = transport

    def update_weights(self, named_tensors: NamedTensors,
                       weight_version: Optional[str] = None) -> WeightSyncStats:
        """Load new weights given by HF name; returns once generation uses them."""
        if self._transport is None:
            raise RuntimeError(f"{type(self).__name__}: no weight transport attached; build one "
                               "with gspo_megatron.weight_sync.build_transport(cfg, engine)")
        stats = self._transport.send(named_tensors, weight_version=weight_version)
        self.metrics.last_weight_sync = stats
        return stats

    # --- the weight-update protocol (weight_sync drives it around the buckets) ---------------
    def begin_weight_update(self, session: bool = True) -> List[str]:
        """Stop generation and open the engine for new weights; returns the server addresses the
        buckets must reach ([] for an in-process engine). ``session``: the transport loads
        tensors (SGLang's begin/end_weight_update), not a directory."""
        return []

    def finish_weight_update(self, weight_version: Optional[str]) -> Dict[str, float]:
        """Close the update, record ``weight_version``, let generation go on; phase metrics.
        In-process engines need no more than the recording done here."""
        if weight_version is not None:
            self.weight_version = weight_version
        return {}

    def cancel_weight_update(self) -> None:
        """Best-effort cleanup after a failed transfer."""

    def release_memory(self) -> None:
        """Colocated mode: free the engine's accelerator memory (weights and KV cache)."""

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Colocated mode: take the memory back (``tags``: a part of it, e.g. ``["weights"]``
        before a weight sync); generation may run once nothing is released."""

    def cancel_generation(self) -> None:
        """Stop what is being generated, for a run that is leaving (a preempted step it
        abandons): a generate call in flight then fails soon instead of running to its end.
        In-process engines stop with the thread that drives them; nothing to do here."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can serve generate() now."""

    def shutdown(self) -> None:
        """Stop what the engine started; idempotent."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
