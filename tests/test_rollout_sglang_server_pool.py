"""Tests of server membership and routing (least-loaded and prompt affinity,
rollout/sglang/server_pool.py), with fake clients."""

import pytest

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import ServerUnavailable
from gspo_megatron.config.validate import CHOICES
from gspo_megatron.rollout.sglang.server_pool import ROUTINGS, NoLiveServer, ServerPool


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


def _spread(pool, groups, n):
    """Acquire every sample of ``groups`` prompts of ``n`` samples (all in flight at once, as the
    engine's workers send them); the servers each prompt's samples went to."""
    return {g: [pool.acquire(set(), None, f"p{g}", n).address for _ in range(n)]
            for g in range(groups)}


def test_prompt_affinity_keeps_a_group_on_one_server_and_balances_groups():
    pool = ServerPool([FakeClient("a:1"), FakeClient("b:1")], routing="prompt_affinity")
    placed = _spread(pool, groups=4, n=4)
    assert all(len(set(servers)) == 1 for servers in placed.values()), placed
    assert sorted(servers[0] for servers in placed.values()) == ["a:1", "a:1", "b:1", "b:1"]
    # least-loaded spreads each group over both servers (each would prefill its prompt)
    placed = _spread(ServerPool([FakeClient("a:1"), FakeClient("b:1")]), groups=4, n=4)
    assert all(len(set(servers)) == 2 for servers in placed.values()), placed


def test_prompt_affinity_leaves_a_home_that_is_too_loaded_or_failed():
    pool = ServerPool([FakeClient("a:1"), FakeClient("b:1")], routing="prompt_affinity")
    first = pool.acquire(set(), None, "p", 2)
    assert pool.acquire(set(), None, "p", 2) is first  # 1 more than the idle one: < slack 2
    other = pool.acquire(set(), None, "p", 2)  # 2 more: the group overflows
    assert other is not first
    pool.release(other)
    # a sample that failed on its home goes elsewhere; the home stays for the others
    assert pool.acquire({first.address}, None, "p", 8) is other
    assert pool.acquire(set(), None, "p", 8) is first
    pool.mark_dead(first, "test")
    moved = pool.acquire(set(), None, "p", 8)
    assert moved is other and pool.acquire(set(), None, "p", 8) is other  # re-homed


def test_routing_choices_match_the_config_check():
    assert tuple(CHOICES["rollout.sglang.routing"]) == ROUTINGS
    with pytest.raises(ValueError, match="rollout.sglang.routing='round_robin'"):
        ServerPool([FakeClient("a:1")], routing="round_robin")


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
