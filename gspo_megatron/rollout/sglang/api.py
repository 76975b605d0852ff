"""SGLang 0.5.23's native HTTP API as we use it: endpoint names, request bodies, response parsing.

One place owns the names, read from the pinned wheel (``sglang==0.5.23``):
``srt/entrypoints/http_server.py`` (routes, status codes), ``srt/managers/io_struct.py`` (admin
request types), ``api/v1/api_types.py`` (the JSON contract of ``/generate``: unknown
``sampling_params`` keys are rejected) and ``srt/constants.py`` (memory tags). Both the client
(:mod:`rollout.sglang.client`) and the CPU stand-in (:mod:`rollout.standin.server`) import them,
and ``tests/test_rollout_sglang_conformance.py`` checks every body against the field lists that
``tools/extract_sglang_api.py`` extracted from the wheel (``tests/data/sglang_api_0.5.23.json``).

The weight-update protocol (docs/rollout.md): ``/pause_generation {mode: abort}`` ->
``/abort_request {rid}`` for every request id still outstanding -> ``/begin_weight_update`` ->
buckets (``/update_weights_from_distributed`` or ``/update_weights_from_tensor``, refused outside
a session) -> ``/end_weight_update`` (runs the post-load processing) -> ``/flush_cache`` (refused
while requests run) -> ``/continue_generation``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from gspo_megatron.rollout.types import SamplingParams

SGLANG_VERSION = "0.5.23"
"""The one SGLang version the client speaks (the image and the ``gpu`` extra pin it)."""

GENERATE = "/generate"
HEALTH = "/health"
HEALTH_GENERATE = "/health_generate"
"""Generates one token (http_server.health_generate): 200 once any output arrives, else 503."""
READY = "/ready"
"""200 unless generation is paused or the server is not up (http_server.ready), else 503."""
MODEL_INFO = "/model_info"
MODEL_INFO_DEPRECATED = "/get_model_info"
SERVER_INFO = "/server_info"
FLUSH_CACHE = "/flush_cache"
PAUSE = "/pause_generation"
CONTINUE = "/continue_generation"
ABORT = "/abort_request"
BEGIN_UPDATE = "/begin_weight_update"
END_UPDATE = "/end_weight_update"
INIT_GROUP = "/init_weights_update_group"
DESTROY_GROUP = "/destroy_weights_update_group"
UPDATE_FROM_DISTRIBUTED = "/update_weights_from_distributed"
UPDATE_FROM_TENSOR = "/update_weights_from_tensor"
UPDATE_FROM_DISK = "/update_weights_from_disk"
RELEASE_MEMORY = "/release_memory_occupation"
RESUME_MEMORY = "/resume_memory_occupation"
GET_WEIGHTS_BY_NAME = "/get_weights_by_name"

DEFAULT_GROUP_NAME = "weight_update_group"
FLATTENED_BUCKET = "flattened_bucket"
"""``load_format`` under which SGLang receives one flat uint8 tensor per call (see buckets)."""

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""``srt/constants.py`` GPU_MEMORY_ALL_TYPES; no tags means all of them."""
PAUSE_MODES = ("abort", "retract", "in_place")
"""``io_struct.PauseGenerationReqInput.mode``; ``abort`` (the default) returns once nothing runs."""

GENERATE_FIELDS = frozenset({"rid", "input_ids", "sampling_params", "return_logprob", "stream",
                             "return_routed_experts"})
"""The ``/generate`` fields this client sends (a subset of api_types.GenerateRequest)."""
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "max_new_tokens", "stop", "stop_token_ids",
                             "sampling_seed", "no_stop_trim", "skip_special_tokens"})
"""The ``sampling_params`` keys this client sends (and the reference server implements)."""
SGLANG_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
"""Every key SGLang accepts in ``sampling_params``, in api_types.SamplingParams order (the order
its "unknown field" message lists them in)."""


class ProtocolError(RuntimeError):
    """A server answered with a body that does not follow the documented schema."""


class ServerRefused(RuntimeError):
    """A server answered a control call with ``success: false`` or an HTTP 4xx."""

    def __init__(self, server: str, endpoint: str, message: str) -> None:
        super().__init__(f"rollout server {server} refused {endpoint}: {message}")
        self.server, self.endpoint, self.message = server, endpoint, message


def unknown_field_message(key: str, fields: Sequence[str]) -> str:
    """SGLang's 400 text for a key outside a "rejected" struct (api_types._unknown_field)."""
    if not fields:
        return f"unknown field `{key}`, there are no fields"
    if len(fields) == 1:
        return f"unknown field `{key}`, expected `{fields[0]}`"
    if len(fields) == 2:
        return f"unknown field `{key}`, expected `{fields[0]}` or `{fields[1]}`"
    return f"unknown field `{key}`, expected one of " + ", ".join(f"`{f}`" for f in fields)


def generate_payload(rid: str, prompt_token_ids: List[int], params: SamplingParams,
                     seed: Optional[int], return_routed_experts: bool = False) -> Dict[str, Any]:
    """The ``/generate`` body for one sample.

    ``return_routed_experts`` (R3) asks for the experts of every position of prompt + output
    but the last (``routed_experts_start_len`` left at 0); the server needs
    ``--enable-return-routed-experts`` (``rollout/routed_experts.py``).

    ``no_stop_trim`` keeps a matched stop string / id in the output (the learner trains on
    exactly the tokens that were sampled); ``skip_special_tokens=False`` for the same reason.
    ``sampling_seed`` is honoured by SGLang only with ``--enable-deterministic-inference``.
    """
    sampling: Dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                                "max_new_tokens": params.max_new_tokens,
                                "no_stop_trim": True, "skip_special_tokens": False}
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    if seed is not None:
        sampling["sampling_seed"] = int(seed)
    body = {"rid": rid, "input_ids": list(prompt_token_ids), "sampling_params": sampling,
            "return_logprob": True, "stream": False}
    if return_routed_experts:
        body["return_routed_experts"] = True
    return body


def prefill_payload(rid: str, prompt_token_ids: List[int]) -> Dict[str, Any]:
    """The ``/generate`` body that only prefills a prompt into the server's radix cache
    (``max_new_tokens`` 0): what SGLang's own parallel sampling sends before the ``n`` samples
    of a prompt (``srt/managers/tokenizer_manager.py``, "Cache the common prefix for parallel
    sampling"), since its default ``fcfs`` schedule prefills requests that arrive together
    each in full."""
    return {"rid": rid, "input_ids": list(prompt_token_ids),
            "sampling_params": {"max_new_tokens": 0}, "stream": False}


@dataclass
class GenerateResult:
    """The parts of a ``/generate`` response a :class:`Sample` needs."""

    rid: str
    token_ids: List[int]
    logprobs: List[float]
    finish_reason: str
    e2e_latency_s: Optional[float]
    weight_version: Optional[str]
    routed_experts: Optional[str] = None
    """``meta_info["routed_experts"]`` as sent (base64 int32), when the server returned it."""
    token_versions: Optional[List[str]] = None
    """The weight version of every output token, from ``meta_info["weight_versions"]`` (None
    when the server sent no spans)."""
    cached_tokens: Optional[int] = None
    """``meta_info["cached_tokens"]``: input tokens the server's prefix cache held."""


def _finish_type(raw: Any) -> str:
    if raw is None:
        raise ProtocolError("finished /generate response has finish_reason null")
    kind = raw.get("type") if isinstance(raw, dict) else raw
    if kind not in ("stop", "length", "abort"):
        raise ProtocolError(f"unknown finish_reason {raw!r}")
    return kind


def parse_generate_response(body: Any) -> GenerateResult:
    """Validate and unpack a non-streaming ``/generate`` response for one prompt."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ProtocolError(f"/generate response without meta_info: {str(body)[:200]}")
    meta = body["meta_info"]
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise ProtocolError("/generate meta_info lacks output_token_logprobs (return_logprob)")
    try:
        logprobs = [float(e[0]) for e in entries]
        token_ids = [int(e[1]) for e in entries]
    except (TypeError, ValueError, IndexError) as exc:
        raise ProtocolError(f"malformed output_token_logprobs entry: {exc}") from exc
    output_ids = body.get("output_ids")
    if output_ids is not None and list(output_ids) != token_ids:
        raise ProtocolError(f"output_ids ({len(output_ids)} tokens) disagree with "
                            f"output_token_logprobs ({len(token_ids)} tokens)")
    completion = meta.get("completion_tokens")
    if completion is not None and int(completion) != len(token_ids):
        raise ProtocolError(f"completion_tokens={completion} but {len(token_ids)} logprobs")
    latency = meta.get("e2e_latency")
    return GenerateResult(rid=str(meta.get("id", "")), token_ids=token_ids, logprobs=logprobs,
                          finish_reason=_finish_type(meta.get("finish_reason")),
                          e2e_latency_s=float(latency) if latency is not None else None,
                          weight_version=meta.get("weight_version"),
                          routed_experts=meta.get("routed_experts"),
                          token_versions=_token_versions(meta.get("weight_versions"), len(token_ids)),
                          cached_tokens=_count_or_none(meta.get("cached_tokens"), "cached_tokens"))


def _count_or_none(value: Any, key: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError(f"meta_info.{key}={value!r} is not a count of tokens")
    return value


def _token_versions(spans: Any, num_tokens: int) -> Optional[List[str]]:
    """One version per output token from SGLang's ``weight_versions`` spans
    (``srt/utils/weight_versions.py: add_weight_versions_to_meta_info``): ``[{version, start,
    end}]`` tiling ``0 .. completion_tokens`` in order (one empty span when there are none)."""
    if spans is None:
        return None
    out: List[str] = []
    well_formed = isinstance(spans, list) and bool(spans)
    for span in spans if well_formed else ():
        if not (isinstance(span, dict) and isinstance(span.get("version"), str)
                and isinstance(span.get("start"), int) and isinstance(span.get("end"), int)
                and span["start"] == len(out) and span["end"] >= span["start"]):
            well_formed = False
            break
        out.extend([span["version"]] * (span["end"] - span["start"]))
    if not well_formed or len(out) != num_tokens:
        raise ProtocolError(f"meta_info.weight_versions {str(spans)[:200]} does not tile the "
                            f"{num_tokens} output tokens")
    return out


def generate_response(rid: str, prompt_len: int, token_ids: List[int], logprobs: List[float],
                      finish_reason: Dict[str, Any], e2e_latency: float, text: str,
                      weight_version: Optional[str],
                      routed_experts: Optional[str] = None) -> Dict[str, Any]:
    """A ``/generate`` response body in SGLang's schema (used by the reference server), with
    every field the real server's ``meta_info`` has for a non-streaming request with log-probs
    (``tokenizer_manager``: nothing cached, one DP rank, one weight version for all tokens);
    ``routed_experts``: the base64 routing, set only when asked for and captured."""
    n = len(token_ids)
    body = {"text": text, "output_ids": list(token_ids),
            "meta_info": {"id": rid, "finish_reason": finish_reason, "prompt_tokens": prompt_len,
                          "weight_version": weight_version, "num_retractions": 0,
                          "input_token_logprobs": [],
                          "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, token_ids)],
                          "output_token_logprobs_length": n, "reasoning_tokens": 0,
                          "completion_tokens": n, "cached_tokens": 0,
                          "weight_versions": [{"version": weight_version, "start": 0, "end": n}],
                          "cached_tokens_details": None, "dp_rank": 0,
                          "e2e_latency": e2e_latency, "response_sent_to_client_ts": time.time()}}
    if routed_experts is not None:
        body["meta_info"]["routed_experts"] = routed_experts
    return body


# ---- control bodies (io_struct request types; only fields we set, the rest take defaults) ---

def pause_payload(mode: str = "abort") -> Dict[str, Any]:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return {"mode": mode}


def abort_payload(rid: Optional[str] = None, abort_all: bool = False) -> Dict[str, Any]:
    if not abort_all and not rid:
        raise ValueError("abort_payload needs a request id or abort_all=True")
    return {"abort_all": True} if abort_all else {"rid": rid}


def memory_payload(tags: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """``/release_memory_occupation`` / ``/resume_memory_occupation`` body; None: every tag."""
    if tags is None:
        return {}
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; SGLang knows {list(MEMORY_TAGS)}")
    return {"tags": list(tags)}


def init_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl") -> Dict[str, Any]:
    return {"master_address": master_address, "master_port": int(master_port),
            "rank_offset": int(rank_offset), "world_size": int(world_size),
            "group_name": group_name, "backend": backend}


def update_distributed_payload(names: List[str], dtypes: List[str], shapes: List[List[int]],
                               group_name: str = DEFAULT_GROUP_NAME, flush_cache: bool = False,
                               weight_version: Optional[str] = None,
                               load_format: Optional[str] = FLATTENED_BUCKET) -> Dict[str, Any]:
    """One bucket's metadata. ``flush_cache`` is False: the protocol flushes once, after
    ``/end_weight_update`` (a flush per bucket would be refused while anything runs)."""
    body: Dict[str, Any] = {"names": list(names), "dtypes": list(dtypes),
                            "shapes": [list(s) for s in shapes], "group_name": group_name,
                            "flush_cache": flush_cache, "load_format": load_format}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def update_tensor_payload(serialized: List[str], flush_cache: bool = False,
                          weight_version: Optional[str] = None) -> Dict[str, Any]:
    """``serialized``: one base64 blob per server TP rank (each rank opens only its own)."""
    body: Dict[str, Any] = {"serialized_named_tensors": list(serialized), "load_format": None,
                            "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def update_disk_payload(model_path: str, flush_cache: bool = False,
                        weight_version: Optional[str] = None) -> Dict[str, Any]:
    body: Dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def check_success(endpoint: str, body: Any) -> str:
    """Raise unless an admin response says ``success: true``; returns its message."""
    if not isinstance(body, dict) or "success" not in body:
        raise ProtocolError(f"{endpoint}: response without 'success': {str(body)[:200]}")
    if not body["success"]:
        raise RuntimeError(f"{endpoint} failed: {body.get('message', '')}")
    return str(body.get("message", ""))


def error_message(body: Any) -> str:
    """The message of an SGLang error body: ``{"error": {"message"}}`` (_create_error_response),
    ``{"error": "..."}`` (the /generate contract gate), ``{"message"}`` (ErrorResponse) or text."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in body:
            return str(body["message"])
    return str(body)[:300]
