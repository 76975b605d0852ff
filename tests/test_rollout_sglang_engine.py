"""Tests of the SGLang client engine against reference servers, including injected faults.

Every test checks the batch-level guarantee: each requested (prompt_id, sample_index) comes back
exactly once, and (per-sample seeds) with the same tokens as a fault-free embedded run.
"""

import socket
import sys
import time

import pytest
import torch

from gspo_megatron.rollout import sglang_api as api
from gspo_megatron.rollout.embedded import EmbeddedEngine
from gspo_megatron.rollout.reference_server import FaultPlan, ReferenceServer
from gspo_megatron.rollout.sglang_engine import SampleFailed, SGLangEngine
from gspo_megatron.rollout.sglang_launcher import ServerLauncher, reference_server_command
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams

PARAMS = SamplingParams(temperature=0.9, max_new_tokens=8, seed=21)


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return build_tiny_policy(seed=0)


@pytest.fixture(scope="module")
def batch(policy):
    _, tok = policy
    reqs = [GenerationRequest(f"p{i}", tok(t)["input_ids"], n=3)
            for i, t in enumerate(["1+1=", "what is 7?", "hi", "2+3="])]
    return reqs


@pytest.fixture(scope="module")
def expected(policy, batch):
    return EmbeddedEngine(*policy).generate(batch, PARAMS)


def _servers(policy, *faults):
    return [ReferenceServer(EmbeddedEngine(*policy), faults=f).start() for f in faults]


def _assert_same(samples, expected):
    assert [s.key for s in samples] == [e.key for e in expected]
    for s, e in zip(samples, expected):
        assert s.response_token_ids == e.response_token_ids, s.key
        assert s.response_logprobs == pytest.approx(e.response_logprobs, abs=1e-5)
        assert s.finish_reason == e.finish_reason


def test_client_sends_documented_fields_and_spreads_load(policy, batch, expected):
    servers = _servers(policy, FaultPlan(), FaultPlan())
    eng = SGLangEngine([s.address for s in servers], request_timeout_s=60)
    try:
        _assert_same(eng.generate(batch, PARAMS), expected)
        bodies = [b for s in servers for p, b in s.request_log if p == api.GENERATE]
        assert len(bodies) == 12 and all(len([p for p, _ in s.request_log]) > 0 for s in servers)
        for b in bodies:
            assert set(b) == api.GENERATE_FIELDS
            assert set(b["sampling_params"]) <= api.SAMPLING_FIELDS
            assert b["return_logprob"] is True and isinstance(b["sampling_params"]["sampling_seed"], int)
        assert len({b["rid"] for b in bodies}) == 12
        assert eng.metrics.num_retries == 0 and eng.metrics.tokens_per_s > 0
        eng.flush_cache()
        eng.release_memory()
        eng.resume_memory()
        paths = [p for s in servers for p, _ in s.request_log]
        for path in (api.FLUSH_CACHE, api.RELEASE_MEMORY, api.RESUME_MEMORY):
            assert paths.count(path) == 2
        assert eng.health()
    finally:
        eng.shutdown()
        for s in servers:
            s.stop()


def test_http_errors_are_retried_on_another_server(policy, batch, expected):
    servers = _servers(policy, FaultPlan(fail_requests=frozenset({1, 3, 4})), FaultPlan())
    eng = SGLangEngine([s.address for s in servers], request_timeout_s=60)
    try:
        _assert_same(eng.generate(batch, PARAMS), expected)
        assert eng.metrics.num_retries == 3
    finally:
        for s in servers:
            s.stop()


def test_timeouts_and_slow_server(policy, batch, expected):
    hang = FaultPlan(hang_requests=frozenset({1, 2}), hang_s=4.0)
    slow = FaultPlan(delay_s=0.2)
    servers = _servers(policy, hang, slow)
    eng = SGLangEngine([s.address for s in servers], request_timeout_s=1.5)
    try:
        streamed = list(eng.generate_iter(batch, PARAMS))
        assert sorted(s.key for s in streamed) == [e.key for e in expected]
        assert eng._num_retries >= 2  # both hung requests timed out and were retried
        _assert_same(eng.generate(batch, PARAMS), expected)
    finally:
        for s in servers:
            s.stop()


def test_results_stream_as_they_finish(policy, batch):
    servers = _servers(policy, FaultPlan(delay_s=2.0), FaultPlan())
    eng = SGLangEngine([s.address for s in servers], request_timeout_s=60)
    try:
        start = time.perf_counter()
        arrivals = [time.perf_counter() - start for _ in eng.generate_iter(batch, PARAMS)]
        assert len(arrivals) == 12
        assert arrivals[-1] >= 2.0 and arrivals[0] < arrivals[-1] - 1.0
    finally:
        for s in servers:
            s.stop()


def test_exhausted_retries_name_the_sample(policy, batch):
    servers = _servers(policy, FaultPlan(fail_requests=frozenset(range(1, 100))))
    eng = SGLangEngine([servers[0].address], request_timeout_s=30, max_retries=2)
    try:
        with pytest.raises(SampleFailed, match="prompt_id='p0'"):
            eng.generate(batch[:1], PARAMS)
    finally:
        servers[0].stop()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wait_healthy_is_bounded():
    eng = SGLangEngine([f"127.0.0.1:{_free_port()}"], request_timeout_s=1)
    with pytest.raises(TimeoutError, match="127.0.0.1"):
        eng.wait_healthy(timeout_s=1.0, poll_s=0.2)
    assert not eng.health()


@pytest.mark.slow
def test_server_killed_mid_batch(tmp_path, policy, batch, expected):
    """A server process that dies on its 3rd request: its samples finish on the survivor."""
    save_tiny_model(*build_tiny_policy(seed=0), tmp_path / "m")
    port = _free_port()
    launcher = ServerLauncher(str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"})
    launcher.start(reference_server_command(str(tmp_path / "m"), port,
                                            extra=["--exit-on-request", "3"],
                                            python=sys.executable), f"127.0.0.1:{port}")
    survivor = _servers(policy, FaultPlan())[0]
    eng = SGLangEngine([launcher.addresses[0], survivor.address], request_timeout_s=60,
                       launcher=launcher)
    try:
        eng.wait_healthy(timeout_s=180)
        samples = eng.generate(batch, PARAMS)
        _assert_same(samples, expected)
        assert launcher.servers[0].process.wait(timeout=30) == 17
        assert eng.metrics.num_retries >= 1
        assert not eng.health()
        _assert_same(eng.generate(batch, PARAMS), expected)  # dead server stays out of rotation
    finally:
        eng.shutdown()
        survivor.stop()
    assert launcher.servers == []
