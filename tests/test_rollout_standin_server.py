"""Tests of the reference rollout server: SGLang 0.5.23's schema, refusals and state rules.

Every rule checked here is SGLang's (or stricter where SGLang would misbehave silently): the
/generate JSON contract, the context-length cap, out-of-vocabulary ids, cancellation by abort or
client disconnect, a /health_generate that generates, pause / continue, flush refused while
requests run, the weight-update session, and colocated memory release.
"""

import os
import threading
import time

import pytest
import requests
import torch

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.standin.server import FLUSHED, FaultPlan, ReferenceServer, main
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams, sample_seed
from gspo_megatron.weight_sync.buckets import Bucket
from gspo_megatron.weight_sync.tensor_ipc import bucket_views, serialize_named_tensors


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return build_tiny_policy(seed=0)


def _slow_server(policy, step_s=0.01, **kwargs) -> ReferenceServer:
    """A server whose model never emits EOS and takes ``step_s`` per decoding step."""
    model, tok = build_tiny_policy(seed=0)
    forward = model.forward

    def slow_forward(*a, **k):
        time.sleep(step_s)
        return forward(*a, **k)

    model.forward = slow_forward
    engine = EmbeddedEngine(model, tok, lean_decode=False)  # the HF forward, which is slowed
    engine._eos_ids = ()
    return ReferenceServer(engine, **kwargs).start()


@pytest.fixture
def server(policy):
    srv = ReferenceServer(EmbeddedEngine(*policy), enable_memory_saver=True,
                          health_timeout_s=1.0).start()
    yield srv
    srv.stop()


def _post(srv, path, body, timeout=30):
    return requests.post(f"http://{srv.address}{path}", json=body, timeout=timeout)


def _gen(srv, max_new_tokens=4, rid="r", timeout=30, **extra):
    body = api.generate_payload(rid, [3, 4, 5], SamplingParams(max_new_tokens=max_new_tokens), 1)
    body.update(extra)
    return _post(srv, api.GENERATE, body, timeout)


def _in_thread(fn, *args, **kwargs):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn(*args, **kwargs)), daemon=True)
    t.start()
    return t, out


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_generate_answers_in_sglang_schema_and_matches_embedded(server, policy):
    model, tok = policy
    prompt = tok("2+2=")["input_ids"]
    params = SamplingParams(temperature=0.8, max_new_tokens=7)
    resp = _post(server, api.GENERATE, api.generate_payload("rid-1", prompt, params, sample_seed(5, "p", 0)))
    assert resp.status_code == 200
    body = resp.json()
    meta = body["meta_info"]
    assert set(body) == {"text", "output_ids", "meta_info"} and meta["id"] == "rid-1"
    assert meta["completion_tokens"] == len(body["output_ids"]) == len(meta["output_token_logprobs"])
    assert meta["weight_version"] == "default" and body["text"] == tok.decode(body["output_ids"])
    parsed = api.parse_generate_response(body)
    ref = EmbeddedEngine(model, tok).generate([GenerationRequest("p", prompt)],
                                               SamplingParams(temperature=0.8, max_new_tokens=7, seed=5))[0]
    assert parsed.token_ids == ref.response_token_ids
    assert parsed.logprobs == pytest.approx(ref.response_logprobs, abs=1e-5)
    plain = _gen(server, return_logprob=False).json()["meta_info"]
    assert "output_token_logprobs" not in plain  # SGLang returns them only when asked


def test_greedy_is_sglangs_argmax_with_its_log_softmax(server, policy):
    """``temperature: 0`` (below SGLang's 1e-6): the argmax token each step, reported with
    ``log_softmax(logits)``, as the real server answers (the differential test compares them)."""
    from gspo_megatron.rollout.embedded.engine import teacher_forced_logprobs

    model, tok = policy
    prompt = tok("abc")["input_ids"]
    body = api.generate_payload("g", prompt, SamplingParams(max_new_tokens=6), None)
    body["sampling_params"]["temperature"] = 0
    parsed = api.parse_generate_response(_post(server, api.GENERATE, body).json())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + parsed.token_ids])).logits[0]
        ref = teacher_forced_logprobs(model, prompt, parsed.token_ids, 1.0)
    assert parsed.token_ids == logits[len(prompt) - 1:-1].argmax(-1).tolist()
    assert parsed.logprobs == pytest.approx(ref.tolist(), abs=1e-5)


def test_generate_json_contract_and_unsupported_fields(server):
    bad = _gen(server, sampling_params={"max_new_tokens": 2, "min_pp": 0.1})
    expected = api.unknown_field_message("min_pp", api.SGLANG_SAMPLING_FIELDS)
    assert bad.status_code == 400 and bad.json() == {"error": expected}
    typed = _gen(server, sampling_params={"temperature": "hot"})
    assert typed.json() == {"error": 'invalid type: string "hot", expected f64'}
    assert _gen(server, sampling_params={"max_new_tokens": 1.5}).json() == \
        {"error": "invalid type: floating point `1.5`, expected i64"}
    min_p = _gen(server, sampling_params={"min_p": 0.1})  # SGLang knows it; the stand-in does not
    assert min_p.status_code == 400 and "min_p" in min_p.json()["error"]["message"]
    typo = _gen(server, return_logprobs=True)  # SGLang would silently ignore the typo
    assert typo.status_code == 400 and "return_logprobs" in typo.json()["error"]["message"]
    assert _post(server, api.GENERATE, {"input_ids": [], "sampling_params": {}}).status_code == 400


def test_token_ids_and_context_length_are_checked(server):
    for bad_id in (45, -1, 10 ** 9):
        r = _post(server, api.GENERATE, {"input_ids": [3, bad_id], "sampling_params": {}})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (f"input_ids contains out-of-vocabulary token id "
                                                f"{bad_id}; valid range is [0, 45).")
    huge = _post(server, api.GENERATE, {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 10 ** 9}})
    assert huge.status_code == 400 and huge.json()["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 512 tokens. "
        "You requested a total of 1000000002 tokens")
    long_prompt = _post(server, api.GENERATE, {"input_ids": [3] * 512, "sampling_params": {}})
    assert long_prompt.json()["error"]["message"] == (
        "The input (512 tokens) is longer than the model's context length (512 tokens).")
    assert _gen(server).status_code == 200  # the refusals did not wedge anything


def test_max_new_tokens_zero_prefills_only_and_negative_is_refused_as_sglang_does(server):
    """SGLang 0.5.23 answers ``max_new_tokens`` 0 with no tokens (its parallel sampling's
    warm-up; our prompt_affinity routing sends it) and refuses a negative count; both answers
    as the real server gave them (tests/test_rollout_sglang_real_server.py)."""
    r = _post(server, api.GENERATE, api.prefill_payload("warm", [3, 4, 5]))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == [] and body["meta_info"]["finish_reason"] == {"type": "length",
                                                                               "length": 0}
    assert body["meta_info"]["completion_tokens"] == 0 and "output_token_logprobs" not in body["meta_info"]
    r = _post(server, api.GENERATE, {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": -1}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "max_new_tokens must be at least 0, got -1."
    assert _gen(server).status_code == 200


def test_client_disconnect_cancels_the_request(policy):
    srv = _slow_server(policy)
    try:
        body = api.generate_payload("gone", [3, 4], SamplingParams(max_new_tokens=500), 1)
        with pytest.raises(requests.ReadTimeout):
            _post(srv, api.GENERATE, body, timeout=0.5)  # ~5 s of work: the client gives up
        _wait(lambda: not srv.scheduler.running, timeout=3.0)
        assert _gen(srv, max_new_tokens=2).status_code == 200
    finally:
        srv.stop()


def test_a_process_with_over_1024_open_descriptors_is_still_served(policy):
    """The handler checks for a gone client on every step; ``select.select`` refused any
    descriptor >= 1024, so in a long test session (fresh clone 6: some earlier test had opened
    that many) every request to the stand-in failed with 'Remote end closed connection'."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the server's socket above
    srv = _slow_server(policy)
    try:
        with pytest.raises(requests.ReadTimeout):  # and a client that gives up is still seen
            _post(srv, api.GENERATE, api.generate_payload(
                "gone", [3, 4], SamplingParams(max_new_tokens=500), 1), timeout=0.5)
        _wait(lambda: not srv.scheduler.running, timeout=3.0)
        assert _gen(srv, max_new_tokens=2).status_code == 200
    finally:
        srv.stop()
        for fd in held:
            os.close(fd)


def test_health_generate_generates_and_is_unhealthy_while_paused(server):
    before = server.scheduler.last_progress
    assert requests.get(f"http://{server.address}{api.HEALTH_GENERATE}", timeout=10).status_code == 200
    assert server.scheduler.last_progress > before  # a token was really generated
    assert requests.get(f"http://{server.address}{api.HEALTH}", timeout=10).status_code == 200
    assert _post(server, api.PAUSE, {}).json()["status"] == "ok"
    start = time.monotonic()
    assert requests.get(f"http://{server.address}{api.HEALTH_GENERATE}", timeout=10).status_code == 503
    assert time.monotonic() - start >= 0.9  # it waited for the health timeout (1 s here)
    _post(server, api.CONTINUE, {})
    assert requests.get(f"http://{server.address}{api.HEALTH_GENERATE}", timeout=10).status_code == 200


def test_a_paused_server_stops_at_once_with_a_health_check_waiting_at_its_gate(policy):
    """Stopping turns away what waits at the pause gate: a health check held there (up to its
    timeout, 30 s here) kept its connection's thread, which the stop joins (15 s per stopped
    paused server in the control tests before)."""
    srv = ReferenceServer(EmbeddedEngine(*policy), health_timeout_s=30.0).start()
    try:
        assert _post(srv, api.PAUSE, {}).json()["status"] == "ok"
        t, out = _in_thread(requests.get, f"http://{srv.address}{api.HEALTH_GENERATE}", timeout=60)
        _wait(lambda: len(srv.httpd._connections) >= 1)
        time.sleep(0.3)  # the check is at the gate (nothing else answers it while paused)
        assert "r" not in out
    finally:
        start = time.monotonic()
        srv.stop()
        stop_s = time.monotonic() - start
    t.join(10)
    assert stop_s < 5.0 and not t.is_alive()
    assert srv.scheduler.stopped


def test_pause_aborts_running_requests_and_gates_new_ones(policy):
    srv = _slow_server(policy)
    try:
        t, out = _in_thread(_gen, srv, 400, "long")
        _wait(lambda: "long" in srv.scheduler.running)
        flush = _post(srv, api.FLUSH_CACHE, None)
        assert flush.status_code == 400 and flush.text == "Flush cache failed.\n"
        assert _post(srv, api.PAUSE, {"mode": "retract"}).status_code == 400  # not emulated
        assert _post(srv, api.PAUSE, {"mode": "abort"}).json() == {
            "message": "Generation paused successfully.", "status": "ok"}
        t.join(10)
        meta = out["r"].json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 400
        t2, out2 = _in_thread(_gen, srv, 2, "waits")
        time.sleep(0.5)
        assert "r" not in out2  # held at the gate while paused
        assert _post(srv, api.FLUSH_CACHE, None).text == FLUSHED
        assert _post(srv, api.CONTINUE, {}).json()["status"] == "ok"
        t2.join(10)
        assert out2["r"].status_code == 200
    finally:
        srv.stop()


def test_abort_request_by_id(policy):
    srv = _slow_server(policy)
    try:
        t, out = _in_thread(_gen, srv, 400, "victim")
        _wait(lambda: "victim" in srv.scheduler.running)
        r = _post(srv, api.ABORT, {"rid": "victim"})
        assert r.status_code == 200 and r.text == ""
        t.join(10)
        assert out["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert _post(srv, api.ABORT, {"rid": "unknown"}).status_code == 200  # ignored, as SGLang
    finally:
        srv.stop()


def _tensor_body(policy_seed=3, flush_cache=False, version=None):
    new, _ = build_tiny_policy(seed=policy_seed)
    flat, views = bucket_views(Bucket.from_items(list(new.state_dict().items())))
    return new, flat, api.update_tensor_payload([serialize_named_tensors(views)], flush_cache, version)


def test_weight_update_session_rules_and_stale_cache(server):
    assert _gen(server).status_code == 200  # the prefix cache now holds KV
    new, flat, body = _tensor_body(version="v1")
    outside = _post(server, api.UPDATE_FROM_TENSOR, body)
    assert outside.status_code == 400 and outside.json() == {
        "success": False, "message": "update_weights_from_tensor must run between "
                                     "begin_weight_update() and end_weight_update()"}
    assert _post(server, api.END_UPDATE, {}).json()["message"] == \
        "no weight-update session is open; call begin_weight_update() first"
    assert _post(server, api.BEGIN_UPDATE, {}).json() == {"success": True, "message": "Success"}
    assert _post(server, api.BEGIN_UPDATE, {}).json()["message"] == \
        "a weight-update session is already open; call end_weight_update() first"
    assert _post(server, api.UPDATE_FROM_TENSOR, body).json()["success"] is True
    assert "session is open" in _gen(server).json()["error"]["message"]
    assert _post(server, api.END_UPDATE, {}).json()["success"] is True
    stale = _gen(server)
    assert stale.status_code == 400 and "/flush_cache after updating" in stale.json()["error"]["message"]
    assert _post(server, api.FLUSH_CACHE, None).status_code == 200
    fresh = _gen(server)
    assert fresh.status_code == 200 and fresh.json()["meta_info"]["weight_version"] == "v1"
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    got = _post(server, api.GET_WEIGHTS_BY_NAME, {"name": name, "truncate_size": 10 ** 6}).json()
    assert torch.equal(torch.tensor(got), new.state_dict()[name].reshape(-1))
    missing = _post(server, api.UPDATE_FROM_DISTRIBUTED, {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]})
    assert missing.status_code == 400 and "must run between" in missing.json()["message"]
    assert _post(server, api.BEGIN_UPDATE, {}).json()["success"] is True
    gate = new.state_dict()["model.layers.1.mlp.gate.weight"]
    unknown = _post(server, api.UPDATE_FROM_TENSOR, api.update_tensor_payload(
        [serialize_named_tensors([("model.layers.9.mlp.gate.weight", gate)])]))
    assert unknown.status_code == 400 and unknown.json()["success"] is False  # SGLang drops it
    assert "'model.layers.9.mlp.gate.weight' is not a parameter" in unknown.json()["message"]
    assert _post(server, api.END_UPDATE, {}).json()["success"] is True


def test_update_from_disk_needs_no_session(server, tmp_path):
    new, _ = build_tiny_policy(seed=3)
    new.save_pretrained(str(tmp_path / "w"))
    r = _post(server, api.UPDATE_FROM_DISK, api.update_disk_payload(str(tmp_path / "w"), True, "v7"))
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["num_paused_requests"] == 0
    assert _gen(server).json()["meta_info"]["weight_version"] == "v7"
    missing = _post(server, api.UPDATE_FROM_DISK, {"model_path": str(tmp_path / "none")})
    assert missing.status_code == 400 and "safetensors" in missing.json()["message"]


def test_memory_release_rules(policy):
    plain = ReferenceServer(EmbeddedEngine(*policy)).start()
    try:  # without --enable-memory-saver SGLang would answer 200 and free nothing
        r = _post(plain, api.RELEASE_MEMORY, {})
        assert r.status_code == 400 and "--enable-memory-saver" in r.json()["error"]["message"]
    finally:
        plain.stop()
    srv = _slow_server(policy, enable_memory_saver=True)
    try:
        t, _ = _in_thread(_gen, srv, 300, "busy")
        _wait(lambda: "busy" in srv.scheduler.running)
        busy = _post(srv, api.RELEASE_MEMORY, {})
        assert busy.json() == {"error": {"message": "release_memory_occupation should be called only "
                                                    "when server is idle."}}
        _post(srv, api.PAUSE, {})
        t.join(10)
        assert _post(srv, api.RELEASE_MEMORY, {}).status_code == 200
        _post(srv, api.CONTINUE, {})
        assert "memory is released" in _gen(srv).json()["error"]["message"]
        _, _, body = _tensor_body()
        _post(srv, api.BEGIN_UPDATE, {})
        assert "weights memory is released" in _post(srv, api.UPDATE_FROM_TENSOR, body).json()["message"]
        _post(srv, api.END_UPDATE, {})
        assert _post(srv, api.RESUME_MEMORY, {"tags": ["weights"]}).status_code == 200
        again = _post(srv, api.RESUME_MEMORY, {"tags": ["weights"]})
        assert again.status_code == 400 and "not released" in again.json()["error"]["message"]
        assert _post(srv, api.RESUME_MEMORY, {"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
        assert _gen(srv, max_new_tokens=2).status_code == 200
    finally:
        srv.stop()


def test_routes_methods_and_info(server):
    base = f"http://{server.address}"
    assert requests.get(base + api.MODEL_INFO, timeout=10).json()["is_generation"] is True
    assert requests.get(base + api.MODEL_INFO_DEPRECATED, timeout=10).status_code == 200
    assert requests.get(base + api.SERVER_INFO, timeout=10).json()["version"] == "0.5.23"
    assert requests.get(base + api.PAUSE, timeout=10).status_code == 405
    assert _post(server, "/no_such_endpoint", {}).status_code == 404
    assert [(m, p) for m, p, _ in server.request_log[-2:]] == [("GET", api.PAUSE),
                                                               ("POST", "/no_such_endpoint")]


def test_injected_failures_count_requests_in_arrival_order(policy):
    srv = ReferenceServer(EmbeddedEngine(*policy), faults=FaultPlan(fail_requests=frozenset({2}))).start()
    try:
        assert [_gen(srv).status_code for _ in range(3)] == [200, 500, 200]
    finally:
        srv.stop()


def test_cli_requires_model_path(capsys):
    with pytest.raises(SystemExit):
        main(["--port", "1"])
    assert "--model-path" in capsys.readouterr().err

