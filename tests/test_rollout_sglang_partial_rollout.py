"""Partial rollouts across weight updates (``rollout/sglang/partial_rollout.py`` and the engine's
use of it) against the stand-in: the pieces alone, then whole samples cut by a real weight sync
(disk transport) while they generate, checked token by token against the weights of the
version the server says generated each one. The same against the real SGLang server:
``tests/test_rollout_sglang_real_server.py``.

The stand-in servers here decode slowly (a sleep per decoding step) and never emit EOS, so a
sample is still running when the sync comes: the sync starts once the server has taken
``CUT_AFTER_STEPS`` decoding steps (an event set by the slowed decoder, not a sleep).
"""

import threading
import time

import pytest
import torch

from gspo_megatron.rollout.embedded import engine as embedded_module
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine, teacher_forced_logprobs
from gspo_megatron.rollout.routed_experts import RoutingShape, check_sample_routing
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.rollout.sglang.partial_rollout import (MissingWeightVersions, PartialRollout,
                                                          PartialRolloutStats, integer_versions,
                                                          segment_seed, version_order_error)
from gspo_megatron.rollout.standin.server import ReferenceServer
from gspo_megatron.rollout.types import GenerationRequest, SamplingParams, sample_seed
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.weight_sync.disk import DiskTransport

SEEDS = {"1": 0, "2": 12, "3": 13}
"""Weight version -> the tiny policy's seed: three different sets of weights."""
CUT_AFTER_STEPS = 12
STEP_S = 0.01


# --- the pieces ------------------------------------------------------------------------------

def test_a_cut_segment_keeps_all_but_its_unchecked_last_token_and_the_next_continues_it():
    params = SamplingParams(temperature=0.8, max_new_tokens=10, seed=3, stop_token_ids=(7,))
    seed = sample_seed(3, "p", 0)
    rollout = PartialRollout([1, 2], params, seed)
    assert rollout.payload("p/0/0", False) == api.generate_payload("p/0/0", [1, 2], params, seed)
    assert rollout.keep_cut([5], [-0.5], ["4"]) == 0  # one token: nothing kept, sent again as is
    assert rollout.keep_cut([], [], []) == 0 and rollout.segment == 0
    assert rollout.payload("p/0/1", False)["sampling_params"]["sampling_seed"] == seed
    assert rollout.keep_cut([5, 6, 7], [-0.5, -0.6, -0.7], ["4", "4", "4"]) == 2  # 7 may be a stop
    body = rollout.payload("p/0/2", True)
    assert body["input_ids"] == [1, 2, 5, 6] and body["return_routed_experts"] is True
    assert body["sampling_params"]["max_new_tokens"] == 8
    assert body["sampling_params"]["sampling_seed"] == segment_seed(seed, 1) != seed
    assert body["sampling_params"]["stop_token_ids"] == [7]
    assert rollout.keep_cut(list(range(20, 28)), [-1.0] * 8, ["5"] * 8) == 7  # cut at the cap
    assert rollout.remaining == 1 and rollout.segment == 2
    rollout.extend([9], [-0.9], ["6"])
    assert rollout.tokens == [5, 6] + list(range(20, 27)) + [9]
    assert rollout.logprobs == [-0.5, -0.6] + [-1.0] * 7 + [-0.9]
    assert integer_versions(rollout.versions) == [4, 4] + [5] * 7 + [6]
    rollout.extend([1], [-1.0], None)  # a segment without spans: no versions at all
    assert rollout.versions is None and integer_versions(None) is None


def test_segment_seeds_and_integer_versions():
    assert segment_seed(None, 3) is None and segment_seed(41, 0) == 41
    seeds = {segment_seed(41, j) for j in range(1, 50)}
    assert len(seeds) == 49 and all(0 <= s < 2 ** 31 for s in seeds)
    assert segment_seed(41, 1) == segment_seed(41, 1) != segment_seed(42, 1)
    assert integer_versions(["3", "12"]) == [3, 12] and integer_versions(["default"]) is None


def test_version_order_is_checked_against_what_the_engine_served():
    assert version_order_error(["1", "1", "2"], ["1", "2"]) is None
    assert version_order_error([], ["1"]) is None
    assert version_order_error(["2"], ["1", "2", "3"]) is None  # sent at 1, ran under 2
    assert version_order_error(["x"], [None, "1"]) is None  # no version yet: any
    assert version_order_error(["x", "1"], [None, "1"]) is None
    assert "'0'" in version_order_error(["0", "1"], ["1", "2"])  # before it was sent
    assert "'1'" in version_order_error(["2", "1"], ["1", "2"])  # out of order
    assert "'1'" in version_order_error(["1", "2", "1"], ["1", "2"])
    assert "'default'" in version_order_error(["default"], ["3"])


def test_spans_become_one_version_per_token_or_a_protocol_error():
    def body(spans, n=3):
        meta = {"finish_reason": {"type": "length"}, "completion_tokens": n,
                "output_token_logprobs": [[-1.0, 5, None]] * n}
        if spans is not None:
            meta["weight_versions"] = spans
        return {"output_ids": [5] * n, "meta_info": meta}

    parse = api.parse_generate_response
    assert parse(body(None)).token_versions is None
    assert parse(body([{"version": "1", "start": 0, "end": 1},
                       {"version": "2", "start": 1, "end": 3}])).token_versions == ["1", "2", "2"]
    assert parse(body([{"version": "1", "start": 0, "end": 0}], n=0)).token_versions == []
    for bad in ([], [{"version": "1", "start": 0, "end": 2}],
                [{"version": "1", "start": 1, "end": 3}],
                [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": 3}],
                [{"version": 1, "start": 0, "end": 3}], [{"start": 0, "end": 3}], "spans"):
        with pytest.raises(api.ProtocolError, match="weight_versions"):
            parse(body(bad))


def test_stats_count_cuts_and_multi_version_samples_from_many_threads():
    stats = PartialRolloutStats()
    threads = [threading.Thread(target=lambda: [stats.record_cut(3, 2) for _ in range(100)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats.record_cut(1, 0)
    stats.record_sample(["1", "2"])
    stats.record_sample(["2"])
    stats.record_sample(None)
    assert stats.as_metrics() == {
        "rollout/partial/num_cut_segments": 401.0, "rollout/partial/num_resumed_segments": 400.0,
        "rollout/partial/num_kept_tokens": 800.0, "rollout/partial/num_dropped_tokens": 401.0,
        "rollout/partial/num_samples": 3.0, "rollout/partial/num_multi_version_samples": 1.0}


def test_the_stand_ins_abort_step_takes_a_token_it_does_not_check(policy):
    """SGLang's abort of a running request: one more decoding step whose token is appended
    without the finish checks (``Req.update_finish_state`` returns at ``to_finish``). Cut at
    the step that samples a stop id: the row ends ``abort`` holding it; uncut, ``stop``."""
    model, tok = policy
    eng = EmbeddedEngine(model, tok)
    prompt = tok("1+1=")["input_ids"]
    free = eng.generate_token_ids([prompt], [5], SamplingParams(max_new_tokens=6))[0]
    stop_id = free.tokens[min(2, len(free.tokens) - 1)]
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(stop_id,))
    first = free.tokens.index(stop_id)
    stopped = eng.generate_token_ids([prompt], [5], params)[0]
    assert stopped.finish_reason == "stop" and stopped.tokens == free.tokens[:first + 1]
    steps = iter([[False]] * first + [[True]] * 8)
    cut = eng.generate_token_ids([prompt], [5], params, should_stop=lambda: next(steps),
                                 abort_takes_a_step=True)[0]
    assert cut.finish_reason == "abort" and cut.tokens == free.tokens[:first + 1]
    assert cut.logprobs == pytest.approx(stopped.logprobs)


# --- whole samples against the stand-in -------------------------------------------------------

@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return build_tiny_policy(seed=0)


@pytest.fixture(scope="module")
def models():
    return {v: build_tiny_policy(seed=s)[0] for v, s in SEEDS.items()}


class SlowDecoding:
    """Every decoder the embedded engine makes sleeps ``STEP_S`` per step and counts steps;
    ``reached`` is set once ``CUT_AFTER_STEPS`` steps ran since :meth:`arm`."""

    def __init__(self, monkeypatch):
        self.steps = 0
        self.reached = threading.Event()
        make = embedded_module.make_decoder

        def slow_decoder(*args, **kwargs):
            decoder = make(*args, **kwargs)
            step = decoder.step

            def slow_step(*a, **k):
                time.sleep(STEP_S)
                self.steps += 1
                if self.steps >= CUT_AFTER_STEPS:
                    self.reached.set()
                return step(*a, **k)

            decoder.step = slow_step
            return decoder

        monkeypatch.setattr(embedded_module, "make_decoder", slow_decoder)

    def arm(self):
        self.steps = 0
        self.reached.clear()


def _server(record_routing=False, cls=ReferenceServer):
    model, tok = build_tiny_policy(seed=0)
    engine = EmbeddedEngine(model, tok, record_routing=record_routing)
    engine._eos_ids = ()  # every response runs to max_new_tokens
    return cls(engine).start()


def _engine(servers, tmp_path, **kwargs):
    eng = SGLangEngine([s.address for s in servers], request_timeout_s=60, max_retries=1,
                       keep_partial_rollouts=True, **kwargs)
    eng.attach_weight_transport(DiskTransport(str(tmp_path / "sync"), 1 << 20, servers=True))
    return eng


def _sync(eng, models, version):
    return eng.update_weights(((n, t.clone()) for n, t in models[version].state_dict().items()),
                              weight_version=version)


def _generate_across_syncs(eng, models, slow, requests_, params, versions=("2",)):
    """``generate`` in a thread of its own; each version of ``versions`` synced once the
    servers decoded ``CUT_AFTER_STEPS`` more steps. Returns the samples and the syncs' metrics."""
    out, syncs = {}, []

    def run():
        try:
            out["samples"] = eng.generate(requests_, params)
        except Exception as exc:  # noqa: BLE001 - re-raised below
            out["error"] = exc

    slow.arm()
    worker = threading.Thread(target=run, name="test-generate")
    worker.start()
    try:
        for version in versions:
            deadline = time.monotonic() + 30
            while not slow.reached.wait(0.1) and worker.is_alive():
                assert time.monotonic() < deadline, f"the servers did not decode ({slow.steps} steps)"
            assert worker.is_alive(), f"generate ended before the sync to {version}: {out}"
            syncs.append(_sync(eng, models, version).phases)
            slow.arm()
    finally:
        worker.join(60)
    if "error" in out:
        raise out["error"]
    assert "samples" in out, "generate did not finish"
    return out["samples"], syncs


def assert_each_token_from_its_version(samples, models, temperature, atol=2e-5):
    """Every token's log-prob is the log-prob its version's weights give it after the prompt
    and every earlier token (each version's own forward over the whole sequence), and not
    what the other versions' weights give (so the check could fail)."""
    assert samples, "no samples to check"
    gaps, others, checked = [0.0], [float("inf")], 0
    with torch.no_grad():
        for s in samples:
            assert len(s.token_versions) == len(s.response_token_ids) == len(s.response_logprobs)
            assert s.token_versions == sorted(s.token_versions), s.token_versions
            assert s.weight_version == str(s.token_versions[-1])
            unknown = set(s.token_versions) - {int(v) for v in models}
            assert not unknown, f"tokens of versions {sorted(unknown)} have no model to check"
            got = torch.tensor(s.response_logprobs)
            for version, model in models.items():
                ref = teacher_forced_logprobs(model, s.prompt_token_ids, s.response_token_ids,
                                              temperature)
                mine = torch.tensor([v == int(version) for v in s.token_versions])
                if mine.any():
                    gaps.append(float((got - ref)[mine].abs().max()))
                    checked += int(mine.sum())
                if (~mine).any():
                    others.append(float((got - ref)[~mine].abs().max()))
    assert checked == sum(len(s.response_token_ids) for s in samples) > 0  # every token, once
    assert max(gaps) < atol, f"log-probs off their own version's by {max(gaps):.3g}"
    assert min(others) > 1e-3, "another version's weights give the same log-probs: a void check"


def test_samples_cut_by_weight_syncs_continue_under_each_new_version(tmp_path, policy, models,
                                                                     monkeypatch):
    slow = SlowDecoding(monkeypatch)
    server = _server()
    eng = _engine([server], tmp_path)
    try:
        _sync(eng, models, "1")
        _, tok = policy
        requests_ = [GenerationRequest("q", tok("1+1=")["input_ids"], n=1)]  # one batch, always
        params = SamplingParams(temperature=0.9, max_new_tokens=60, seed=4)
        samples, syncs = _generate_across_syncs(eng, models, slow, requests_, params, ("2", "3"))
        assert [s.key for s in samples] == [("q", 0)]
        s = samples[0]  # no EOS: max_new_tokens counts the whole response
        assert s.finish_reason == "length" and len(s.response_token_ids) == 60
        assert sorted(set(s.token_versions)) == [1, 2, 3] and s.weight_version == "3"
        assert_each_token_from_its_version(samples, models, 0.9)
        assert [m["weight_sync/num_interrupted_requests"] for m in syncs] == [1.0, 1.0]
        assert eng.partial_rollout_metrics() == {
            "rollout/partial/num_cut_segments": 2.0, "rollout/partial/num_resumed_segments": 2.0,
            "rollout/partial/num_kept_tokens": float(60 - s.token_versions.count(3)),
            "rollout/partial/num_dropped_tokens": 2.0,  # the unchecked last token of each cut
            "rollout/partial/num_samples": 1.0, "rollout/partial/num_multi_version_samples": 1.0}

        bodies = [b for _, p, b in server.request_log if p == api.GENERATE]
        for s in samples:
            mine = [b for b in bodies if b["rid"].startswith(f"{s.prompt_id}/{s.sample_index}/")]
            assert len(mine) == 3  # one request, then one per sync
            seed = sample_seed(4, s.prompt_id, s.sample_index)
            for j, b in enumerate(mine):  # prompt + kept tokens, the rest of the length, its seed
                kept = [v for v in s.token_versions if v <= j]
                assert b["input_ids"] == s.prompt_token_ids + s.response_token_ids[:len(kept)]
                assert b["sampling_params"]["max_new_tokens"] == 60 - len(kept)
                assert b["sampling_params"]["sampling_seed"] == segment_seed(seed, len(set(kept)))
        assert server.scheduler.is_idle() and not server.scheduler.paused
        eng.flush_cache()  # nothing of ours left running or queued
    finally:
        eng.shutdown()
        server.stop()


def test_concurrent_generate_calls_while_the_main_thread_syncs(tmp_path, policy, models,
                                                               monkeypatch):
    """The trainer's generator: one ``generate`` per prompt from several threads at once, the
    main thread syncing meanwhile. Every sample once, each token's version right; a sample key
    already in flight in another call is refused."""
    slow = SlowDecoding(monkeypatch)
    servers = [_server(), _server()]
    eng = _engine(servers, tmp_path)
    _, tok = policy
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=9)
    results, errors = {}, []

    def one_prompt(i):
        try:
            req = GenerationRequest(f"c{i}", tok(f"{i}+{i}=")["input_ids"], n=2)
            results[i] = eng.generate([req], params)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    try:
        _sync(eng, models, "1")
        slow.arm()
        threads = [threading.Thread(target=one_prompt, args=(i,), name=f"test-gen-{i}")
                   for i in range(4)]
        for t in threads:
            t.start()
        assert slow.reached.wait(30)
        with pytest.raises(ValueError, match=r"\('c0', 0\).*another generate\(\) call"):
            eng.generate([GenerationRequest("c0", [3, 4], n=1)], params)
        _sync(eng, models, "2")
        for t in threads:
            t.join(60)
        assert not errors, errors
        samples = [s for i in range(4) for s in results[i]]
        assert sorted(s.key for s in samples) == sorted((f"c{i}", j) for i in range(4) for j in range(2))
        assert all(len(s.response_token_ids) == 40 for s in samples)
        assert any(len(set(s.token_versions)) == 2 for s in samples)
        assert_each_token_from_its_version(samples, {v: models[v] for v in ("1", "2")}, 1.0)
        assert all(not s.sent_rids and s.outstanding == 0 for s in eng.pool.servers)
        assert not eng._active
    finally:
        eng.shutdown()
        for s in servers:
            s.stop()


def test_routing_of_a_resumed_sample_is_the_last_versions_over_the_whole_sequence(
        tmp_path, policy, models, monkeypatch):
    """R3 with partial rollouts: the last segment's routing covers prompt + every kept token
    + its own (``P + R - 1`` positions), each position routed by the last version's weights."""
    slow = SlowDecoding(monkeypatch)
    server = _server(record_routing=True)
    model = models["1"]
    shape = RoutingShape(model.config.num_hidden_layers, model.config.num_experts_per_tok,
                         model.config.num_experts)
    eng = _engine([server], tmp_path)
    eng.routing_shape = shape
    try:
        _sync(eng, models, "1")
        _, tok = policy
        samples, _ = _generate_across_syncs(
            eng, models, slow, [GenerationRequest("r", tok("abc")["input_ids"], n=2)],
            SamplingParams(temperature=1.0, max_new_tokens=40, seed=2))
        assert any(set(s.token_versions) == {1, 2} for s in samples)
        for s in samples:
            routing = check_sample_routing(s, shape)
            ids = torch.tensor([s.prompt_token_ids + s.response_token_ids[:-1]])
            top_k = []
            hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: top_k.append(out))
                     for layer in models["2"].model.layers]
            try:
                with torch.no_grad():
                    models["2"](input_ids=ids)
            finally:
                for h in hooks:
                    h.remove()
            want = torch.stack([torch.topk(x.float(), shape.top_k, -1).indices for x in top_k], 1)
            assert torch.equal(routing.long().sort(-1).values, want.sort(-1).values), s.key
    finally:
        eng.shutdown()
        server.stop()


class _NoSpans(ReferenceServer):
    """Answers like an SGLang older than 0.5.19: no ``meta_info.weight_versions``."""

    def _response(self, *args, **kwargs):
        out = super()._response(*args, **kwargs)
        out["meta_info"].pop("weight_versions")
        return out


def test_what_partial_rollouts_refuse(tmp_path, policy, models):
    _, tok = policy
    req = [GenerationRequest("x", tok("hi")["input_ids"])]
    params = SamplingParams(max_new_tokens=4, seed=1)
    old = _server(cls=_NoSpans)
    eng = _engine([old], tmp_path)
    try:
        with pytest.raises(ValueError, match="serves weight version None.*weight_version=str"):
            eng.generate(req, params)
        _sync(eng, models, "1")
        with pytest.raises(ValueError, match="stop strings are not supported.*tail_str"):
            eng.generate(req, SamplingParams(max_new_tokens=4, stop=("!",)))
        with pytest.raises(MissingWeightVersions,
                           match=rf"{old.address} \(SGLang 0.5.23\) answered request x/0/0 "
                                 "without meta_info.weight_versions"):
            eng.generate(req, params)
        eng.keep_partial_rollouts = False  # without partial rollouts: no versions, no error
        assert eng.generate(req, params)[0].token_versions is None
    finally:
        eng.shutdown()
        old.stop()


def test_ordinary_samples_carry_token_versions_and_a_server_off_them_leaves(tmp_path, policy, models):
    """Without partial rollouts too: integer versions become ``token_versions``; a server whose
    spans name a version the engine did not serve leaves the rotation, its samples go elsewhere."""
    _, tok = policy
    stale, current = _server(), _server()  # the first is chosen first
    eng = SGLangEngine([stale.address, current.address], request_timeout_s=60)
    eng.attach_weight_transport(DiskTransport(str(tmp_path / "sync"), 1 << 20, servers=True))
    req = [GenerationRequest("o", tok("hi")["input_ids"], n=4)]
    try:
        first = eng.generate(req, SamplingParams(max_new_tokens=3))
        assert {s.token_versions is None for s in first} == {True}  # version 'default'
        _sync(eng, models, "3")
        samples = eng.generate(req, SamplingParams(max_new_tokens=3, seed=1))
        assert all(s.token_versions == [3] * len(s.response_token_ids) for s in samples)
        original = stale._response

        def other_spans(*args, **kwargs):  # weights of '3' claimed, spans of '2'
            out = original(*args, **kwargs)
            out["meta_info"]["weight_versions"][0]["version"] = "2"
            return out

        stale._response = other_spans
        samples = eng.generate(req, SamplingParams(max_new_tokens=3, seed=2))
        assert len(samples) == 4 and eng.pool.dead == [stale.address]
        assert all(s.token_versions[0] == 3 for s in samples)
    finally:
        eng.shutdown()
        current.stop()
        stale.stop()
