"""MoE routing record / replay on Megatron-Core's RouterReplay, and expert volatility.

The slow tests build the tiny Qwen3-MoE learner (one process, then EP=2 and TP=2+SP on two gloo
processes), record the routing of a batch, move the router weights so that the model's own
routing changes, and check that (a) a replayed training pass routes every token to exactly the
recorded experts, (b) gradients still reach the router and the experts, (c) replay at unchanged
weights gives the plain pass's loss, and (d) the volatility metric sees the change identically in
every layout.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.learner.routing import (REPLAY, RoutingTape, check_routing_supported,
                                           router_token_index, routing_change_metrics)
from tests.multiproc import run_on_ranks
from tests.test_learner_learner import make_batch, tiny_cfg


def test_router_token_index_follows_megatron_s_b_order_and_sp_shards():
    # rows=2, length=4: row-major position p = b * 4 + s; the router flattens [s, b] -> s * 2 + b.
    positions = torch.tensor([1, 2, 5, 7])  # (b0,s1) (b0,s2) (b1,s1) (b1,s3)
    assert router_token_index((2, 4), positions).tolist() == [2, 4, 3, 7]
    # SP=2: rank 0 routes columns 0-1, rank 1 columns 2-3 (local column = s - 2).
    assert router_token_index((2, 4), positions, sp_size=2, sp_rank=0).tolist() == [2, 3]
    assert router_token_index((2, 4), positions, sp_size=2, sp_rank=1).tolist() == [0, 3]


def test_routing_change_metrics_counts_sets_and_experts():
    before = torch.tensor([[0, 1], [2, 3], [0, 3], [1, 2]], dtype=torch.int16)
    after = torch.tensor([[1, 0], [2, 0], [1, 2], [1, 2]], dtype=torch.int16)  # same, 1, 2, same
    fp = [((0,), (1, 4), "rows", 0)]
    where = [torch.tensor([0, 1, 2])]  # the last token is not a response position
    m = routing_change_metrics(RoutingTape([[[before]]], fp, where),
                               RoutingTape([[[after]]], fp, where), num_experts=4)
    assert m["expert_set_changed_frac"].tolist() == [2.0, 3.0]
    assert m["activated_expert_changed_frac"].tolist() == [3.0, 6.0]
    with pytest.raises(ValueError, match="different micro-batches"):
        routing_change_metrics(RoutingTape([[[before]]], fp, where),
                               RoutingTape([[[after]]], [((1,), (1, 4), "rows", 0)], where), 4)


def test_unsupported_layouts_are_refused():
    cfg = SimpleNamespace(moe_router_fusion=False, recompute_granularity="full",
                          pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="recompute=full needs parallel.pp=1"):
        check_routing_supported(cfg, [[object()]], REPLAY)
    with pytest.raises(ValueError, match="needs an MoE model"):
        check_routing_supported(cfg, [[]], REPLAY)
    with pytest.raises(ValueError, match="fused router"):
        check_routing_supported(SimpleNamespace(moe_router_fusion=True), [[object()]], REPLAY)


def _routing_maps(learner):
    """Capture every router call's routing_map (bool [tokens, experts]) per chunk, in order."""
    from megatron.core.transformer.moe.router import TopKRouter

    seen, handles = [], []
    for chunk in learner.model:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                handles.append(module.register_forward_hook(
                    lambda mod, args, out: seen.append(out[1].detach().cpu())))
    return seen, handles


def _expected_maps(tape: RoutingTape, num_experts: int) -> list:
    maps = []
    for layers in tape.indices[0]:
        for idx in layers:
            m = torch.zeros(idx.shape[0], num_experts, dtype=torch.bool)
            maps.append(m.scatter_(1, idx.long(), True))
    return maps


def _grad_norms(learner):
    router = expert = 0.0
    for chunk in learner.model:
        for name, p in chunk.module.named_parameters():
            g = float(p.main_grad.abs().sum())
            if ".router." in name:
                router += g
            elif ".experts." in name:
                expert += g
    return router, expert


def _record_replay(rank: int, layout: dict, root: str, recompute: str = "none") -> dict:
    from megatron.core.transformer.moe.router import TopKRouter

    from gspo_megatron.algorithms.losses import get_policy_loss
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner

    cfg = tiny_cfg(**layout)
    cfg.model.recompute = recompute
    learner = Learner(cfg, init_distributed(cfg.parallel, seed=3), total_steps=10)
    if layout:  # the single process's initial weights, so that every layout runs one model
        learner.load_weights(f"{root}/init")
    else:
        learner.save_weights(f"{root}/init")
    gspo = get_policy_loss("gspo")
    out = learner.compute_logprobs(make_batch(0), record_routing=True)
    batch = make_batch(0, old=out.logprobs)
    tape = out.routing

    # (c) at the recording weights, replay changes nothing.
    plain = learner.forward_backward(batch, gspo)["loss_sum"].item()
    replayed = learner.forward_backward(batch, gspo, routing=tape)["loss_sum"].item()

    # Move the routers (same seed on every rank: replicated weights stay equal).
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for chunk in learner.model:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.weight.add_(torch.randn(module.weight.shape, generator=gen) * 0.5)
    natural = learner.record_routing(batch)
    volatility = learner.routing_change(tape, natural)

    # (a), (b): the replayed training pass routes exactly as recorded, and gradients flow.
    seen, handles = _routing_maps(learner)
    learner.forward_backward(batch, gspo, routing=tape)
    for h in handles:
        h.remove()
    expected = _expected_maps(tape, cfg.model.num_experts)
    natural_maps = _expected_maps(natural, cfg.model.num_experts)
    # Every router call (recomputation calls each twice, in backward order) used a recorded map,
    # and every recorded map was used.
    exact = len(seen) >= len(expected) and all(
        any(torch.equal(s, e) for e in expected) for s in seen) and all(
        any(torch.equal(s, e) for s in seen) for e in expected)
    differs_from_natural = sum(not torch.equal(a, b) for a, b in zip(expected, natural_maps))
    router_grad, expert_grad = _grad_norms(learner)

    # A different mini-batch (here: the same lengths, other tokens) cannot take this tape.
    try:
        learner.forward_backward(make_batch(1, old=out.logprobs), gspo, routing=tape)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return {"calls": len(seen), "plain": plain, "replayed": replayed, "exact": exact, "num_maps": len(expected),
            "differs": differs_from_natural, "router_grad": router_grad,
            "expert_grad": expert_grad, "volatility": volatility, "refused": refused}


def _check(result: dict, where: str) -> None:
    assert result["replayed"] == pytest.approx(result["plain"], rel=1e-6, abs=1e-9), where
    assert result["num_maps"] >= 2 and result["exact"], where
    assert result["differs"] >= 1, f"{where}: moving the routers did not change the routing"
    assert result["router_grad"] > 0 and result["expert_grad"] > 0, where
    assert "is not the one recorded" in result["refused"], where


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("routing"))
    return root, run_on_ranks(_record_replay, world_size=1, timeout_s=600, layout={}, root=root)[0]


@pytest.mark.slow
def test_replay_uses_recorded_experts_and_gradients_flow(single_process):
    _, result = single_process
    _check(result, "1 process")
    vol = result["volatility"]
    assert 0.05 < vol["expert_set_changed_frac"] <= 1.0
    assert 0.0 < vol["activated_expert_changed_frac"] <= vol["expert_set_changed_frac"]


@pytest.mark.slow
def test_replay_with_full_recompute_on_one_stage(single_process, tmp_path):
    _, plain = single_process
    result = run_on_ranks(_record_replay, world_size=1, timeout_s=600, layout={},
                          root=str(tmp_path), recompute="full")[0]
    _check(result, "recompute=full")
    assert result["calls"] == 2 * plain["calls"]  # the backward re-ran every router


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(ep=2), dict(tp=2, sp=True)], ids=["ep2", "tp2_sp"])
def test_replay_and_volatility_on_two_processes(single_process, layout):
    root, reference = single_process
    results = run_on_ranks(_record_replay, world_size=2, timeout_s=600, layout=layout, root=root)
    for rank, result in enumerate(results):
        _check(result, f"{layout} rank {rank}")
        # The same (token, layer) pairs, split over ranks: the all-reduced volatility equals
        # the single process's.
        for key, value in reference["volatility"].items():
            assert result["volatility"][key] == pytest.approx(value, abs=1e-9), (layout, key)
