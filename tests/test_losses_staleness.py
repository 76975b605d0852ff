"""The staleness-correct (decoupled) objectives against an independent reference written here.

With stale rollouts ``old_logprobs`` are the proximal policy's and ``rollout_logprobs`` the
behaviour policy's (each token's own weight version, concatenated for a rollout continued across
weight updates); ``algo.tis`` is the behaviour weight (``docs/algorithms.md``, "Stale rollouts").
The reference below loops over sequences and tokens in float64 and writes the min of PPO's two
branches out by cases, so it shares no code with ``algorithms/losses.py``; values and autograd
gradients are compared for GSPO, GSPO-token and GRPO on mixed-version and partial sequences,
with truncation and both clip branches active, split and empty micro-batches, and (slow) a CP
rank that holds no token of a sequence.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import List, Optional

import pytest
import torch

from gspo_megatron.algorithms.losses import get_policy_loss
from gspo_megatron.algorithms.metrics import accumulate_metrics, all_reduce_metrics, metrics_to_floats
from gspo_megatron.algorithms.types import PolicyLossInputs
from gspo_megatron.config.schema import AlgorithmConfig, TISConfig

from tests.multiproc import run_on_ranks

OFF = TISConfig(mode="off")

torch.set_num_threads(1)
F64 = torch.float64
EPS = 0.05  # clip range [0.95, 1.05]: wide enough to place every ratio well inside or outside
CAP = 2.0
VERSION = 10  # the learner's version at this update
# Per sequence: length, first token's version, where the version moves up by one (a partial
# rollout continued across weight updates), the current policy's offset from the proximal one
# (placing s_i in or outside the clip range) and the advantage.
SEQS = [
    dict(n=7, v0=8, switches=[3, 5], offset=0.20, adv=1.0),    # A > 0, s > 1 + eps: clipped
    dict(n=1, v0=9, switches=[], offset=-0.20, adv=-1.0),      # A < 0, s < 1 - eps: clipped
    dict(n=12, v0=10, switches=[], offset=0.01, adv=0.5),      # on-policy tokens, inside
    dict(n=4, v0=7, switches=[2], offset=-0.15, adv=1.0),      # A > 0, s < 1 - eps: not clipped
    dict(n=9, v0=9, switches=[4], offset=0.15, adv=-1.0),      # A < 0, s > 1 + eps: not clipped
    dict(n=3, v0=6, switches=[1, 2], offset=0.0, adv=2.0),     # lag 4, 3, 2 in one sequence
    dict(n=15, v0=9, switches=[11], offset=-0.01, adv=-0.7),
    dict(n=2, v0=10, switches=[], offset=0.30, adv=-1.2),
]


def _stale_case(seed: int = 0):
    """Proximal, behaviour and current log-probs, advantages and lags of :data:`SEQS`.

    The behaviour log-prob of a token is the proximal one shifted by an offset of its weight
    version (growing with the lag) plus engine noise; sequence 3 (behaviour far below proximal,
    not clipped) has behaviour weights above the cap at either level."""
    gen = torch.Generator().manual_seed(seed)
    prox, behav, logp, versions = [], [], [], []
    for k, spec in enumerate(SEQS):
        n = spec["n"]
        version = torch.full((n,), spec["v0"], dtype=torch.int64)
        for at in spec["switches"]:
            version[at:] += 1
        lag = VERSION - version
        p = -torch.rand(n, generator=gen, dtype=F64) * 3
        shift = {int(v): 0.12 * int(v) * float(torch.randn(1, generator=gen, dtype=F64))
                 for v in lag.unique()}
        b = p + torch.tensor([shift[int(v)] for v in lag], dtype=F64) \
            + 0.01 * torch.randn(n, generator=gen, dtype=F64)
        if k == 3:
            b = p - 1.5
        prox.append(p)
        behav.append(b)
        logp.append(p + spec["offset"] + 0.01 * torch.randn(n, generator=gen, dtype=F64))
        versions.append(version)
    lengths = [s["n"] for s in SEQS]
    seq_index = torch.repeat_interleave(torch.arange(len(SEQS)), torch.tensor(lengths))
    adv = torch.tensor([s["adv"] for s in SEQS], dtype=F64)[seq_index]
    lag = VERSION - torch.cat(versions)
    return (torch.cat(logp).requires_grad_(), torch.cat(prox), torch.cat(behav), adv, lag,
            lengths)


def _inputs(logp, prox, behav, adv, lag, lengths, seq_index=None, **kw) -> PolicyLossInputs:
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    if seq_index is None:
        seq_index = torch.repeat_interleave(torch.arange(len(lengths)), lengths_t)
    return PolicyLossInputs(
        logprobs=logp, old_logprobs=prox, advantages=adv, seq_index=seq_index,
        num_seqs=len(lengths), seq_token_counts=lengths_t,
        global_num_seqs=kw.pop("global_num_seqs", len(lengths)),
        global_num_tokens=kw.pop("global_num_tokens", sum(lengths)),
        rollout_logprobs=behav, token_lag=lag, **kw)


def _cfg(loss: str, level: Optional[str], aggregation: str = "token_mean",
         cap: float = CAP, mode: str = "truncate") -> AlgorithmConfig:
    tis = OFF if level is None else TISConfig(mode=mode, level=level, cap=cap)
    return AlgorithmConfig(loss=loss, clip_eps_low=EPS, clip_eps_high=EPS, tis=tis,
                           grpo_aggregation=aggregation)


# ---- the reference: loops, float64, PPO's min written out by cases ------------------------

def _pessimistic(ratio: torch.Tensor, adv: float) -> torch.Tensor:
    """``min(ratio A, clip(ratio) A)``: the clipped branch is a constant."""
    r = float(ratio.detach())
    bound = 1.0 - EPS if r < 1.0 - EPS else 1.0 + EPS if r > 1.0 + EPS else None
    if bound is None or r * adv <= bound * adv:
        return ratio * adv
    return torch.tensor(bound * adv, dtype=F64)


def _behaviour_weights(prox: List[float], behav: List[float], level: Optional[str],
                       cap: float, mode: str = "truncate") -> List[float]:
    """Per token of one sequence: 1, or the weight of ``r = exp(mean(prox - behav))``
    (sequence) or of each ``exp(prox_t - behav_t)`` (token): ``min(r, C)`` (truncate), or ``r``
    inside ``[1/C, C]`` and 0 outside (mask)."""
    deltas = [p - b for p, b in zip(prox, behav)]
    if level is None:
        return [1.0] * len(deltas)

    def weight(r: float) -> float:
        if mode == "truncate":
            return min(r, cap)
        return r if 1.0 / cap <= r <= cap else 0.0

    if level == "sequence":
        return [weight(math.exp(sum(deltas) / len(deltas)))] * len(deltas)
    return [weight(math.exp(d)) for d in deltas]


def reference_loss(loss: str, logp: torch.Tensor, prox, behav, adv, lengths, level: Optional[str],
                   aggregation: str = "token_mean", cap: float = CAP,
                   mode: str = "truncate") -> torch.Tensor:
    """``-J`` of the decoupled objective (docs/algorithms.md), one sequence at a time.

    gspo:        J = (1/G) sum_i w_i min(s_i A_i, clip(s_i) A_i),  s_i = exp(mean_t(logp - prox))
    gspo_token:  J = (1/G) sum_i (1/|y_i|) sum_t w_t min(s_it A_t, clip(s_it) A_t),
                 s_it = sg[s_i] exp(logp_t - sg[logp_t])
    grpo:        J = (1/N) sum_t w_t min(r_t A_t, clip(r_t) A_t)  (or per sequence, then over G)
    ``gspo`` with token-level weights is defined as ``gspo_token`` with them (the code's claim)."""
    if loss == "gspo" and level == "token":
        loss = "gspo_token"
    total, start = torch.zeros((), dtype=F64), 0
    num_tokens = sum(lengths)
    for n in lengths:
        ts = range(start, start + n)
        start += n
        w = _behaviour_weights([float(prox[t]) for t in ts], [float(behav[t]) for t in ts],
                               level, cap, mode)
        log_s = sum(logp[t] - float(prox[t]) for t in ts) / n
        if loss == "gspo":
            total = total + w[0] * _pessimistic(torch.exp(log_s), float(adv[ts[0]]))
            continue
        seq = torch.zeros((), dtype=F64)
        for k, t in enumerate(ts):
            if loss == "gspo_token":
                ratio = torch.exp(log_s.detach() + logp[t] - logp[t].detach())
            else:
                ratio = torch.exp(logp[t] - float(prox[t]))
            seq = seq + w[k] * _pessimistic(ratio, float(adv[t]))
        per_token_mean = loss == "grpo" and aggregation == "token_mean"
        total = total + (seq if per_token_mean else seq / n)
    denominator = num_tokens if loss == "grpo" and aggregation == "token_mean" else len(lengths)
    return -total / denominator


CASES = [("gspo", "sequence", "token_mean"), ("gspo", "token", "token_mean"),
         ("gspo", None, "token_mean"), ("gspo_token", "sequence", "token_mean"),
         ("gspo_token", "token", "token_mean"), ("grpo", "token", "token_mean"),
         ("grpo", "token", "seq_mean_token_mean"), ("grpo", "sequence", "token_mean"),
         ("grpo", None, "seq_mean_token_mean")]


def _grad(value: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(value, leaf, retain_graph=True)
    return g


@pytest.mark.parametrize("loss,level,aggregation", CASES)
def test_decoupled_objective_matches_the_reference_in_value_and_gradient(loss, level, aggregation):
    logp, prox, behav, adv, lag, lengths = _stale_case()
    out = get_policy_loss(loss)(_inputs(logp, prox, behav, adv, lag, lengths),
                                _cfg(loss, level, aggregation))
    ref = reference_loss(loss, logp, prox, behav, adv, lengths, level, aggregation)
    assert abs(out.loss.item() - ref.item()) <= 1e-6 * (1 + abs(ref.item()))
    torch.testing.assert_close(_grad(out.loss, logp), _grad(ref, logp), rtol=2e-5, atol=1e-8)
    m = metrics_to_floats(out.metrics)
    # The case exercises what it claims: clipping and, with a weight, truncation. GSPO clips whole
    # sequences: 0 and 1 (high / low side) but not 3 and 4, which lie outside the range on the
    # side where the unclipped branch is the smaller one.
    assert 0 < m["clip_frac_token_low"] and 0 < m["clip_frac_token_high"]
    if loss != "grpo":
        g = _grad(out.loss, logp)
        starts = torch.tensor([0] + lengths).cumsum(0)
        seq_grad = [g[starts[i]:starts[i + 1]].abs().max().item() for i in range(len(lengths))]
        assert seq_grad[0] == seq_grad[1] == 0.0 and seq_grad[3] > 0 and seq_grad[4] > 0
    if level is not None:
        assert m["tis_truncated_frac"] > 0
        # The comparison above can fail: without the truncation, or without the weight, the
        # reference moves by far more than the tolerance.
        untruncated = reference_loss(loss, logp, prox, behav, adv, lengths, level, aggregation,
                                     cap=math.inf)
        unweighted = reference_loss(loss, logp, prox, behav, adv, lengths, None, aggregation)
        for other in (untruncated, unweighted):
            assert abs(other.item() - ref.item()) > 1e-4
            assert (_grad(other, logp) - _grad(ref, logp)).abs().max() > 1e-4


@pytest.mark.parametrize("loss,level,aggregation", [c for c in CASES if c[1] is not None])
def test_masked_correction_matches_the_reference_in_value_and_gradient(loss, level, aggregation):
    """``algo.tis.mode=mask`` (issue 51): weight ``r`` inside ``[1/C, C]``, 0 outside; the
    masked units still count in the normaliser (ICEPOP's objective). Sequence 3's behaviour is
    1.5 nats below its proximal log-prob on every token, so ``r = e^1.5 > C`` drops it at
    either level: its gradient is exactly 0."""
    logp, prox, behav, adv, lag, lengths = _stale_case()
    out = get_policy_loss(loss)(_inputs(logp, prox, behav, adv, lag, lengths),
                                _cfg(loss, level, aggregation, mode="mask"))
    ref = reference_loss(loss, logp, prox, behav, adv, lengths, level, aggregation, mode="mask")
    assert abs(out.loss.item() - ref.item()) <= 1e-6 * (1 + abs(ref.item()))
    grad = _grad(out.loss, logp)
    torch.testing.assert_close(grad, _grad(ref, logp), rtol=2e-5, atol=1e-8)
    m = metrics_to_floats(out.metrics)
    assert 0 < m["tis_masked_frac"] < 1 and "tis_truncated_frac" not in m
    start = sum(lengths[:3])
    assert grad[start:start + lengths[3]].abs().max().item() == 0.0
    truncated = reference_loss(loss, logp, prox, behav, adv, lengths, level, aggregation)
    assert abs(truncated.item() - ref.item()) > 1e-4  # the comparison can fail


def test_sequence_level_weight_metrics_count_each_sequence_once():
    """``tis_weight_mean`` / ``tis_truncated_frac`` at sequence level are means over sequences
    (a 15-token sequence counts as much as a 1-token one), not over their tokens."""
    logp, prox, behav, adv, lag, lengths = _stale_case()
    out = get_policy_loss("gspo")(_inputs(logp, prox, behav, adv, lag, lengths),
                                  _cfg("gspo", "sequence"))
    m = metrics_to_floats(out.metrics)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    weights = [_behaviour_weights(prox[s:s + n].tolist(), behav[s:s + n].tolist(), "sequence",
                                  CAP)[0] for s, n in zip(starts, lengths)]
    assert m["tis_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-6)
    assert m["tis_truncated_frac"] == pytest.approx(sum(w == CAP for w in weights) / len(weights))
    by_token = sum(w * n for w, n in zip(weights, lengths)) / sum(lengths)
    assert abs(by_token - m["tis_weight_mean"]) > 1e-3  # the two means differ on this case


@pytest.mark.parametrize("loss,level,aggregation", CASES)
def test_behaviour_equal_to_proximal_gives_the_plain_objective_exactly(loss, level, aggregation):
    logp, prox, _, adv, lag, lengths = _stale_case(1)
    plain = get_policy_loss(loss)(_inputs(logp, prox, None, adv, None, lengths),
                                  _cfg(loss, None, aggregation))
    weighted = get_policy_loss(loss)(_inputs(logp, prox, prox.clone(), adv, lag, lengths),
                                     _cfg(loss, level, aggregation))
    assert torch.equal(plain.loss, weighted.loss)
    assert torch.equal(_grad(plain.loss, logp), _grad(weighted.loss, logp))


def test_a_partial_rollout_is_weighted_by_its_concatenated_behaviour_logprobs():
    """Four tokens: two sampled by version V-2 (behaviour 0.3 below proximal), two by V. The
    sequence weight is exp(mean) = exp(0.15), not the unnormalised product exp(0.6) nor per-token
    weights; its gradient is exactly that multiple of the same sequence's on-policy gradient."""
    prox = torch.tensor([-1.0, -2.0, -0.5, -1.5], dtype=F64)
    behav = prox - torch.tensor([0.3, 0.3, 0.0, 0.0], dtype=F64)
    logp = (prox + 0.01).requires_grad_()
    adv = torch.ones(4, dtype=F64)
    lag = torch.tensor([2, 2, 0, 0])
    cfg = _cfg("gspo", "sequence")
    stale = get_policy_loss("gspo")(_inputs(logp, prox, behav, adv, lag, [4]), cfg)
    fresh = get_policy_loss("gspo")(_inputs(logp, prox, prox, adv, lag * 0, [4]), cfg)
    ratio = _grad(stale.loss, logp) / _grad(fresh.loss, logp)
    torch.testing.assert_close(ratio, torch.full((4,), math.exp(0.15), dtype=F64))
    assert stale.loss.item() == pytest.approx(math.exp(0.15) * fresh.loss.item(), rel=1e-6)
    assert metrics_to_floats(stale.metrics)["tis_weight_mean"] == pytest.approx(math.exp(0.15))


@pytest.mark.parametrize("loss,level", [("gspo", "sequence"), ("gspo_token", "token"),
                                        ("grpo", "token")])
def test_split_and_empty_micro_batches_sum_to_the_whole(loss, level):
    """Two micro-batches and one with no sequence at all (a short rank's padding micro-batch):
    gradients and [sum, count] metrics, lag buckets included, add up to the whole batch's."""
    logp, prox, behav, adv, lag, lengths = _stale_case(2)
    cfg = _cfg(loss, level)
    whole = get_policy_loss(loss)(_inputs(logp, prox, behav, adv, lag, lengths), cfg)
    cut_seq = 4
    cut = sum(lengths[:cut_seq])
    totals, grad, value = {}, torch.zeros_like(logp), 0.0
    for tokens, seq_lengths in ((slice(0, cut), lengths[:cut_seq]),
                                (slice(cut, None), lengths[cut_seq:]), (slice(0, 0), [])):
        inp = _inputs(logp[tokens], prox[tokens], behav[tokens], adv[tokens], lag[tokens],
                      seq_lengths, global_num_seqs=len(lengths), global_num_tokens=sum(lengths))
        out = get_policy_loss(loss)(inp, cfg)
        accumulate_metrics(totals, out.metrics)
        grad += _grad(out.loss, logp)
        value += out.loss.item()
        if not seq_lengths:
            assert out.loss.item() == 0.0 and metrics_to_floats(out.metrics) == {}
            assert set(out.metrics) == set(whole.metrics)  # the same names on every rank
    assert value == pytest.approx(whole.loss.item(), rel=1e-6)
    torch.testing.assert_close(grad, _grad(whole.loss, logp), rtol=1e-6, atol=1e-9)
    merged, alone = metrics_to_floats(totals), metrics_to_floats(whole.metrics)
    assert merged.keys() == alone.keys()
    for name, v in alone.items():
        assert merged[name] == pytest.approx(v, rel=1e-6, abs=1e-12), name


# ---- context parallelism: a rank without a single token of a sequence ---------------------

def _cp_worker(rank: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    logp, prox, behav, adv, lag, lengths = _stale_case(3)
    n = sum(lengths)
    seq_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    part = (torch.arange(n) % 2 == rank) & (seq_index != 1)
    if rank == 0:  # sequence 1 (one token) lives on rank 0 only: rank 1 has none of it
        part |= seq_index == 1
    out = {}
    for loss, level, agg in CASES:
        cfg = _cfg(loss, level, agg)
        ref = reference_loss(loss, logp, prox, behav, adv, lengths, level, agg)
        whole = metrics_to_floats(get_policy_loss(loss)(
            _inputs(logp, prox, behav, adv, lag, lengths), cfg).metrics)
        local = logp.detach()[part].clone().requires_grad_()
        inp = _inputs(local, prox[part], behav[part], adv[part], lag[part], lengths,
                      seq_index=seq_index[part], cp_group=group)
        res = get_policy_loss(loss)(inp, cfg)
        value = res.loss.detach().clone()
        dist.all_reduce(value, group=group)
        metrics = metrics_to_floats(all_reduce_metrics(accumulate_metrics({}, res.metrics), group))
        out[f"{loss}/{level}/{agg}"] = {
            "value": abs(value.item() - ref.item()),
            "grad": (_grad(res.loss, local) - _grad(ref, logp)[part]).abs().max().item(),
            "metrics": max(abs(metrics[k] - whole[k]) / (1 + abs(whole[k])) for k in whole),
            "clip_fracs_exact": all(metrics[k] == whole[k] for k in whole
                                    if k.startswith("clip_frac")),
            "same_names": metrics.keys() == whole.keys()}
    return out


@pytest.mark.slow
def test_cp2_with_a_rank_holding_no_token_of_a_sequence_matches_the_reference():
    for res in run_on_ranks(_cp_worker, world_size=2, timeout_s=120):
        for case, r in res.items():
            assert r["value"] < 1e-6 and r["grad"] < 1e-7, (case, r)
            assert r["metrics"] < 1e-6 and r["same_names"], (case, r)
            assert r["clip_fracs_exact"], (case, r)  # by lag too: counts of 0/1 are exact
