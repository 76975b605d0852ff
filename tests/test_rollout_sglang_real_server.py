"""Our rollout engine and weight sync against the real SGLang 0.5.23 server on CPU.

One real server per module (``tests/real_sglang.py``: its own virtualenv, the CPU engine, our
CPU ``sgl_kernel``), on the free-text tiny Qwen3-MoE (2 layers, 4 experts top-2, fp32), and
spare ones for the tests that wedge or kill a server (``spare_server``: each starts while the
tests before it run, and the wedged one, resumed, serves the kill test). The test that kills
the only server of its fleet ends the module's own server, after every test that needs it. What is checked here is
what the stand-in could only assume:

* generation: n samples, max_new_tokens, stop token ids, pause (abort) / continue; the prompt
  warm-up of ``prompt_affinity`` routing fills the radix cache for a group's samples;
* the engine's log-probs equal a teacher-forced recomputation of the same weights at temperature
  1 and 0.7 (SGLang scales logits by the temperature before its log-softmax, as our learner does);
* a weight update through every transport this machine runs (disk, tensor handles in shared
  memory, a gloo broadcast group with flattened buckets), each checked by a probe: the log-probs
  of fixed sequences on the server equal the new weights' own (``get_weights_by_name`` answers
  400 for Qwen3-MoE on the real server);
* payloads the server cannot take (a wrong shape kills it, an unknown name is silently ignored)
  are refused by our client before they are sent, and the server lives on;
* a trainer that died inside a weight update (paused server, open session, its broadcast group
  still registered) is followed by a new one that recovers the server and updates it;
* partial rollouts: samples cut by weight updates mid-generation continue under each new
  version, every token's log-prob that of the version the server's spans name.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from gspo_megatron.config.schema import WeightSyncConfig
from gspo_megatron.rollout.embedded.engine import teacher_forced_logprobs
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import SGLangServerClient
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model
from gspo_megatron.weight_sync import build_transport
from gspo_megatron.weight_sync.server_model import PayloadMismatch
from tests.ahead import Command
from tests.real_sglang import RealServer, SpareServers, no_later_test_uses

pytestmark = pytest.mark.slow

PROMPTS = ["1+2=", "hello", "abc"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("real_sglang") / "model"
    save_tiny_model(*build_tiny_policy(seed=0), out)
    return out


@pytest.fixture(scope="module")
def spares(request, model_dir):
    """The servers of this module's ``spare_server`` tests and of a ``server_to_kill`` test that
    cannot have the module's own (as many as this run collected)."""
    items = [item for item in request.session.items if item.module is request.module]
    wanted = sum("spare_server" in item.fixturenames or ("server_to_kill" in item.fixturenames and
                 not no_later_test_uses(request.session.items, item, "server")) for item in items)
    pool = SpareServers(str(model_dir), model_dir.parent, wanted)
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def server(model_dir, spares):
    srv = RealServer(str(model_dir), model_dir.parent / "server.log").start()
    spares.launch_ahead()  # starts while the tests of this server run
    yield srv
    srv.stop()
    assert not srv.alive()


@pytest.fixture
def spare_server(spares):
    """A real server of the test's own, to wedge or kill: a live one is given back after it."""
    srv = spares.take()
    yield srv
    spares.give_back(srv)


@pytest.fixture
def server_to_kill(request, spares):
    """A real server the test ends: the module's own when no later test needs it (issue 41 item
    8: one ~30 CPU-second start fewer; its teardown finds it stopped), else a spare."""
    if no_later_test_uses(request.session.items, request.node, "server"):
        yield request.getfixturevalue("server")
        return
    srv = spares.take()
    yield srv
    spares.give_back(srv)


@pytest.fixture
def engine(server):
    assert server.alive(), server.log_tail()
    eng = SGLangEngine([server.address], request_timeout_s=120, health_timeout_s=60)
    eng.wait_healthy()
    eng.check_versions()
    yield eng
    eng.shutdown()
    assert server.alive(), f"the server died during the test:\n{server.log_tail()}"


def _requests(tok, n=2):
    return [GenerationRequest(f"p{i}", tok(t)["input_ids"], n=n) for i, t in enumerate(PROMPTS)]


def _assert_logprobs_match(samples, model, temperature, atol=2e-5):
    worst = 0.0
    for s in samples:
        ref = teacher_forced_logprobs(model, s.prompt_token_ids, s.response_token_ids, temperature)
        got = torch.tensor(s.response_logprobs)
        assert got.shape == ref.shape, (s.prompt_id, s.sample_index)
        worst = max(worst, float((got - ref).abs().max()))
    assert worst < atol, f"engine vs recomputed log-prob gap {worst:.3g} at T={temperature}"
    return worst


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_recomputation_at_any_temperature(engine, temperature):
    model, tok = build_tiny_policy(seed=0)
    samples = engine.generate(_requests(tok, n=3),
                              SamplingParams(temperature=temperature, max_new_tokens=12, seed=1))
    assert [(s.prompt_id, s.sample_index) for s in samples] == \
        [(f"p{i}", j) for i in range(len(PROMPTS)) for j in range(3)]
    assert all(0 < len(s.response_token_ids) <= 12 for s in samples)
    assert all(len(s.response_logprobs) == len(s.response_token_ids) for s in samples)
    with torch.no_grad():
        _assert_logprobs_match(samples, model, temperature)


def test_max_new_tokens_and_stop_token_ids(engine):
    """Sampling seeds are not honoured without --enable-deterministic-inference, so the stop id
    is one the random tiny policy draws often: ~1 in 45 per token, 24 x 16 tokens (P(no hit)
    ~ 2e-4)."""
    _, tok = build_tiny_policy(seed=0)
    free = engine.generate(_requests(tok, n=8), SamplingParams(max_new_tokens=16, seed=2))
    assert all(s.finish_reason == "length" and len(s.response_token_ids) == 16 for s in free
               if tok.eos_token_id not in s.response_token_ids)
    counts = {}
    for s in free:
        for t in s.response_token_ids:
            counts[t] = counts.get(t, 0) + 1
    stop_id = max((t for t in counts if t != tok.eos_token_id), key=counts.get)
    stopped = engine.generate(_requests(tok, n=8), SamplingParams(max_new_tokens=16, seed=2,
                                                                   stop_token_ids=(stop_id,)))
    assert any(stop_id in s.response_token_ids for s in stopped), "no sample drew the stop id"
    for s in stopped:
        if stop_id in s.response_token_ids:  # kept in the response (no_stop_trim), and last
            assert s.response_token_ids.index(stop_id) == len(s.response_token_ids) - 1
            assert s.finish_reason == "stop"
        elif tok.eos_token_id not in s.response_token_ids:
            assert s.finish_reason == "length" and len(s.response_token_ids) == 16


def test_prompt_affinity_warms_each_prompt_so_every_sample_finds_it_cached(server):
    """The real server's own account (``meta_info.cached_tokens``): with ``prompt_affinity``
    each prompt is prefilled once (``max_new_tokens`` 0, answered with no tokens) and every
    sample then finds all of it but its last token in the radix cache, although SGLang's
    ``fcfs`` schedule would prefill samples arriving together each in full."""
    SGLangServerClient(server.address, timeout_s=60, control_timeout_s=60).flush_cache()
    eng = SGLangEngine([server.address], request_timeout_s=120, routing="prompt_affinity")
    prompts = [[3 + (7 * i + k) % 40 for i in range(96)] for k in range(2)]
    try:
        samples = eng.generate([GenerationRequest(f"w{k}", p, n=6) for k, p in enumerate(prompts)],
                               SamplingParams(max_new_tokens=4, seed=3))
    finally:
        eng.shutdown()
    assert eng.warmup.num_prefills == 2
    assert {s.prompt_cache for s in samples} == {(95, 96)}, [s.prompt_cache for s in samples]
    assert eng.metrics.prefix_cache_hit == 95 / 96


def test_pause_aborts_running_requests_and_continue_resumes(engine, server):
    client = SGLangServerClient(server.address, timeout_s=60, control_timeout_s=60)
    _, tok = build_tiny_policy(seed=0)

    result = {}

    def long_request():
        body = api.generate_payload("long", tok("abc")["input_ids"],
                                    SamplingParams(max_new_tokens=400), None)
        body["sampling_params"]["ignore_eos"] = True
        result["r"] = client.generate(body)

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.5)
    client.pause_generation("abort")
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert result["r"].finish_reason == "abort"
    client.continue_generation()
    samples = engine.generate(_requests(tok, n=1), SamplingParams(max_new_tokens=4, seed=3))
    assert all(s.finish_reason in ("stop", "length") for s in samples)


def _probe(engine, model, tok):
    """Generated samples' log-probs on the server equal ``model``'s own (the weights arrived)."""
    samples = engine.generate(_requests(tok, n=2), SamplingParams(max_new_tokens=8, seed=7))
    with torch.no_grad():
        return _assert_logprobs_match(samples, model, 1.0)


@pytest.mark.parametrize("transport", ["disk", "tensor", "nccl"])
def test_weight_update_reaches_the_server(engine, transport, tmp_path, model_dir):
    cfg = WeightSyncConfig(transport=transport, bucket_bytes=48 * 1024,
                           disk_dir=str(tmp_path / "sync"))
    build_transport(cfg, engine, "sglang", mode="disaggregated", master_address="127.0.0.1",
                    config_dir=str(model_dir))
    original, tok = build_tiny_policy(seed=0)
    try:
        for version, seed in ((f"{transport}-1", 11), (f"{transport}-2", 12)):
            new, _ = build_tiny_policy(seed=seed)
            stats = engine.update_weights(((n, t.clone()) for n, t in new.state_dict().items()),
                                          version)
            assert stats.num_tensors == len(new.state_dict())
            _probe(engine, new, tok)
            assert all(s.weight_version == version for s in engine.generate(
                _requests(tok, n=1), SamplingParams(max_new_tokens=2, seed=1)))
    finally:  # the next test expects the original weights
        engine.update_weights(((n, t.clone()) for n, t in original.state_dict().items()), "orig")
    _probe(engine, original, tok)


@pytest.mark.parametrize("transport", ["tensor", "nccl"])
def test_payloads_the_server_cannot_take_are_refused_before_sending(engine, server, transport):
    build_transport(WeightSyncConfig(transport=transport, bucket_bytes=48 * 1024), engine,
                    "sglang", mode="disaggregated", master_address="127.0.0.1")
    model, tok = build_tiny_policy(seed=0)
    state = dict(model.state_dict())
    wrong_shape = dict(state, **{"lm_head.weight": state["lm_head.weight"][:, :-1].clone()})
    with pytest.raises(PayloadMismatch, match=r"lm_head.weight.*shape"):
        engine.update_weights(iter(wrong_shape.items()), "bad-shape")
    unknown = dict(state, **{"model.layers.9.mlp.gate.weight": state["model.layers.1.mlp.gate.weight"]})
    with pytest.raises(PayloadMismatch, match="model.layers.9.mlp.gate.weight"):
        engine.update_weights(iter(unknown.items()), "bad-name")
    assert server.alive(), server.log_tail()
    _probe(engine, model, tok)  # untouched, and generating again (the update was cancelled)


DEAD_TRAINER = textwrap.dedent("""
    import sys, time
    from gspo_megatron.config.schema import WeightSyncConfig
    from gspo_megatron.rollout.sglang.engine import SGLangEngine
    from gspo_megatron.weight_sync import build_transport
    engine = SGLangEngine([sys.argv[1]], request_timeout_s=60)
    transport = build_transport(WeightSyncConfig(transport="nccl"), engine, "sglang",
                                mode="disaggregated", master_address="127.0.0.1")
    members = engine.control.begin()          # paused, session open
    transport.connect(members)                # the server joined our group
    print("inside the update", flush=True)
    time.sleep(600)
""")


def test_partial_rollouts_continue_across_weight_updates_on_the_real_server(engine, server,
                                                                          model_dir, tmp_path):
    """Issue 40: two disk updates (new weights, versions 2 and 3) while 16 samples of up to 400
    tokens generate. Samples cut by a pause keep their tokens and go on under the next version;
    each token's log-prob equals its version's weights' after the prompt and the earlier tokens
    (one forward per version over the whole sequence), and differs from the others' (the
    check can fail). Each sync that cut requests paused in well under SGLang's one-second
    look (``FleetControl._cut_running``). Nothing of ours is left running, queued or paused."""
    from tests.test_rollout_sglang_partial_rollout import assert_each_token_from_its_version

    models = {v: build_tiny_policy(seed=seed)[0] for v, seed in (("1", 0), ("2", 12), ("3", 13))}
    build_transport(WeightSyncConfig(transport="disk", bucket_bytes=1 << 20,
                                     disk_dir=str(tmp_path / "sync")),
                    engine, "sglang", mode="disaggregated", config_dir=str(model_dir))
    engine.keep_partial_rollouts = True

    def sync(version):
        return engine.update_weights(((n, t.clone()) for n, t in models[version].state_dict().items()),
                                     version).phases

    _, tok = build_tiny_policy(seed=0)
    out, cuts = {}, []
    try:
        sync("1")
        worker = threading.Thread(target=lambda: out.setdefault("samples", engine.generate(
            _requests(tok, n=8)[:2], SamplingParams(max_new_tokens=400, seed=8))), name="test-generate")
        worker.start()
        for version in ("2", "3"):
            time.sleep(0.15)  # ~30 decoding steps: about half the samples still run
            phases = sync(version)
            cuts.append((phases["weight_sync/num_interrupted_requests"], phases["weight_sync/pause_s"]))
        worker.join(120)
        samples = out["samples"]
        assert len(samples) == 16 and cuts[0][0] > 0, cuts
        # aborted first, the pause finds nothing running: not SGLang's one-second second look
        assert all(pause_s < 0.9 for _, pause_s in cuts), cuts
        assert all(s.finish_reason in ("stop", "length") and len(s.response_token_ids) <= 400
                   for s in samples)
        assert any(len(set(s.token_versions)) > 1 for s in samples), [s.token_versions[::50] for s in samples]
        assert_each_token_from_its_version(samples, models, 1.0)
        metrics = engine.partial_rollout_metrics()
        assert metrics["rollout/partial/num_cut_segments"] >= 1
        assert metrics["rollout/partial/num_kept_tokens"] == sum(
            len(s.token_versions) - s.token_versions.count(s.token_versions[-1]) for s in samples)
        engine.clients[0].flush_cache()  # refused if anything of ours still ran or waited
        assert engine.clients[0].health(timeout_s=10)  # not paused
    finally:
        original, _ = build_tiny_policy(seed=0)
        engine.keep_partial_rollouts = False
        engine.update_weights(((n, t.clone()) for n, t in original.state_dict().items()), "orig")


def test_a_new_trainer_recovers_a_server_left_mid_update_by_a_killed_one(server, tmp_path):
    """Issue 28 item 8: SIGKILL inside a weight update leaves the server paused, in an open
    session and holding the dead trainer's group; the next trainer must still update it."""
    proc = subprocess.Popen([sys.executable, "-c", DEAD_TRAINER, server.address],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        line = proc.stdout.readline()
        assert "inside the update" in line, line + proc.stdout.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    eng = SGLangEngine.attach([server.address], request_timeout_s=60, health_timeout_s=60)
    try:
        build_transport(WeightSyncConfig(transport="nccl", bucket_bytes=48 * 1024), eng,
                        "sglang", mode="disaggregated", master_address="127.0.0.1")
        new, tok = build_tiny_policy(seed=21)
        eng.update_weights(((n, t.clone()) for n, t in new.state_dict().items()), "after-kill")
        _probe(eng, new, tok)
        original, _ = build_tiny_policy(seed=0)
        eng.update_weights(((n, t.clone()) for n, t in original.state_dict().items()), "orig")
    finally:
        eng.shutdown()
    assert server.alive(), server.log_tail()


def test_a_wedged_server_times_out_and_its_samples_go_elsewhere(server, spare_server):
    """One of two real servers stops answering (SIGSTOP of its whole process group): its
    requests time out, are aborted there when it comes back, and are answered by the other;
    every sample once. The resumed server answers again (the kill test gets it next)."""
    second = spare_server
    eng = SGLangEngine.attach([server.address, second.address], request_timeout_s=8,
                              health_timeout_s=60, max_retries=2)
    try:
        _, tok = build_tiny_policy(seed=0)
        requests_ = [GenerationRequest(f"w{i}", tok(t)["input_ids"], n=8) for i, t in enumerate(PROMPTS)]
        seen = []
        for sample in eng.generate_iter(requests_, SamplingParams(max_new_tokens=200, seed=6)):
            seen.append((sample.prompt_id, sample.sample_index))
            if len(seen) == 2:
                os.killpg(second.process.pid, signal.SIGSTOP)
        assert sorted(seen) == sorted((r.prompt_id, j) for r in requests_ for j in range(r.n))
        assert second.address in eng.pool.dead and eng._num_retries >= 1
    finally:
        if second.process is not None:
            os.killpg(second.process.pid, signal.SIGCONT)
        eng.shutdown()
    assert server.alive(), server.log_tail()


def test_a_server_killed_mid_batch_loses_no_sample(server, spare_server):
    """Two real servers; one is SIGKILLed as soon as the batch's first samples come back. Every
    requested sample still comes back exactly once (the dead server's in-flight ones retried on
    the other), and the dead server leaves the rotation."""
    second = spare_server
    eng = SGLangEngine.attach([server.address, second.address], request_timeout_s=60,
                              health_timeout_s=60, max_retries=2)
    try:
        _, tok = build_tiny_policy(seed=0)
        requests_ = [GenerationRequest(f"q{i}", tok(t)["input_ids"], n=16)
                     for i, t in enumerate(PROMPTS * 2)]
        seen = []
        for sample in eng.generate_iter(requests_, SamplingParams(max_new_tokens=200, seed=5)):
            seen.append((sample.prompt_id, sample.sample_index))
            if len(seen) == 4:
                second.stop(grace_s=0.0)  # SIGTERM then SIGKILL of its whole process group
        expected = sorted((r.prompt_id, j) for r in requests_ for j in range(r.n))
        assert sorted(seen) == expected and len(set(seen)) == len(seen)
        assert second.address in eng.pool.dead
        assert eng._num_retries >= 1  # the dead server's requests were retried (generate_iter
        # leaves metrics to generate(); its counter is the one it keeps)
    finally:
        eng.shutdown()
    assert server.alive(), server.log_tail()


def test_a_bucket_refused_by_one_server_ends_the_update_cleanly(model_dir, server, tmp_path):
    """Issue 29 item 4, against the real server: a fleet of the real SGLang server and a
    stand-in process in one gloo broadcast group. Bucket 2 is refused by one of them (its
    session ended, as SGLang refuses it) while the other takes it: the update fails at once
    naming the server and the bucket, neither server stays paused, in a session or inside the
    collective, and the next update reaches both (log-probs on both equal the new weights')."""
    from gspo_megatron.distributed.ports import free_port
    from gspo_megatron.rollout.sglang.launcher import ServerLauncher
    from gspo_megatron.rollout.standin.launcher import reference_server_command
    from tests.weight_sync_faults import assert_refused_bucket_ends_cleanly, broadcast_updates

    launcher = ServerLauncher(str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"})
    port = free_port()
    launcher.start(reference_server_command(str(model_dir), port, python=sys.executable),
                   f"127.0.0.1:{port}")
    eng = SGLangEngine([server.address, f"127.0.0.1:{port}"], request_timeout_s=120)
    try:
        eng.wait_healthy(timeout_s=180)
        transport, update = broadcast_updates(eng, "sglang", first_seed=50)

        def both_serve(policy, version="after-refusal"):
            _, tok = build_tiny_policy(seed=0)
            samples = eng.generate(_requests(tok, n=4), SamplingParams(max_new_tokens=8, seed=7))
            assert {s.weight_version for s in samples} == {version}
            with torch.no_grad():
                _assert_logprobs_match(samples, policy, 1.0)

        both_serve(update("v1"), "v1")
        for refuser in (server.address, f"127.0.0.1:{port}"):
            assert_refused_bucket_ends_cleanly(eng, transport, refuser, update, both_serve)
        original, _ = build_tiny_policy(seed=0)
        eng.update_weights(((n, t.clone()) for n, t in original.state_dict().items()), "orig")
    finally:
        eng.shutdown()
        launcher.stop()
    assert server.alive(), server.log_tail()


def test_a_server_without_the_capture_takes_the_r3_request_and_our_client_refuses_its_answer(
        engine, server):
    """What the real server does with ``return_routed_experts`` when it captures nothing: the
    request passes the JSON contract gate (the field is GenerateReqInput's, outside the
    contract, which ignores unknown keys) and is answered without ``routed_experts``; the
    client turns that into a clear error naming the server and the missing flag."""
    from gspo_megatron.rollout.routed_experts import MalformedRouting, RoutingShape
    from gspo_megatron.rollout.sglang import api

    _, tok = build_tiny_policy(seed=0)
    body = api.generate_payload("r3", tok("1+2=")["input_ids"], SamplingParams(max_new_tokens=3),
                                None, return_routed_experts=True)
    resp = engine.clients[0].request("POST", api.GENERATE, body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert "routed_experts" not in answer["meta_info"] and answer["meta_info"]["completion_tokens"] >= 1
    engine.routing_shape = RoutingShape(2, 2, 8)
    with pytest.raises(MalformedRouting, match=f"{server.address}, request p0/\\d/0: .*"
                                               "--enable-return-routed-experts"):
        engine.generate(_requests(tok, n=1)[:1], SamplingParams(max_new_tokens=3))


def test_the_only_server_killed_mid_batch_fails_the_batch_naming_the_sample(server_to_kill):
    from gspo_megatron.rollout.sglang.engine import SampleFailed

    only = server_to_kill
    eng = SGLangEngine.attach([only.address], request_timeout_s=30, health_timeout_s=60,
                              max_retries=1)
    try:
        _, tok = build_tiny_policy(seed=0)
        requests_ = [GenerationRequest(f"k{i}", tok(t)["input_ids"], n=8) for i, t in enumerate(PROMPTS)]
        with pytest.raises(SampleFailed, match=rf"sample \(prompt_id='k\d', sample_index=\d\).*{only.address}"):
            for i, _sample in enumerate(eng.generate_iter(requests_, SamplingParams(max_new_tokens=200))):
                if i == 1:
                    only.stop(grace_s=0.0)
    finally:
        eng.shutdown()


R3_START = """
import sys
from pathlib import Path
from gspo_megatron.tiny_task.model import build_tiny_policy, save_tiny_model
from tests.real_sglang import RealServer
out = Path(sys.argv[1])
srv = RealServer(str(save_tiny_model(*build_tiny_policy(seed=0), out / "model")), out / "r3.log",
                 extra_args=["--enable-return-routed-experts"])
try:
    srv.start()
except AssertionError as exc:  # "real SGLang server exited with ..."
    print(exc)
    sys.exit(0)
finally:
    srv.stop()
sys.exit("it started")
"""
AHEAD = {"test_routed_experts_capture_needs_cuda_on_the_cpu_engine": Command(
    ["{python}", "-c", R3_START, "{dir}"], early=True, foreground_priority=True, timeout_s=600,
    min_available_gib=5.0)}
"""The start that dies (~30 CPU-seconds of a server start), in the background while the first
tests of the session run (``tests/ahead.py``); at the foreground's priority, as its start-up
deadline (``START_TIMEOUT_S``) is what it was in the test."""


def test_routed_experts_capture_needs_cuda_on_the_cpu_engine(ahead):
    """Issue 31 (R3), the evidence: SGLang 0.5.23 started with ``--enable-return-routed-experts``
    on the CPU engine dies at start. Its routed-experts host buffer is allocated pinned and
    registered with ``cudaHostRegister`` (``srt/state_capturer/base.py`` -> ``srt/mem_cache/
    pool_host/common.py: _cuda_host_register``), which needs a CUDA driver. So R3 from the real
    server cannot be exercised on these machines; if a later SGLang lifts this, this test says so."""
    assert ahead.returncode == 0 and "exited with" in ahead.stdout, ahead.stdout + ahead.stderr
    log = "\n".join((ahead.dir / "r3.log").read_text(errors="replace").splitlines()[-200:])
    assert "_cuda_host_register" in log and "Found no NVIDIA driver" in log, log
