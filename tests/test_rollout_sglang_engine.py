"""Tests of the SGLang client engine against reference servers, including injected faults.

Every test checks the batch-level guarantee: each requested (prompt_id, sample_index) comes back
exactly once, and (per-sample seeds) with the same tokens as a fault-free embedded run.
"""

import sys
import threading
import time

import pytest
import torch

from gspo_megatron.distributed.ports import free_port
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.standin.server import FaultPlan, ReferenceServer
from gspo_megatron.rollout.sglang.engine import SampleFailed, SGLangEngine
from gspo_megatron.rollout.sglang.launcher import ServerLauncher
from gspo_megatron.rollout.standin.launcher import reference_server_command
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
    return [ReferenceServer(EmbeddedEngine(*policy), faults=f, enable_memory_saver=True).start()
            for f in faults]


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
        bodies = [b for s in servers for _, p, b in s.request_log if p == api.GENERATE]
        assert len(bodies) == 12 and all(s.request_log for s in servers)
        for b in bodies:
            assert set(b) == api.GENERATE_FIELDS - {"return_routed_experts"}  # R3 off
            assert set(b["sampling_params"]) <= api.SAMPLING_FIELDS
            assert b["return_logprob"] is True and isinstance(b["sampling_params"]["sampling_seed"], int)
        assert len({b["rid"] for b in bodies}) == 12
        assert eng.metrics.num_retries == 0 and eng.metrics.tokens_per_s > 0
        assert all(not s.sent_rids for s in eng.pool.servers)  # every answered id forgotten
        eng.flush_cache()
        eng.release_memory()
        with pytest.raises(RuntimeError, match="resume_memory"):
            eng.generate(batch, PARAMS)
        eng.resume_memory()
        for s in servers:
            assert [p for _, p, _ in s.request_log if p != api.GENERATE] == [
                api.FLUSH_CACHE, api.PAUSE, api.RELEASE_MEMORY, api.RESUME_MEMORY,
                api.FLUSH_CACHE, api.CONTINUE]
        _assert_same(eng.generate(batch, PARAMS), expected)
        assert eng.health()
    finally:
        eng.shutdown()
        for s in servers:
            s.stop()


def test_prompt_affinity_keeps_each_group_on_one_server_after_warming_its_prompt(policy, batch,
                                                                                 expected):
    servers = _servers(policy, FaultPlan(), FaultPlan())
    eng = SGLangEngine([s.address for s in servers], request_timeout_s=60, routing="prompt_affinity")
    try:
        samples = eng.generate(batch, PARAMS)
        _assert_same(samples, expected)  # per-sample seeds: the same samples whatever the routing
        homes = {}
        for s in samples:
            homes.setdefault(s.prompt_id, set()).update(s.served_by)
        assert all(len(h) == 1 for h in homes.values()), homes
        assert eng.warmup.num_prefills == len(batch)
        for srv in servers:
            rids = [b["rid"] for _, p, b in srv.request_log if p == api.GENERATE]
            for prompt in {r.split("/")[0] for r in rids}:
                assert {srv.address} == homes[prompt]
                ours = [r for r in rids if r.startswith(prompt + "/")]
                assert ours[0] == f"{prompt}/prefill" and len(ours) == 4, ours  # warm-up first
        assert eng.metrics.prefix_cache_hit == 0.0  # the reference server reports no cache
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


def test_wait_healthy_is_bounded():
    eng = SGLangEngine([f"127.0.0.1:{free_port()}"], request_timeout_s=1)
    with pytest.raises(TimeoutError, match="127.0.0.1"):
        eng.wait_healthy(timeout_s=1.0, poll_s=0.2)
    assert not eng.health()


def _slow_server(step_s=0.01) -> ReferenceServer:
    """A server whose model never emits EOS and takes ``step_s`` per decoding step."""
    model, tok = build_tiny_policy(seed=0)
    forward = model.forward
    model.forward = lambda *a, **k: (time.sleep(step_s), forward(*a, **k))[1]
    engine = EmbeddedEngine(model, tok, lean_decode=False)  # the HF forward, which is slowed
    engine._eos_ids = ()
    return ReferenceServer(engine).start()


def test_an_attempt_the_client_gives_up_on_is_aborted_on_its_server(policy):
    slow = _slow_server()
    eng = SGLangEngine([slow.address], request_timeout_s=0.5, max_retries=0)
    try:
        with pytest.raises(SampleFailed, match="timed out"):
            eng.generate([GenerationRequest("p", [3, 4])], SamplingParams(max_new_tokens=400, seed=1))
        aborts = [b for _, p, b in slow.request_log if p == api.ABORT]
        assert aborts == [{"rid": "p/0/0"}]  # SGLang would keep generating it otherwise
        deadline = time.monotonic() + 3
        while slow.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not slow.scheduler.running
    finally:
        slow.stop()


def test_a_server_on_stale_weights_leaves_the_rotation(policy, batch):
    current, stale = _servers(policy, FaultPlan(), FaultPlan())
    current.engine.weight_version = "v5"
    eng = SGLangEngine([current.address, stale.address], request_timeout_s=60)
    eng.control.weight_version = "v5"  # as after a sync that only `current` received
    try:
        samples = eng.generate(batch, PARAMS)
        assert {s.weight_version for s in samples} == {"v5"}
        assert eng.pool.dead == [stale.address]
        assert eng.pool.readmit_current("v5") == []  # still on 'default': it needs a sync
    finally:
        for s in (current, stale):
            s.stop()


@pytest.mark.slow
def test_server_killed_mid_batch_then_skipped_and_readmitted(tmp_path, policy, batch, expected):
    """SIGKILL of a server process mid-batch: every sample comes back exactly once (the same
    samples as without the fault); the next weight sync skips the dead server and reports it; a
    restarted server is used again only after the sync that re-admits it sends it the weights."""
    from gspo_megatron.weight_sync.disk import DiskTransport

    save_tiny_model(*build_tiny_policy(seed=0), str(tmp_path / "m"))
    port = free_port()
    launcher = ServerLauncher(str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"})
    command = reference_server_command(str(tmp_path / "m"), port, python=sys.executable)
    launcher.start(command + ["--delay-s", "0.4"], f"127.0.0.1:{port}")
    survivor = _servers(policy, FaultPlan(delay_s=0.1))[0]
    eng = SGLangEngine([launcher.addresses[0], survivor.address], request_timeout_s=60,
                       launcher=launcher)
    eng.attach_weight_transport(DiskTransport(str(tmp_path / "sync"), 1 << 20, servers=True))
    try:
        eng.wait_healthy(timeout_s=180)
        victim = launcher.servers[0].process
        threading.Timer(0.2, victim.kill).start()  # SIGKILL while its requests are in flight
        samples = eng.generate(batch, PARAMS)
        _assert_same(samples, expected)
        assert victim.wait(timeout=30) == -9 and eng.metrics.num_retries >= 1
        assert eng.pool.dead == [launcher.addresses[0]]
        # each sample says which server generated its tokens and why it was sent again
        for s in samples:
            assert sum(s.served_by.values()) == len(s.response_token_ids) and len(s.served_by) == 1
        resent = [s for s in samples if s.resent]
        assert resent and all(s.served_by == {survivor.address: len(s.response_token_ids)} for s in resent)
        assert all(launcher.addresses[0] in s.resent[0] for s in resent), [s.resent for s in resent]

        new, _ = build_tiny_policy(seed=11)
        stats = eng.update_weights(new.state_dict().items(), weight_version="w1")
        assert stats.phases["weight_sync/num_servers"] == 1.0
        assert stats.phases["weight_sync/num_skipped_servers"] == 1.0

        launcher.servers = []
        launcher.start(command, f"127.0.0.1:{port}")  # the server comes back, on old weights
        restarted = SGLangEngine([f"127.0.0.1:{port}"], request_timeout_s=60)
        restarted.wait_healthy(timeout_s=180)
        before = eng.generate(batch, PARAMS)
        assert eng.pool.dead == [launcher.addresses[0]]  # not re-admitted before a sync
        assert {s.weight_version for s in before} == {"w1"}
        stats = eng.update_weights(new.state_dict().items(), weight_version="w2")
        assert stats.phases["weight_sync/num_servers"] == 2.0 and eng.pool.dead == []
        after = eng.generate(batch, SamplingParams(temperature=0.9, max_new_tokens=8, seed=22))
        assert {s.weight_version for s in after} == {"w2"} and len(after) == 12
        assert restarted.clients[0].model_info()["weight_version"] == "w2"
    finally:
        eng.shutdown()
        survivor.stop()
    assert launcher.servers == []


def test_colocated_runs_refuse_attached_servers_without_the_memory_saver():
    """Checked at attach (SGLang would answer the first release with 200 and free nothing)."""
    from gspo_megatron.config.schema import SGLangConfig
    from gspo_megatron.rollout.sglang.engine import ServerSetupError

    plain = ReferenceServer(EmbeddedEngine(*build_tiny_policy(seed=0))).start()
    saver = ReferenceServer(EmbeddedEngine(*build_tiny_policy(seed=0)), enable_memory_saver=True).start()
    try:
        with pytest.raises(ServerSetupError, match=rf"{plain.address} runs without --enable-memory-saver"):
            SGLangEngine.from_config(SGLangConfig(server_addresses=[plain.address], health_timeout_s=30),
                                     enable_memory_saver=True)
        SGLangEngine.from_config(SGLangConfig(server_addresses=[plain.address], health_timeout_s=30),
                                 enable_memory_saver=False).shutdown()  # disaggregated: fine
        SGLangEngine.from_config(SGLangConfig(server_addresses=[saver.address], health_timeout_s=30),
                                 enable_memory_saver=True).shutdown()
    finally:
        plain.stop()
        saver.stop()


def test_routed_experts_come_with_every_sample_only_from_servers_that_capture_them(policy, batch):
    """R3 through the HTTP API: the request asks, a server started with the capture flag answers
    with the same routing the embedded engine records; one without it leaves the field out (as
    SGLang does), which is a clear error naming the server, not a retry."""
    from gspo_megatron.rollout.routed_experts import MalformedRouting, RoutingShape

    model, tok = policy
    shape = RoutingShape(model.config.num_hidden_layers, model.config.num_experts_per_tok,
                         model.config.num_experts)
    expected = EmbeddedEngine(model, tok, record_routing=True).generate(batch, PARAMS)
    capturing = ReferenceServer(EmbeddedEngine(model, tok, record_routing=True)).start()
    plain = ReferenceServer(EmbeddedEngine(model, tok)).start()
    engines = []
    try:
        eng = SGLangEngine([capturing.address], request_timeout_s=60)
        eng.routing_shape = shape
        engines.append(eng)
        samples = eng.generate(batch, PARAMS)
        _assert_same(samples, expected)
        for got, want in zip(samples, expected):
            assert torch.equal(got.routed_experts, want.routed_experts), got.key
        bodies = [b for _, p, b in capturing.request_log if p == api.GENERATE]
        assert all(b["return_routed_experts"] is True for b in bodies)
        eng = SGLangEngine([plain.address], request_timeout_s=60)
        eng.routing_shape = shape
        engines.append(eng)
        with pytest.raises(MalformedRouting, match=f"{plain.address}, request p0/\\d/0: the answer has "
                                                   "no meta_info.routed_experts.*--enable-return"):
            eng.generate(batch[:1], PARAMS)
    finally:
        for e in engines:
            e.shutdown()
        capturing.stop()
        plain.stop()


def test_a_worker_wedged_outside_any_network_call_ends_the_batch_within_its_deadline(policy, batch,
                                                                                     monkeypatch):
    """Issue 41: the wait for a batch's next sample has a deadline of its own. A worker stuck
    where no request timeout can fire (here: on a lock nobody releases) ends the batch with one
    error naming the pending samples and the servers, at the stall deadline, not never."""
    from gspo_megatron.rollout.sglang import engine as engine_module

    servers = _servers(policy, FaultPlan())
    eng = SGLangEngine([servers[0].address], request_timeout_s=0.5, max_retries=0)
    monkeypatch.setattr(engine_module, "HEALTH_PROBE_S", 0.1)
    assert eng.stall_timeout_s() == pytest.approx(1.2)  # (0 + 2) attempts x (0.5 s + 0.1 s)
    wedged, release = threading.Event(), threading.Event()

    def stuck(*args):
        wedged.set()
        release.wait(30)
        raise RuntimeError("released")

    monkeypatch.setattr(eng, "_run_sample", stuck)
    try:
        t0 = time.perf_counter()
        with pytest.raises(engine_module.RolloutStalled, match=rf"12 pending on \['{servers[0].address}'\]"):
            list(eng.generate_iter(batch, PARAMS))
        assert wedged.is_set() and 1.2 <= time.perf_counter() - t0 < 5
    finally:
        release.set()
        for s in servers:
            s.stop()
