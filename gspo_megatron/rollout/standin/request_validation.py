"""Validation of ``/generate`` bodies by the reference server, in SGLang 0.5.23's order and words.

1. The JSON contract (``api/v1/api_types.py``, checked by ``http_server.generate_request``):
   ``sampling_params`` rejects unknown keys with serde's text (``unknown field `x`, expected one
   of ...``) and values of the wrong JSON type (``invalid type: string "a", expected f64``); the
   answer is HTTP 400 ``{"error": "<text>"}``.
2. Fields SGLang knows that the stand-in does not implement, and top-level fields SGLang would
   silently ignore, are refused (stricter; a typo such as ``return_logprobs`` would otherwise
   lose the log-probs without a word).
3. The tokenizer manager's checks (``_validate_one_request``): the prompt must be shorter than
   the context length, and prompt + ``max_new_tokens`` must fit in it (SGLang's messages);
   ``SamplingParams.verify``'s ranges. Token ids outside ``[0, vocab)`` are refused (stricter:
   SGLang indexes out of range, which kills the CPU server; docs/rollout.md). These answer
   ``{"error": {"message": ...}}``.
4. Greedy: SGLang reads a temperature below ``1e-6`` as temperature 1 with ``top_k = 1``
   (``srt/sampling/sampling_params.py``): the most likely token, reported with the log-prob
   ``log_softmax(logits)`` gives it. The stand-in has no ``top_k``; a ``top_p`` below any
   token's probability keeps exactly that token (the top token is always kept), so greedy maps
   to temperature 1 and ``top_p = GREEDY_TOP_P``, with the same log-probs.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.types import SamplingParams


SAMPLING_EPS = 1e-6
"""SGLang's ``_SAMPLING_EPS``: a temperature below it means greedy."""
GREEDY_TOP_P = 1e-12
"""Below the smallest token probability of any vocabulary under ~1e12 tokens (p_max >= 1/V)."""


class ContractError(ValueError):
    """A body SGLang's JSON contract gate refuses (``{"error": text}``)."""


class RequestError(ValueError):
    """A body the tokenizer manager refuses (``{"error": {"message": text}}``)."""


def _unexpected(v: Any) -> str:
    """serde's description of a JSON value (api_types._unexpected)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _check(ok: bool, v: Any, expected: str) -> None:
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_JSON_TYPES = {  # api_types.decode_SamplingParams, for the keys the stand-in implements
    "max_new_tokens": (_is_int, "i64"), "temperature": (lambda v: _is_int(v) or isinstance(v, float), "f64"),
    "top_p": (lambda v: _is_int(v) or isinstance(v, float), "f64"), "sampling_seed": (_is_int, "i64"),
    "no_stop_trim": (lambda v: isinstance(v, bool), "a boolean"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "a boolean")}


def check_sampling_contract(sp: Any) -> Dict[str, Any]:
    """Step 1 for ``sampling_params``; returns the dict."""
    if sp is None:
        return {}
    _check(isinstance(sp, dict), sp, "struct SamplingParams")
    for key, value in sp.items():
        if key not in api.SGLANG_SAMPLING_FIELDS:
            raise ContractError(api.unknown_field_message(key, api.SGLANG_SAMPLING_FIELDS))
        if value is None or key not in _JSON_TYPES:
            continue
        ok, expected = _JSON_TYPES[key]
        _check(ok(value), value, expected)
    for key in ("stop",):
        v = sp.get(key)
        if v is not None and not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))):
            raise ContractError(f"invalid type: {_unexpected(v)}, expected a value or an array of "
                                "values for StringOrList")
    v = sp.get("stop_token_ids")
    if v is not None:
        _check(isinstance(v, list), v, "a sequence")
        for t in v:
            _check(_is_int(t), t, "i64")
    return sp


def parse_generate(body: Any, vocab_size: int, context_length: int
                   ) -> Tuple[str, list, SamplingParams, Optional[int], bool, bool, bool]:
    """(rid, input_ids, params, seed, return_logprob, return_routed_experts, prefill_only), or
    ContractError / RequestError. ``prefill_only``: ``max_new_tokens`` 0, which SGLang accepts
    (``sampling_params.verify``: at least 0) and answers with no output tokens after caching
    the prompt (its parallel sampling's warm-up); ``params`` then holds 1."""
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: {_unexpected(body)}, expected struct GenerateRequest")
    sp = check_sampling_contract(body.get("sampling_params"))
    unknown = sorted(set(body) - api.GENERATE_FIELDS)
    if unknown:
        raise RequestError(f"/generate fields {unknown} are not implemented by the reference server "
                           "(SGLang ignores fields outside its schema; this server refuses them)")
    unsupported = sorted(set(sp) - api.SAMPLING_FIELDS)
    if unsupported:
        raise RequestError(f"sampling_params {unsupported} are not implemented by the reference server")
    if body.get("stream"):
        raise RequestError("stream=true is not implemented by the reference server")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
        raise RequestError("input_ids must be a non-empty list of token ids")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"input_ids contains out-of-vocabulary token id {bad}; valid range is "
                           f"[0, {vocab_size}).")
    if len(ids) >= context_length:
        raise RequestError(f"The input ({len(ids)} tokens) is longer than the model's context "
                           f"length ({context_length} tokens).")
    max_new = sp.get("max_new_tokens", 128)
    max_new = 128 if max_new is None else max_new
    if max_new < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
    if max_new + len(ids) > context_length:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_length} "
            f"tokens. You requested a total of {max_new + len(ids)} tokens: {len(ids)} tokens from "
            f"the input messages and {max_new} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit.")
    stop = sp.get("stop") or ()
    temperature = float(sp.get("temperature", 1.0))
    top_p = float(sp.get("top_p", 1.0))
    if 0 <= temperature < SAMPLING_EPS:  # greedy (see 4. above)
        temperature, top_p = 1.0, GREEDY_TOP_P
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max(int(max_new), 1),
                                stop=(stop,) if isinstance(stop, str) else tuple(stop),
                                stop_token_ids=tuple(sp.get("stop_token_ids") or ()))
    except ValueError as exc:
        raise RequestError(str(exc)) from exc
    seed = sp.get("sampling_seed")
    return (str(body.get("rid") or ""), ids, params, seed,
            bool(body.get("return_logprob")), bool(body.get("return_routed_experts")), max_new == 0)
