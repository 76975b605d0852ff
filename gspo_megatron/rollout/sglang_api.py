"""The subset of SGLang's native HTTP API we use: request bodies and response parsing.

One place owns the field names, checked against sglang 0.5.23
(``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``,
``srt/sampling/sampling_params.py``); both the client (:mod:`rollout.sglang_engine`) and the
CPU stand-in (:mod:`rollout.reference_server`) import them, so they cannot drift apart.

Endpoints (all JSON):
- ``POST /generate`` ``{rid, input_ids, sampling_params, return_logprob, stream}`` ->
  ``{text?, output_ids, meta_info: {id, finish_reason, prompt_tokens, completion_tokens,
  output_token_logprobs: [[logprob, token_id, null], ...], e2e_latency, weight_version}}``
- ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size,
  group_name, backend}`` -> ``{success, message}``
- ``POST /update_weights_from_distributed`` ``{names, dtypes, shapes, group_name, flush_cache,
  weight_version, load_format}`` -> ``{success, message}``
- ``POST /destroy_weights_update_group`` ``{group_name}`` -> ``{success, message}``
- ``POST /update_weights_from_tensor`` ``{serialized_named_tensors, load_format, flush_cache,
  weight_version}`` -> ``{success, message}``
- ``POST /update_weights_from_disk`` ``{model_path, load_format, flush_cache, weight_version}``
  -> ``{success, message, num_paused_requests}``
- ``POST /flush_cache``; ``POST /release_memory_occupation`` / ``/resume_memory_occupation``
  ``{tags}``; ``GET /health``; ``GET /get_model_info``;
  ``POST /get_weights_by_name`` ``{name, truncate_size}`` -> first values of the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from gspo_megatron.rollout.types import SamplingParams

GENERATE = "/generate"
HEALTH = "/health"
MODEL_INFO = "/get_model_info"
FLUSH_CACHE = "/flush_cache"
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

GENERATE_FIELDS = frozenset({"rid", "input_ids", "sampling_params", "return_logprob", "stream"})
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "max_new_tokens", "stop", "stop_token_ids",
                             "sampling_seed", "no_stop_trim", "skip_special_tokens"})


class ProtocolError(RuntimeError):
    """A server answered with a body that does not follow the documented schema."""


def generate_payload(rid: str, prompt_token_ids: List[int], params: SamplingParams,
                     seed: Optional[int]) -> Dict[str, Any]:
    """The ``/generate`` body for one sample.

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
    return {"rid": rid, "input_ids": list(prompt_token_ids), "sampling_params": sampling,
            "return_logprob": True, "stream": False}


@dataclass
class GenerateResult:
    """The parts of a ``/generate`` response a :class:`Sample` needs."""

    rid: str
    token_ids: List[int]
    logprobs: List[float]
    finish_reason: str
    e2e_latency_s: Optional[float]
    weight_version: Optional[str]


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
                          weight_version=meta.get("weight_version"))


def generate_response(rid: str, prompt_len: int, token_ids: List[int], logprobs: List[float],
                      finish_reason: Dict[str, Any], e2e_latency: float, text: str,
                      weight_version: Optional[str]) -> Dict[str, Any]:
    """A ``/generate`` response body in SGLang's schema (used by the reference server)."""
    return {"text": text, "output_ids": list(token_ids),
            "meta_info": {"id": rid, "finish_reason": finish_reason, "prompt_tokens": prompt_len,
                          "completion_tokens": len(token_ids), "cached_tokens": 0,
                          "weight_version": weight_version, "e2e_latency": e2e_latency,
                          "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, token_ids)],
                          "output_token_logprobs_length": len(token_ids)}}


def init_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl") -> Dict[str, Any]:
    return {"master_address": master_address, "master_port": int(master_port),
            "rank_offset": int(rank_offset), "world_size": int(world_size),
            "group_name": group_name, "backend": backend}


def update_distributed_payload(names: List[str], dtypes: List[str], shapes: List[List[int]],
                               group_name: str = DEFAULT_GROUP_NAME, flush_cache: bool = True,
                               weight_version: Optional[str] = None,
                               load_format: Optional[str] = FLATTENED_BUCKET) -> Dict[str, Any]:
    body: Dict[str, Any] = {"names": list(names), "dtypes": list(dtypes),
                            "shapes": [list(s) for s in shapes], "group_name": group_name,
                            "flush_cache": flush_cache, "load_format": load_format}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def update_disk_payload(model_path: str, flush_cache: bool = True,
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
