"""Tests of server membership and least-loaded choice (rollout/sglang/server_pool.py), with fake
clients."""

import pytest

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import ServerUnavailable
from gspo_megatron.rollout.sglang.server_pool import NoLiveServer, ServerPool


class FakeClient:
    def __init__(self, address, version="default", up=True):
        self.address, self.version, self.up = address, version, up

    def model_info(self, timeout_s=5.0):
        if not self.up:
            raise ServerUnavailable(f"{self.address}: connection refused")
        return {"weight_version": self.version}


def test_least_loaded_prefers_servers_the_sample_has_not_failed_on():
    pool = ServerPool([FakeClient("a:1"), FakeClient("b:1")])
    a = pool.acquire(set(), None)
    b = pool.acquire(set(), None)
    assert {a.address, b.address} == {"a:1", "b:1"}  # the second goes to the idle server
    pool.release(b)
    assert pool.acquire({"b:1"}, None).address == "a:1"  # even though a is busier
    pool.sent(a, "r1")
    pool.answered(a, "r1")
    assert a.sent_rids == set()


def test_readmission_needs_current_weights_or_a_sync():
    a, b = FakeClient("a:1", "v3"), FakeClient("b:1", "default")
    pool = ServerPool([a, b])
    for s in pool.servers:
        pool.mark_dead(s, "test")
    assert pool.members == [] and pool.dead == ["a:1", "b:1"]
    assert pool.readmit_current("v3") == ["a:1"]  # b restarted on the initial weights
    assert pool.dead == ["b:1"]
    b.up = False
    assert pool.readmit_for_sync() == []
    b.up = True
    assert pool.readmit_for_sync() == ["b:1"] and pool.dead == []


def test_fleet_calls_drop_unreachable_members_and_raise_refusals():
    pool = ServerPool([FakeClient("a:1"), FakeClient("b:1")])

    def call(s):
        if s.address == "a:1":
            raise ServerUnavailable("a:1 died")

    assert pool.on_members(call, "pause") == ["a:1"] and pool.dead == ["a:1"]

    def refuse(s):
        raise api.ServerRefused(s.address, api.BEGIN_UPDATE, "already open")

    with pytest.raises(api.ServerRefused, match="b:1 refused /begin_weight_update: already open"):
        pool.on_members(refuse, "begin")
    pool.mark_dead(pool.servers[1], "test")
    with pytest.raises(NoLiveServer, match="flush"):
        pool.on_members(call, "flush")
    with pytest.raises(NoLiveServer):
        pool.acquire(set(), "v9")  # nobody serves v9
    with pytest.raises(ValueError, match="at least one"):
        ServerPool([])
