"""Tests of the reference rollout server: SGLang's HTTP schema on the embedded engine."""

import pytest
import requests
import torch

from gspo_megatron.rollout import sglang_api as api
from gspo_megatron.rollout.embedded import EmbeddedEngine
from gspo_megatron.rollout.reference_server import FaultPlan, ReferenceServer, main
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams, sample_seed


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return build_tiny_policy(seed=0)


@pytest.fixture
def server(policy):
    srv = ReferenceServer(EmbeddedEngine(*policy)).start()
    yield srv
    srv.stop()


def _post(srv, path, body, timeout=30):
    return requests.post(f"http://{srv.address}{path}", json=body, timeout=timeout)


def test_generate_answers_in_sglang_schema_and_matches_embedded(server, policy):
    model, tok = policy
    prompt = tok("2+2=")["input_ids"]
    params = SamplingParams(temperature=0.8, max_new_tokens=7)
    seed = sample_seed(5, "p", 0)
    resp = _post(server, api.GENERATE, api.generate_payload("rid-1", prompt, params, seed))
    assert resp.status_code == 200
    body = resp.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "rid-1" and meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(body["output_ids"]) == len(meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert body["text"] == tok.decode(body["output_ids"])
    parsed = api.parse_generate_response(body)
    ref = EmbeddedEngine(model, tok).generate([GenerationRequest("p", prompt)],
                                               SamplingParams(temperature=0.8, max_new_tokens=7, seed=5))[0]
    assert parsed.token_ids == ref.response_token_ids
    assert parsed.logprobs == pytest.approx(ref.response_logprobs, abs=1e-5)


def test_generate_refuses_fields_outside_the_subset(server):
    bad = _post(server, api.GENERATE, {"input_ids": [3], "sampling_params": {}, "top_logprobs_num": 2})
    assert bad.status_code == 400 and "top_logprobs_num" in bad.json()["error"]["message"]
    bad = _post(server, api.GENERATE, {"input_ids": [3], "sampling_params": {"min_p": 0.1}})
    assert bad.status_code == 400 and "min_p" in bad.json()["error"]["message"]
    bad = _post(server, api.GENERATE, {"input_ids": [], "sampling_params": {}})
    assert bad.status_code == 400


def test_admin_endpoints(server, tmp_path):
    base = f"http://{server.address}"
    assert requests.get(base + api.HEALTH, timeout=10).status_code == 200
    assert requests.get(base + api.MODEL_INFO, timeout=10).json()["is_generation"] is True
    assert requests.post(base + api.FLUSH_CACHE, timeout=10).status_code == 200
    assert requests.post(base + api.RELEASE_MEMORY, json={}, timeout=10).status_code == 200
    assert requests.post(base + api.RESUME_MEMORY, json={}, timeout=10).status_code == 200
    tensor = _post(server, api.UPDATE_FROM_TENSOR, {"serialized_named_tensors": ["x"]})
    assert tensor.status_code == 400 and tensor.json()["success"] is False
    upd = _post(server, api.UPDATE_FROM_DISTRIBUTED, {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]})
    assert upd.status_code == 400 and "init_weights_update_group" in upd.json()["message"]
    missing = _post(server, api.UPDATE_FROM_DISK, {"model_path": str(tmp_path / "none")})
    assert missing.status_code == 400 and "safetensors" in missing.json()["message"]
    assert _post(server, "/no_such_endpoint", {}).status_code == 404


def test_update_weights_from_disk_and_version(server, tmp_path):
    new, _ = build_tiny_policy(seed=3)
    new.save_pretrained(str(tmp_path / "w"))
    r = _post(server, api.UPDATE_FROM_DISK, api.update_disk_payload(str(tmp_path / "w"), weight_version="v7"))
    assert r.status_code == 200 and r.json()["success"] is True
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    got = _post(server, api.GET_WEIGHTS_BY_NAME, {"name": name, "truncate_size": 10 ** 6}).json()
    assert torch.equal(torch.tensor(got, dtype=torch.float32), new.state_dict()[name].reshape(-1))
    gen = _post(server, api.GENERATE, api.generate_payload("r", [3, 4], SamplingParams(max_new_tokens=2), 1))
    assert gen.json()["meta_info"]["weight_version"] == "v7"


def test_injected_failures_count_requests_in_arrival_order(policy):
    srv = ReferenceServer(EmbeddedEngine(*policy), faults=FaultPlan(fail_requests=frozenset({2}))).start()
    try:
        body = api.generate_payload("r", [3, 4], SamplingParams(max_new_tokens=2), 1)
        codes = [_post(srv, api.GENERATE, body).status_code for _ in range(3)]
        assert codes == [200, 500, 200]
    finally:
        srv.stop()


def test_cli_requires_model_path(capsys):
    with pytest.raises(SystemExit):
        main(["--port", "1"])
    assert "--model-path" in capsys.readouterr().err
