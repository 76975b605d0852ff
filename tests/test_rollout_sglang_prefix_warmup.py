"""The prompt warm-up of ``prompt_affinity`` routing (rollout/sglang/prefix_warmup.py), with fake
clients: one prefill per prompt and server, the group's other samples wait for it (at most the
deadline), a failed warm-up lets them go on, and its request id is kept for the next sync's
abort only when the server may still be running it. The real server's cache hit is in
test_rollout_sglang_real_server.py; the engine with reference servers in test_rollout_sglang_engine.py."""

import threading
import time

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import ServerUnavailable
from gspo_megatron.rollout.sglang.prefix_warmup import PrefixWarmup
from gspo_megatron.rollout.sglang.server_pool import ServerPool
from gspo_megatron.rollout.types import GenerationRequest


class FakeClient:
    def __init__(self, address, delay_s=0.2, error=None):
        self.address, self.delay_s, self.error = address, delay_s, error
        self.prefills = []

    def prefill(self, payload, timeout_s=None):
        self.prefills.append(payload)
        time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error


def _run_together(warmup, server, req, count):
    """``count`` samples of ``req`` reach ``server`` at once; when each returned."""
    returned = []

    def sample():
        warmup.before_first_attempt(server, req)
        returned.append(time.monotonic())

    threads = [threading.Thread(target=sample) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return returned


def test_one_prefill_per_prompt_and_server_and_every_sample_waits_for_it():
    a, b = FakeClient("a:1"), FakeClient("b:1")
    pool = ServerPool([a, b], routing="prompt_affinity")
    warmup = PrefixWarmup(pool, timeout_s=10)
    req = GenerationRequest("p0", [5, 6, 7], n=4)
    started = time.monotonic()
    returned = _run_together(warmup, pool.servers[0], req, 4)
    assert len(a.prefills) == 1 and not b.prefills
    assert a.prefills[0] == api.prefill_payload("p0/prefill", [5, 6, 7])
    assert a.prefills[0]["sampling_params"] == {"max_new_tokens": 0}
    assert min(returned) - started >= 0.2  # nobody went before the prefill's answer
    _run_together(warmup, pool.servers[1], req, 2)  # an overflow server gets its own
    assert len(b.prefills) == 1 and warmup.num_prefills == 2
    _run_together(warmup, pool.servers[0], GenerationRequest("p1", [8], n=2), 2)
    assert len(a.prefills) == 2
    assert not any(s.sent_rids for s in pool.servers)  # each answered id forgotten
    warmup.forget(["p0"])  # its batch ended: a later batch of the same prompt warms it again
    _run_together(warmup, pool.servers[0], req, 1)
    assert len(a.prefills) == 3


def test_a_failed_warm_up_lets_the_samples_go_on():
    down = FakeClient("a:1", delay_s=0.0, error=ServerUnavailable("a:1/generate: connection refused"))
    refusing = FakeClient("b:1", delay_s=0.0, error=api.ServerRefused("b:1", "/generate", "HTTP 400: no"))
    pool = ServerPool([down, refusing], routing="prompt_affinity")
    warmup = PrefixWarmup(pool, timeout_s=10)
    for server in pool.servers:
        assert len(_run_together(warmup, server, GenerationRequest("p", [1], n=3), 3)) == 3
    assert not any(s.sent_rids for s in pool.servers)


def test_a_timed_out_warm_up_is_left_for_the_sync_to_abort_and_waiters_have_a_deadline():
    slow = FakeClient("a:1", delay_s=1.5, error=ServerUnavailable("a:1/generate: timed out",
                                                                  timed_out=True))
    pool = ServerPool([slow], routing="prompt_affinity")
    warmup = PrefixWarmup(pool, timeout_s=0.3)  # the waiters' deadline; the fake ignores it
    started = time.monotonic()
    returned = sorted(_run_together(warmup, pool.servers[0], GenerationRequest("p", [1], n=3), 3))
    assert returned[0] - started < 1.2  # two waiters gave up at their deadline
    assert returned[-1] - started >= 1.5  # the owner returned with its request
    assert pool.servers[0].sent_rids == {"p/prefill"}  # the server may still be prefilling it
