"""The weight-sync and memory protocol (rollout/sglang/control.py) against the strict stand-in.

The full protocol runs in SGLang's order (checked call by call on every server), colocated
(release -> resume weights -> tensor-handle update -> resume the rest) and disaggregated; and
dropping or reordering a step makes the update or the next generation fail, as it would on
SGLang 0.5.23 (see the reference server's rules).
"""

import threading
import time

import pytest
import requests
import torch

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine, teacher_forced_logprobs
from gspo_megatron.rollout.standin.server import ReferenceServer
from gspo_megatron.rollout.sglang.client import SGLangServerClient
from gspo_megatron.rollout.sglang.control import FleetControl
from gspo_megatron.rollout.sglang.engine import SampleFailed, SGLangEngine
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.weight_sync.sync import BucketFailed
from gspo_megatron.weight_sync.tensor_ipc import CudaIpcTransport

PARAMS = SamplingParams(max_new_tokens=5, seed=3, temperature=0.9)
CONTROL = {api.PAUSE, api.ABORT, api.BEGIN_UPDATE, api.END_UPDATE, api.FLUSH_CACHE, api.CONTINUE,
           api.RELEASE_MEMORY, api.RESUME_MEMORY, api.UPDATE_FROM_TENSOR}


@pytest.fixture(scope="module")
def new_policy():
    torch.set_num_threads(1)
    return build_tiny_policy(seed=6)


def _slow_engine():
    model, tok = build_tiny_policy(seed=0)
    forward = model.forward
    model.forward = lambda *a, **k: (time.sleep(0.01), forward(*a, **k))[1]
    engine = EmbeddedEngine(model, tok, lean_decode=False)  # the HF forward, which is slowed
    engine._eos_ids = ()  # generations run to max_new_tokens
    return engine


@pytest.fixture
def fleet():
    servers = [ReferenceServer(_slow_engine(), enable_memory_saver=True, update_idle_timeout_s=1.0).start()
               for _ in range(2)]
    eng = SGLangEngine([s.address for s in servers], request_timeout_s=20, max_retries=0)
    eng.attach_weight_transport(CudaIpcTransport(eng, bucket_bytes=96 * 1024))
    yield eng, servers
    eng.shutdown()
    for s in servers:
        s.stop()


def _requests(tok):
    return [GenerationRequest(f"p{i}", tok(t)["input_ids"], n=2) for i, t in enumerate(["1+2=", "hi"])]


def _calls(server, start=0):
    return [p for _, p, _ in server.request_log[start:] if p in CONTROL]


def _update(eng, policy, version):
    return eng.update_weights(((n, t.clone()) for n, t in policy.state_dict().items()), version)


def _compress(calls):
    """Runs of the same bucket call collapsed: [..., tensor x N, ...] -> [..., tensor, ...]."""
    return [c for i, c in enumerate(calls) if i == 0 or c != calls[i - 1] or c != api.UPDATE_FROM_TENSOR]


def _orphan(server, max_new_tokens=300):
    """A long request on ``server`` that the engine never sent (another client's)."""
    body = api.generate_payload("orphan", [3, 4], SamplingParams(max_new_tokens=max_new_tokens), 1)
    t = threading.Thread(target=lambda: requests.post(f"http://{server.address}{api.GENERATE}",
                                                      json=body, timeout=60), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while "orphan" not in server.scheduler.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return t


def test_colocated_cycle_in_sglang_order(fleet, new_policy):
    eng, servers = fleet
    new, tok = new_policy
    eng.generate(_requests(tok), PARAMS)
    eng.pool.servers[0].sent_rids.add("p9/0/0")  # an attempt the client gave up on
    marks = [len(s.request_log) for s in servers]
    eng.release_memory()
    stats = _update(eng, new, "c1")
    eng.resume_memory()
    samples = eng.generate(_requests(tok), PARAMS)
    expected = [api.PAUSE, api.RELEASE_MEMORY, api.PAUSE, api.RESUME_MEMORY, api.BEGIN_UPDATE,
                api.UPDATE_FROM_TENSOR, api.END_UPDATE, api.RESUME_MEMORY, api.FLUSH_CACHE, api.CONTINUE]
    assert _compress(_calls(servers[1], marks[1])) == expected
    first = _calls(servers[0], marks[0])
    assert _compress(first) == expected[:1] + [api.ABORT] + expected[1:]
    assert [b for _, p, b in servers[0].request_log if p == api.ABORT] == [{"rid": "p9/0/0"}]
    resumes = [b for _, p, b in servers[1].request_log[marks[1]:] if p == api.RESUME_MEMORY]
    assert resumes == [{"tags": ["weights"]}, {"tags": ["cuda_graph", "kv_cache"]}]
    assert stats.num_buckets > 1 and first.count(api.UPDATE_FROM_TENSOR) == stats.num_buckets
    for key in ("pause", "resume", "begin", "end", "transfer"):  # phase times in the metrics
        assert stats.as_metrics()[f"weight_sync/{key}_s"] >= 0
    for s in samples:
        assert s.weight_version == "c1"
        ref = teacher_forced_logprobs(new, s.prompt_token_ids, s.response_token_ids, 0.9)
        assert torch.allclose(torch.tensor(s.response_logprobs), ref, atol=1e-5)


def test_disaggregated_update_in_sglang_order(fleet, new_policy):
    eng, servers = fleet
    new, tok = new_policy
    eng.generate(_requests(tok), PARAMS)
    mark = len(servers[0].request_log)
    _update(eng, new, "d1")
    assert _compress(_calls(servers[0], mark)) == [api.PAUSE, api.BEGIN_UPDATE, api.UPDATE_FROM_TENSOR,
                                                   api.END_UPDATE, api.FLUSH_CACHE, api.CONTINUE]
    assert {s.weight_version for s in eng.generate(_requests(tok), PARAMS)} == {"d1"}


def _skip(monkeypatch, method):
    monkeypatch.setattr(SGLangServerClient, method, lambda self, *a, **k: None)


def test_without_pause_a_running_request_blocks_the_update(fleet, new_policy, monkeypatch):
    eng, servers = fleet
    _orphan(servers[0])
    _skip(monkeypatch, "pause_generation")
    with pytest.raises(BucketFailed, match="bucket 1 .*requests still running") as err:
        _update(eng, new_policy[0], "x")
    assert isinstance(err.value.reason, api.ServerRefused)


def test_without_begin_the_buckets_are_refused(fleet, new_policy, monkeypatch):
    eng, servers = fleet
    _skip(monkeypatch, "begin_weight_update")
    with pytest.raises(BucketFailed, match=r"weight update x: bucket 1 \(") as failed:
        _update(eng, new_policy[0], "x")
    err = failed.value.reason
    assert isinstance(err, api.ServerRefused)
    assert err.endpoint == api.UPDATE_FROM_TENSOR and err.server in [s.address for s in servers]
    assert "must run between begin_weight_update() and end_weight_update()" in str(failed.value)
    monkeypatch.undo()  # the failed update was cancelled on the servers: a full one works
    _update(eng, new_policy[0], "y")
    assert {s.weight_version for s in eng.generate(_requests(new_policy[1]), PARAMS)} == {"y"}


def test_reordered_end_before_buckets_is_refused(fleet, new_policy, monkeypatch):
    eng, _ = fleet
    begin = FleetControl.begin

    def begin_then_end(self, session=True):
        members = begin(self, session)
        for s in self.pool.members:
            s.client.end_weight_update()
        return members

    monkeypatch.setattr(FleetControl, "begin", begin_then_end)
    with pytest.raises(BucketFailed, match="must run between"):
        _update(eng, new_policy[0], "x")


def test_without_end_generation_and_the_next_update_are_refused(fleet, new_policy, monkeypatch):
    eng, _ = fleet
    _skip(monkeypatch, "end_weight_update")
    _update(eng, new_policy[0], "x")
    with pytest.raises(api.ServerRefused, match="session is open"):
        eng.generate(_requests(new_policy[1]), PARAMS)
    with pytest.raises(api.ServerRefused, match="already open"):
        _update(eng, new_policy[0], "x2")


def test_without_flush_the_stale_prefix_cache_is_refused(fleet, new_policy, monkeypatch):
    eng, _ = fleet
    eng.generate(_requests(new_policy[1]), PARAMS)
    _skip(monkeypatch, "flush_cache")
    _update(eng, new_policy[0], "x")
    with pytest.raises(api.ServerRefused, match="flush_cache after updating"):
        eng.generate(_requests(new_policy[1]), PARAMS)


def test_without_continue_generation_waits_at_the_gate(fleet, new_policy, monkeypatch):
    eng, _ = fleet
    for s in eng.pool.servers:
        s.client.timeout_s = 1.5
    _skip(monkeypatch, "continue_generation")
    _update(eng, new_policy[0], "x")
    with pytest.raises(SampleFailed, match="timed out"):
        eng.generate(_requests(new_policy[1]), PARAMS)


def test_release_needs_the_pause_and_the_update_needs_the_weights_back(fleet, new_policy, monkeypatch):
    eng, servers = fleet
    _orphan(servers[0])
    with monkeypatch.context() as m:
        m.setattr(SGLangServerClient, "pause_generation", lambda self, *a, **k: None)
        with pytest.raises(api.ServerRefused, match="only when server is idle"):
            eng.release_memory()
    eng.release_memory()  # paused: the orphan is aborted, the servers are idle
    monkeypatch.setattr(SGLangServerClient, "resume_memory", lambda self, *a, **k: None)
    with pytest.raises(BucketFailed, match="weights memory is released"):
        _update(eng, new_policy[0], "x")


def test_flush_is_retried_while_refused_then_fails_naming_the_server():
    """SGLang answers /flush_cache with 400 while anything runs or waits; the update retries
    until ``flush_timeout_s`` (slime: 60 s), then fails naming the server. A key error is not
    retried."""
    from gspo_megatron.rollout.sglang.server_pool import ServerPool
    from gspo_megatron.rollout.sglang.client import ServerAuthError

    class Busy(SGLangServerClient):
        """Refuses the first ``refusals`` flushes as SGLang does while requests run."""

        def __init__(self, refusals, error=None):
            super().__init__("127.0.0.1:1", keys=None)
            self.refusals, self.error, self.calls = refusals, error, 0

        def flush_cache(self):
            self.calls += 1
            if self.error is not None:
                raise self.error
            if self.calls <= self.refusals:
                raise api.ServerRefused(self.address, api.FLUSH_CACHE, "HTTP 400: Flush cache failed.")

    busy = Busy(refusals=3)
    control = FleetControl(ServerPool([busy]), flush_timeout_s=5.0, flush_retry_s=0.01)
    control._flush(control.pool.servers[0])
    assert busy.calls == 4
    stuck = Busy(refusals=10 ** 6)
    control = FleetControl(ServerPool([stuck]), flush_timeout_s=0.2, flush_retry_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(api.ServerRefused, match=r"127.0.0.1:1 refused /flush_cache.*still refused after 0.2s"):
        control._flush(control.pool.servers[0])
    assert 0.2 <= time.monotonic() - t0 < 2 and stuck.calls > 3
    denied = Busy(0, ServerAuthError("127.0.0.1:1", api.FLUSH_CACHE, 401, True))
    control = FleetControl(ServerPool([denied]), flush_timeout_s=5.0, flush_retry_s=0.01)
    with pytest.raises(ServerAuthError):
        control._flush(control.pool.servers[0])
    assert denied.calls == 1


def test_cancel_closes_the_session_flushes_and_continues_each_call_within_its_deadline():
    """After a failed update: end the session, flush (buckets that arrived changed the weights
    the prefix cache was computed with), continue; every call bounded by ``cancel_timeout_s``,
    and a server that cannot answer (blocked inside a broadcast) does not stop the others'."""
    from gspo_megatron.rollout.sglang.server_pool import ServerPool
    from gspo_megatron.rollout.sglang.client import ServerUnavailable

    class Recording(SGLangServerClient):
        def __init__(self, port, blocked=False):
            super().__init__(f"127.0.0.1:{port}", keys=None)
            self.blocked, self.calls = blocked, []

        def _call(self, name, timeout_s):
            self.calls.append((name, timeout_s))
            if self.blocked:
                raise ServerUnavailable(f"{self.address}: timed out", timed_out=True)

        def end_weight_update(self, timeout_s=None):
            self._call("end", timeout_s)

        def flush_cache(self, timeout_s=None):
            self._call("flush", timeout_s)

        def continue_generation(self, timeout_s=None):
            self._call("continue", timeout_s)

    stuck, fine = Recording(1, blocked=True), Recording(2)
    control = FleetControl(ServerPool([stuck, fine]))
    control.cancel_timeout_s = 7.0
    control._session, control.paused = True, True
    control.cancel()
    for client in (stuck, fine):
        assert client.calls == [("end", 7.0), ("flush", 7.0), ("continue", 7.0)]
    assert not control._session and not control.paused
    control.released = {"kv_cache"}  # colocated, KV cache released: nothing to flush
    fine.calls.clear()
    control.cancel()
    assert fine.calls == [("continue", 7.0)]
