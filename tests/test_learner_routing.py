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


# ---- R3: the rollout engine's routing, carried by the batch and replayed -----------------------

def _engine_experts(tokens: torch.Tensor, layer: int, num_experts: int = 4) -> torch.Tensor:
    """A routing that depends on the token id (so a shifted position shows): int [..., 2]."""
    first = (tokens + layer) % num_experts
    second = (first + 1 + (tokens // num_experts) % (num_experts - 1)) % num_experts
    return torch.stack([first, second], -1)


def _with_engine_routing(batch, num_layers: int = 2):
    """Every sequence's routed experts as an engine would send them: positions 0 .. len - 2."""
    batch.routed_experts = [
        torch.stack([_engine_experts(torch.as_tensor(ids)[:-1], layer) for layer in range(num_layers)],
                    1).to(torch.int16) for ids in batch.token_ids]
    batch.__post_init__()
    return batch


def _calls_follow_the_engine(learner, seen: list, batch) -> bool:
    """Router call ``k * layers + l`` of micro-batch ``k`` (this stage's ``l``-th MoE layer)
    picked, at every response position, exactly the experts the engine sent for that token and
    (global) layer."""
    layers = learner.router_layers[0]
    calls_per_mb = len(layers)
    sp = learner.cfg.parallel.tp if learner.cfg.parallel.sp else 1
    rank = learner.tp_rank if sp > 1 else 0
    mbs = learner.plan(batch).micro_batches
    if len(seen) != len(mbs) * calls_per_mb:
        return False
    for k, mb in enumerate(mbs):
        where = router_token_index(tuple(mb.tokens.shape), mb.response_positions, sp, rank)
        token = mb.tokens.reshape(-1)[mb.response_positions[_sp_mine(mb, sp, rank)]]
        for i, layer in enumerate(layers):
            used = seen[k * calls_per_mb + i][where]
            wanted = torch.zeros_like(used).scatter_(1, _engine_experts(token, layer), True)
            if not torch.equal(used, wanted):
                return False
    return True


def _sp_mine(mb, sp: int, rank: int) -> torch.Tensor:
    """Which of ``mb.response_positions`` this SP rank routes (its column shard)."""
    length = mb.tokens.shape[1]
    col = mb.response_positions % length
    return (col // (length // sp)) == rank if sp > 1 else torch.ones_like(col, dtype=torch.bool)


def _rollout_replay(rank: int, layout: dict, root: str) -> dict:
    from gspo_megatron.algorithms.losses import get_policy_loss
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner

    cfg = tiny_cfg(**layout)
    cfg.batch.max_tokens_per_micro_batch = 48  # 3 rows per micro-batch: [s, b] order matters
    learner = Learner(cfg, init_distributed(cfg.parallel, seed=3), total_steps=10)
    learner.load_weights(f"{root}/init")  # the single-process fixture's weights
    batch = _with_engine_routing(make_batch(0))
    natural = learner.compute_logprobs(batch).logprobs
    tape = learner.rollout_routing(batch)
    seen, handles = _routing_maps(learner)
    replayed = learner.compute_logprobs(batch, replay=tape).logprobs
    old_pass_exact = _calls_follow_the_engine(learner, seen, batch)
    seen.clear()
    learner.forward_backward(_with_engine_routing(make_batch(0, old=replayed)),
                             get_policy_loss("gspo"), routing=tape)
    train_pass_exact = _calls_follow_the_engine(learner, seen, batch)
    for h in handles:
        h.remove()
    router_grad, expert_grad = _grad_norms(learner)
    changed = sum(not torch.allclose(a, b, atol=1e-6) for a, b in zip(natural, replayed))
    return {"old_pass_exact": old_pass_exact, "train_pass_exact": train_pass_exact,
            "router_grad": router_grad, "expert_grad": expert_grad, "changed": changed,
            "replayed": [t.tolist() for t in replayed]}


def _check_rollout_replay(result: dict, where: str) -> None:
    assert result["old_pass_exact"] and result["train_pass_exact"], where
    assert result["router_grad"] > 0 and result["expert_grad"] > 0, where
    assert result["changed"] >= 1, f"{where}: the engine's routing changed no log-prob"


@pytest.fixture(scope="module")
def rollout_replay_one_process(single_process):
    root, _ = single_process
    return root, run_on_ranks(_rollout_replay, world_size=1, timeout_s=600, layout={}, root=root)[0]


@pytest.mark.slow
def test_rollout_routing_is_replayed_token_for_token_and_gradients_flow(rollout_replay_one_process):
    _, result = rollout_replay_one_process
    _check_rollout_replay(result, "1 process")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(ep=2), dict(tp=2, sp=True), dict(pp=2), dict(cp=2)],
                         ids=["ep2", "tp2_sp", "pp2", "cp2"])
def test_rollout_routing_replay_on_two_processes(rollout_replay_one_process, layout):
    root, reference = rollout_replay_one_process
    results = run_on_ranks(_rollout_replay, world_size=2, timeout_s=600, layout=layout, root=root)
    for rank, result in enumerate(results):
        _check_rollout_replay(result, f"{layout} rank {rank}")
        # the same routing, split over ranks, gives the single process's log-probs
        for got, want in zip(result["replayed"], reference["replayed"]):
            assert got == pytest.approx(want, abs=1e-5), (layout, rank)


def test_rollout_tape_cuts_the_engine_routing_in_router_order_per_sp_rank():
    """[R, S] rows, routing laid out like the tokens -> per layer [s * R + b] (SP: a column
    shard per rank); the filler of padding stays where the tokens' padding is."""
    from gspo_megatron.learner.batch import SequenceBatch, build_row_micro_batch
    from gspo_megatron.learner.routing import rollout_tape

    batch = _with_engine_routing(SequenceBatch(token_ids=[[5, 6, 7, 8], [9, 10, 11]],
                                               prompt_lens=[2, 1], advantages=[1.0, -1.0]))
    mb = build_row_micro_batch(batch, [0, 1], num_rows=2, row_len=4)
    assert mb.routing.shape == (2, 4, 2, 2)
    assert mb.routing[0, :3].tolist() == batch.routed_experts[0].tolist()
    assert mb.routing[1, :2].tolist() == batch.routed_experts[1].tolist()
    assert mb.routing[1, 2:].tolist() == [[[0, 1]] * 2] * 2  # last token and padding: filler
    tape = rollout_tape([mb], [[0, 1]])
    layer1 = tape.indices[0][0][1]
    assert layer1.shape == (8, 2)
    assert layer1[1 * 2 + 0].tolist() == _engine_experts(torch.tensor(6), 1).tolist()  # s1, b0
    assert layer1[1 * 2 + 1].tolist() == _engine_experts(torch.tensor(10), 1).tolist()  # s1, b1
    shard = rollout_tape([mb], [[0, 1]], sp_size=2, sp_rank=1).indices[0][0][1]
    assert torch.equal(shard, layer1[4:])  # columns 2-3 of both rows
    assert rollout_tape([mb], [[1]]).indices[0][0][0].tolist() == layer1.tolist()  # a PP stage
    with pytest.raises(RuntimeError, match="routes layer 2"):
        rollout_tape([mb], [[2]])


def test_a_batch_whose_routing_does_not_fit_its_sequences_is_refused():
    from gspo_megatron.learner.batch import SequenceBatch

    good = _with_engine_routing(SequenceBatch(token_ids=[[5, 6, 7, 8]], prompt_lens=[2],
                                              advantages=[1.0]))
    with pytest.raises(ValueError, match=r"routed_experts\[0\]: shape \(4, 2, 2\) for a sequence "
                                         r"of 4 tokens; expected \[3, layers, top_k\]"):
        SequenceBatch(token_ids=[[5, 6, 7, 8]], prompt_lens=[2], advantages=[1.0],
                      routed_experts=[torch.zeros(4, 2, 2, dtype=torch.int16)])
    with pytest.raises(ValueError, match="1 entries for 2 sequences"):
        SequenceBatch(token_ids=[[5, 6, 7, 8]] * 2, prompt_lens=[2, 2], advantages=[1.0, 1.0],
                      routed_experts=good.routed_experts)
