"""Tests of SGLang request bodies and response parsing (rollout/sglang/api.py).

Field names are checked against sglang 0.5.23's io_struct.GenerateReqInput,
sampling_params.SamplingParams and the tokenizer manager's meta_info.
"""

import pytest

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.types import SamplingParams


def test_generate_payload_has_exactly_the_documented_fields():
    body = api.generate_payload("r1", [5, 6], SamplingParams(temperature=0.6, top_p=0.8,
                                max_new_tokens=9, stop=("##",), stop_token_ids=(2,)), seed=42)
    assert set(body) == api.GENERATE_FIELDS - {"return_routed_experts"}
    r3 = api.generate_payload("r1", [5, 6], SamplingParams(), seed=42, return_routed_experts=True)
    assert set(r3) == api.GENERATE_FIELDS and r3["return_routed_experts"] is True
    assert body["input_ids"] == [5, 6] and body["return_logprob"] is True and body["stream"] is False
    assert body["sampling_params"] == {"temperature": 0.6, "top_p": 0.8, "max_new_tokens": 9,
                                       "stop": ["##"], "stop_token_ids": [2], "sampling_seed": 42,
                                       "no_stop_trim": True, "skip_special_tokens": False}
    bare = api.generate_payload("r2", [1], SamplingParams(), seed=None)["sampling_params"]
    assert "stop" not in bare and "sampling_seed" not in bare and set(bare) <= api.SAMPLING_FIELDS


def _response(**meta):
    base = {"id": "r1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
            "completion_tokens": 2, "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None]],
            "e2e_latency": 0.1, "weight_version": "v3"}
    base.update(meta)
    return {"text": "ab", "output_ids": [7, 8], "meta_info": base}


def test_parse_generate_response():
    r = api.parse_generate_response(_response())
    assert (r.token_ids, r.logprobs, r.finish_reason, r.weight_version) == ([7, 8], [-0.5, -1.25], "length", "v3")
    assert api.parse_generate_response(_response(finish_reason={"type": "stop", "matched": 8})).finish_reason == "stop"
    assert r.cached_tokens is None  # absent: unknown, not 0
    assert api.parse_generate_response(_response(cached_tokens=2)).cached_tokens == 2


def test_prefill_payload_generates_nothing():
    body = api.prefill_payload("p/prefill", [5, 6, 7])
    assert body == {"rid": "p/prefill", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0},
                    "stream": False}
    assert set(body) <= api.GENERATE_FIELDS and set(body["sampling_params"]) <= api.SAMPLING_FIELDS


@pytest.mark.parametrize("body,match", [
    ({"text": "x"}, "meta_info"),
    (_response(output_token_logprobs=None), "output_token_logprobs"),
    (_response(output_token_logprobs=[[-0.5]]), "malformed"),
    (_response(completion_tokens=5), "completion_tokens"),
    (_response(finish_reason=None), "null"),
    (_response(finish_reason={"type": "weird"}), "unknown finish_reason"),
    ({**_response(), "output_ids": [7, 9]}, "disagree"),
    (_response(cached_tokens=-1), "cached_tokens=-1"),
    (_response(cached_tokens="3"), "cached_tokens='3'"),
])
def test_parse_rejects_bodies_outside_the_schema(body, match):
    with pytest.raises(api.ProtocolError, match=match):
        api.parse_generate_response(body)


def test_weight_update_payloads():
    assert api.init_group_payload("10.0.0.1", 29500, 1, 3) == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
        "group_name": "weight_update_group", "backend": "nccl"}
    body = api.update_distributed_payload(["a"], ["bfloat16"], [(2, 3)], weight_version="7")
    assert body == {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, 3]],
                    "group_name": "weight_update_group", "flush_cache": False,
                    "load_format": "flattened_bucket", "weight_version": "7"}
    assert api.update_disk_payload("/d") == {"model_path": "/d", "flush_cache": False}
    assert api.update_tensor_payload(["b1", "b2"], weight_version="3") == {
        "serialized_named_tensors": ["b1", "b2"], "load_format": None, "flush_cache": False,
        "weight_version": "3"}
    assert api.check_success("/x", {"success": True, "message": "ok"}) == "ok"
    with pytest.raises(RuntimeError, match="nope"):
        api.check_success("/x", {"success": False, "message": "nope"})
    with pytest.raises(api.ProtocolError):
        api.check_success("/x", ["?"])


def test_control_payloads_and_their_checks():
    assert api.pause_payload() == {"mode": "abort"}
    with pytest.raises(ValueError, match="pause mode"):
        api.pause_payload("later")
    assert api.abort_payload("r7") == {"rid": "r7"} and api.abort_payload(abort_all=True) == {"abort_all": True}
    with pytest.raises(ValueError, match="request id"):
        api.abort_payload()
    assert api.memory_payload() == {} and api.memory_payload(["weights"]) == {"tags": ["weights"]}
    with pytest.raises(ValueError, match="unknown memory tags"):
        api.memory_payload(["gpu"])


def test_sglang_messages():
    assert api.unknown_field_message("x", []) == "unknown field `x`, there are no fields"
    assert api.unknown_field_message("x", ["a"]) == "unknown field `x`, expected `a`"
    assert api.unknown_field_message("x", ["a", "b"]) == "unknown field `x`, expected `a` or `b`"
    assert api.unknown_field_message("x", ["a", "b", "c"]) == \
        "unknown field `x`, expected one of `a`, `b`, `c`"
    assert api.error_message({"error": {"message": "m1"}}) == "m1"
    assert api.error_message({"error": "m2"}) == "m2"
    assert api.error_message({"object": "error", "message": "m3"}) == "m3"
    assert api.error_message("Flush cache failed.\n") == "Flush cache failed.\n"
    err = api.ServerRefused("h:1", "/begin_weight_update", "already open")
    assert (err.server, err.endpoint, err.message) == ("h:1", "/begin_weight_update", "already open")
    assert "h:1" in str(err) and "/begin_weight_update" in str(err) and "already open" in str(err)
