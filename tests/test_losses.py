"""Policy losses: GSPO's Eq. 10 gradient, GSPO-token == GSPO, clipping <=> zero gradient, GRPO
aggregations, KL / entropy / TIS options, metrics, errors, and (slow) CP=2 against one rank; the
SFT loss's token mean over the whole mini-batch, split-invariant."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from gspo_megatron.algorithms.logprobs import vocab_parallel_logprobs_entropy
from gspo_megatron.algorithms.losses import get_policy_loss, register_policy_loss
from gspo_megatron.algorithms.metrics import accumulate_metrics, all_reduce_metrics, metrics_to_floats
from gspo_megatron.algorithms.types import PolicyLossInputs
from gspo_megatron.config.schema import AlgorithmConfig, TISConfig

from tests.multiproc import run_on_ranks

OFF = TISConfig(mode="off")  # no importance correction (the losses see a resolved config)

torch.set_num_threads(1)
LENGTHS = [3, 1, 5, 2]


def _inputs(logprobs, old, adv_seq, lengths=LENGTHS, **extra) -> PolicyLossInputs:
    lengths_t = torch.tensor(lengths)
    seq_index = torch.repeat_interleave(torch.arange(len(lengths)), lengths_t)
    adv = extra.pop("advantages", torch.as_tensor(adv_seq, dtype=torch.float32)[seq_index])
    return PolicyLossInputs(logprobs=logprobs, old_logprobs=old, advantages=adv,
                            seq_index=seq_index, num_seqs=len(lengths), seq_token_counts=lengths_t,
                            global_num_seqs=len(lengths), global_num_tokens=sum(lengths), **extra)


def _random(seed: int, noise: float, n: int = sum(LENGTHS)):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=gen) * 3
    logp = (old + noise * torch.randn(n, generator=gen)).requires_grad_()
    return logp, old


def _grad(out, logp):
    (g,) = torch.autograd.grad(out.loss, logp)
    return g


def test_registry_selects_by_name_and_lists_names_on_error():
    assert get_policy_loss("gspo") is not get_policy_loss("grpo")
    with pytest.raises(ValueError, match="registered: grpo, gspo, gspo_token, sft"):
        get_policy_loss("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("gspo")(lambda inputs, cfg: None)


def test_gspo_gradient_is_paper_eq10_through_a_model():
    """grad = -(1/G) sum_i s_i A_i (1/|y_i|) sum_t grad log pi(y_t)  (loss = -J), unclipped."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(11, 6, generator=gen), torch.randn(6, 9, generator=gen)
    weight.requires_grad_()
    targets = torch.randint(0, 9, (11,), generator=gen)
    logp, _ = vocab_parallel_logprobs_entropy(hidden @ weight, targets, compute_entropy=False)
    old = logp.detach() + 0.05 * torch.randn(11, generator=gen)
    adv = [1.0, -0.5, 2.0, -1.5]
    cfg = AlgorithmConfig(tis=OFF, loss="gspo", clip_eps_low=0.9, clip_eps_high=10.0)
    inputs = _inputs(logp, old, adv)
    (grad,) = torch.autograd.grad(get_policy_loss("gspo")(inputs, cfg).loss, weight, retain_graph=True)
    lengths = torch.tensor(LENGTHS, dtype=torch.float32)
    s = torch.exp(torch.zeros(4).index_add(0, inputs.seq_index, logp.detach() - old) / lengths)
    coef = -(s * torch.tensor(adv) / lengths / 4)[inputs.seq_index]
    (closed,) = torch.autograd.grad((coef * logp).sum(), weight)
    torch.testing.assert_close(grad, closed, atol=1e-6, rtol=1e-5)
    assert grad.abs().max() > 1e-3


def test_gspo_token_equals_gspo_in_value_clipping_and_gradient():
    logp, old = _random(1, noise=0.02)
    adv = [1.0, -1.0, 0.7, -0.3]
    cfg = AlgorithmConfig(tis=OFF, clip_eps_low=3e-3, clip_eps_high=4e-3)
    for tis in (OFF, TISConfig(mode="truncate", level="token", cap=1.02),
                TISConfig(mode="truncate", level="sequence", cap=2.0)):
        c = replace(cfg, tis=tis)
        rollout = old + 0.03 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9))
        seq = get_policy_loss("gspo")(_inputs(logp, old, adv, rollout_logprobs=rollout), c)
        tok = get_policy_loss("gspo_token")(_inputs(logp, old, adv, rollout_logprobs=rollout), c)
        torch.testing.assert_close(seq.loss, tok.loss, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(_grad(seq, logp), _grad(tok, logp), atol=1e-7, rtol=1e-6)
        fs, ft = metrics_to_floats(seq.metrics), metrics_to_floats(tok.metrics)
        for name in ("clip_frac_token_low", "clip_frac_token_high", "clip_frac_seq", "ratio_mean",
                     "ratio_max", "pg_loss"):
            assert fs[name] == pytest.approx(ft[name], rel=1e-6, abs=1e-9), name
    assert 0 < fs["clip_frac_seq"] < 1  # the case did exercise clipping


def test_zero_gradient_exactly_when_the_sequence_is_clipped():
    # One token per sequence so each ratio is set directly: s = exp(logp - old).
    log_s = torch.tensor([0.01, 0.01, -0.01, -0.01, 0.0001, -0.0001])
    adv = [1.0, -1.0, -1.0, 1.0, 1.0, -1.0]  # clipped: high (A>0, s>1+eh), low (A<0, s<1-el)
    old = torch.full((6,), -1.0)
    logp = (old + log_s).requires_grad_()
    out = get_policy_loss("gspo")(_inputs(logp, old, adv, lengths=[1] * 6),
                                  AlgorithmConfig(tis=OFF))
    grad = _grad(out, logp)
    clipped = torch.tensor([True, False, True, False, False, False])
    assert bool((grad[clipped] == 0).all()) and bool((grad[~clipped] != 0).all())
    m = metrics_to_floats(out.metrics)
    assert m["clip_frac_token_high"] == pytest.approx(1 / 6)
    assert m["clip_frac_token_low"] == pytest.approx(1 / 6)  # the low side is really counted
    assert m["clip_frac_seq"] == pytest.approx(2 / 6)


def test_on_policy_every_ratio_is_one_and_nothing_is_clipped():
    logp, _ = _random(2, noise=0.0)
    for name in ("gspo", "gspo_token", "grpo"):
        out = get_policy_loss(name)(_inputs(logp, logp.detach().clone(), [1.0, -2.0, 0.5, -0.1]),
                                    AlgorithmConfig(tis=OFF, loss=name))
        m = metrics_to_floats(out.metrics)
        assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["clip_frac_token"] == 0.0
        assert m["clip_frac_seq"] == 0.0 and m["approx_kl"] == 0.0
        assert bool((_grad(out, logp) != 0).all())


def test_approx_kl_is_k3_of_kl_old_new_and_every_loss_reports_length_diagnostics():
    old = torch.full((6,), -1.0)
    delta = torch.tensor([0.3, -0.2, 0.1, 0.0, -0.5, 0.4])
    for name in ("gspo", "gspo_token", "grpo"):
        out = get_policy_loss(name)(_inputs((old + delta).requires_grad_(), old, [1.0, -1.0],
                                            lengths=[2, 4]), AlgorithmConfig(tis=OFF, loss=name))
        m = metrics_to_floats(out.metrics)
        # KL(old || new) from samples of pi_old: E[r - 1 - log r], r = pi_new / pi_old.
        assert m["approx_kl"] == pytest.approx(float((delta.exp() - 1 - delta).mean())), name
        assert m["len_le256/seq_frac"] == 1.0 and m["len_gt4096/seq_frac"] == 0.0, name
        assert m["seq_log_ratio_max"] == pytest.approx(0.05), name  # mean(0.3, -0.2)


def test_sequence_ratio_is_a_length_normalised_mean_not_a_sum():
    n = 1000
    old = torch.full((n,), -2.0)
    logp = (old + 0.01).requires_grad_()
    out = get_policy_loss("gspo")(_inputs(logp, old, [1.0], lengths=[n]),
                                  AlgorithmConfig(tis=OFF, clip_eps_high=1.0))
    assert metrics_to_floats(out.metrics)["ratio_mean"] == pytest.approx(math.exp(0.01), rel=1e-5)


def test_grpo_aggregations_and_token_clipping():
    logp, old = _random(3, noise=0.3)
    adv = [1.0, -1.0, 0.5, -2.0]
    inputs = _inputs(logp, old, adv)
    ratio = torch.exp(logp.detach() - old)
    a = inputs.advantages
    obj = torch.minimum(ratio * a, ratio.clamp(0.8, 1.27) * a)
    lengths = inputs.seq_token_counts.float()[inputs.seq_index]
    expected = {"token_mean": -obj.sum() / 11, "seq_mean_token_mean": -(obj / lengths).sum() / 4}
    for agg, value in expected.items():
        cfg = AlgorithmConfig(tis=OFF, loss="grpo", clip_eps_low=0.2, clip_eps_high=0.27,
                              grpo_aggregation=agg)
        out = get_policy_loss("grpo")(inputs, cfg)
        torch.testing.assert_close(out.loss.detach(), value)
        clipped = ((a > 0) & (ratio > 1.27)) | ((a < 0) & (ratio < 0.8))
        grad = _grad(out, logp)
        assert bool((grad[clipped] == 0).all()) and bool((grad[~clipped] != 0).all())
        assert metrics_to_floats(out.metrics)["clip_frac_token"] == pytest.approx(
            clipped.float().mean().item())
    with pytest.raises(ValueError, match="grpo_aggregation"):
        get_policy_loss("grpo")(inputs, AlgorithmConfig(tis=OFF, loss="grpo",
                                                        grpo_aggregation="sum"))


def test_kl_and_entropy_terms_are_sequence_mean_token_mean_for_gspo():
    logp, old = _random(4, noise=0.0)
    entropy = torch.rand(11, generator=torch.Generator().manual_seed(5)).requires_grad_()
    ref = old - 0.2
    inputs = _inputs(logp, old, [0.0] * 4, entropy=entropy, ref_logprobs=ref)
    cfg = AlgorithmConfig(tis=OFF, kl_coef=0.1, entropy_coef=0.01)
    out = get_policy_loss("gspo")(inputs, cfg)
    lengths = inputs.seq_token_counts.float()[inputs.seq_index]
    k3 = torch.exp(ref - logp.detach()) - (ref - logp.detach()) - 1
    expected = ((0.1 * k3 - 0.01 * entropy.detach()) / lengths).sum() / 4
    torch.testing.assert_close(out.loss.detach(), expected)
    g_ent = torch.autograd.grad(out.loss, entropy)[0]
    torch.testing.assert_close(g_ent, -0.01 / lengths / 4)
    assert metrics_to_floats(out.metrics)["kl_ref"] == pytest.approx(k3.mean().item(), rel=1e-6)


def test_tis_truncates_and_mismatch_is_reported():
    logp, old = _random(6, noise=0.0)
    rollout = old.clone()
    rollout[0] -= 2.0  # pi_old / pi_rollout = e^2 > cap 2 for token 0
    inputs = _inputs(logp, old, [1.0, 1.0, 1.0, 1.0], rollout_logprobs=rollout)
    cfg = AlgorithmConfig(loss="grpo", tis=TISConfig(mode="truncate", level="token", cap=2.0))
    out = get_policy_loss("grpo")(inputs, cfg)
    grad = _grad(out, logp)
    torch.testing.assert_close(grad[0], 2.0 * grad[1])  # same ratio and advantage, weight 2 vs 1
    m = metrics_to_floats(out.metrics)
    assert m["tis_truncated_frac"] == pytest.approx(1 / 11)
    assert m["mismatch_token_abs_max"] == pytest.approx(2.0)
    assert m["mismatch_token_abs_mean"] == pytest.approx(2.0 / 11)
    assert m["mismatch_seq_abs_max"] == pytest.approx(2.0 / 3)
    # Issue 51's diagnostics, over the 4 sequences (lengths 3, 1, 5, 2; only token 0 differs):
    assert m["mismatch_seq_token_abs_mean"] == pytest.approx((2.0 / 3) / 4)
    assert m["mismatch_seq_token_abs_max_mean"] == pytest.approx(2.0 / 4)
    assert m["mismatch_kl"] == pytest.approx((math.exp(2.0) - 1.0 - 2.0) / 11)
    assert m["mismatch_chi2_token"] == pytest.approx((math.exp(2.0) - 1.0) ** 2 / 11)
    assert m["mismatch_chi2_seq"] == pytest.approx((math.exp(2.0 / 3) - 1.0) ** 2 / 4)


def test_micro_batches_sum_to_the_mini_batch_gradient():
    logp, old = _random(7, noise=0.01)
    adv = [1.0, -1.0, 0.5, -0.2]
    for name in ("gspo", "gspo_token", "grpo"):
        cfg = AlgorithmConfig(tis=OFF, loss=name, clip_eps_low=0.005, clip_eps_high=0.005)
        whole = _grad(get_policy_loss(name)(_inputs(logp, old, adv), cfg), logp)
        parts, totals = [], {}
        for seqs, tokens in (([0, 1], slice(0, 4)), ([2, 3], slice(4, 11))):
            inp = _inputs(logp[tokens], old[tokens], [adv[i] for i in seqs],
                          lengths=[LENGTHS[i] for i in seqs])
            inp = replace(inp, global_num_seqs=4, global_num_tokens=11)
            out = get_policy_loss(name)(inp, cfg)
            accumulate_metrics(totals, out.metrics)
            parts.append(_grad(out, logp))
        torch.testing.assert_close(parts[0] + parts[1], whole)
        assert metrics_to_floats(totals)["ratio_max"] >= metrics_to_floats(totals)["ratio_min"]


def test_bad_inputs_raise_clear_errors():
    logp, old = _random(8, noise=0.0)
    adv = torch.arange(11.0)
    with pytest.raises(ValueError, match="advantages vary within sequence 2.*gspo_token"):
        get_policy_loss("gspo")(_inputs(logp, old, [0.0] * 4, advantages=adv),
                                AlgorithmConfig(tis=OFF))
    bad = old.clone()
    bad[5] = float("nan")
    with pytest.raises(ValueError, match="old_logprobs is not finite at token 5"):
        get_policy_loss("grpo")(_inputs(logp, bad, [1.0] * 4), AlgorithmConfig(tis=OFF))
    with pytest.raises(ValueError, match="kl_coef > 0 needs"):
        get_policy_loss("gspo")(_inputs(logp, old, [1.0] * 4),
                                AlgorithmConfig(tis=OFF, kl_coef=0.1))
    with pytest.raises(ValueError, match="sequence 0 has 3 tokens here but seq_token_counts says 4"):
        get_policy_loss("gspo")(replace(_inputs(logp, old, [1.0] * 4),
                                        seq_token_counts=torch.tensor([4, 1, 5, 2])),
                                AlgorithmConfig(tis=OFF))


def _cp_worker(rank: int) -> dict:
    """Each sequence split over 2 CP ranks; values summed over ranks and local gradients vs one
    rank, then the metrics all-reduced over the group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    logp_all, old = _random(10, noise=0.01)
    adv = [1.0, -1.0, 0.6, -0.4]
    part = torch.tensor([0, 1, 1, 0, 1, 1, 0, 0, 1, 0, 1]) == rank
    out = {}
    for name in ("gspo", "gspo_token", "grpo"):
        cfg = AlgorithmConfig(loss=name, clip_eps_low=0.004, clip_eps_high=0.004,
                              grpo_aggregation="seq_mean_token_mean", tis=OFF)
        whole_in = _inputs(logp_all, old, adv)
        whole = get_policy_loss(name)(whole_in, cfg)
        whole_grad = _grad(whole, logp_all)
        local = logp_all.detach()[part].clone().requires_grad_()
        inp = replace(whole_in, logprobs=local, old_logprobs=old[part],
                      advantages=whole_in.advantages[part], seq_index=whole_in.seq_index[part],
                      cp_group=group)
        res = get_policy_loss(name)(inp, cfg)
        value = res.loss.detach().clone()
        dist.all_reduce(value, group=group)
        metrics = all_reduce_metrics(accumulate_metrics({}, res.metrics), group)
        fm, fw = metrics_to_floats(metrics), metrics_to_floats(whole.metrics)
        out[name] = {"value": abs(value.item() - whole.loss.item()),
                     "grad": (_grad(res, local) - whole_grad[part]).abs().max().item(),
                     "ratio": [fm[k] - fw[k] for k in ("ratio_mean", "ratio_min", "ratio_max")],
                     "clip": fm["clip_frac_token"] - fw["clip_frac_token"],
                     "by_length": max(abs(fm[k] - fw[k]) for k in fw
                                      if k.startswith(("len_", "seq_log_ratio"))),
                     "clipped_any": fw["clip_frac_seq"]}
    try:
        all_reduce_metrics({f"only_on_rank_{rank}": torch.zeros(2, dtype=torch.float64)}, group)
        out["mismatch_refused"] = False
    except RuntimeError:
        out["mismatch_refused"] = True
    return out


@pytest.mark.slow
def test_cp2_split_sequences_equal_single_rank():
    for res in run_on_ranks(_cp_worker, world_size=2, timeout_s=120):
        assert res.pop("mismatch_refused")
        for name, r in res.items():
            assert r["value"] < 1e-6 and r["grad"] < 1e-6, (name, r)
            assert max(abs(d) for d in r["ratio"]) < 1e-6 and abs(r["clip"]) < 1e-9, (name, r)
            assert r["by_length"] < 1e-6, (name, r)
        assert 0 < res["gspo"]["clipped_any"] < 1


def _sft_inputs(lp: torch.Tensor, seq_index: torch.Tensor, total_tokens: int) -> PolicyLossInputs:
    num_seqs = int(seq_index.max()) + 1
    return PolicyLossInputs(logprobs=lp, old_logprobs=lp.detach(), advantages=torch.zeros_like(lp),
                            seq_index=seq_index, num_seqs=num_seqs,
                            seq_token_counts=torch.bincount(seq_index, minlength=num_seqs),
                            global_num_seqs=3, global_num_tokens=total_tokens)


def test_sft_split_micro_batches_sum_to_the_whole_batch_loss_and_gradient():
    sft = get_policy_loss("sft")
    lp = -torch.rand(10, dtype=torch.float64) * 3
    whole_lp = lp.clone().requires_grad_(True)
    whole = sft(_sft_inputs(whole_lp, torch.tensor([0] * 4 + [1] * 3 + [2] * 3), 10))
    whole.loss.backward()
    parts_lp = lp.clone().requires_grad_(True)
    a = sft(_sft_inputs(parts_lp[:4], torch.zeros(4, dtype=torch.int64), 10))
    b = sft(_sft_inputs(parts_lp[4:], torch.tensor([0] * 3 + [1] * 3), 10))
    (a.loss + b.loss).backward()
    assert float(whole.loss) == pytest.approx(float(-lp.mean()))
    assert float(a.loss + b.loss) == pytest.approx(float(whole.loss))
    assert torch.allclose(parts_lp.grad, whole_lp.grad)
    assert torch.allclose(whole_lp.grad, torch.full((10,), -0.1, dtype=torch.float64))
    merged = metrics_to_floats(accumulate_metrics(accumulate_metrics({}, a.metrics), b.metrics))
    assert merged["sft_nll"] == pytest.approx(float(-lp.mean()))


def test_sft_refuses_an_empty_mini_batch():
    with pytest.raises(ValueError, match="global_num_tokens must be > 0"):
        get_policy_loss("sft")(_sft_inputs(torch.zeros(1), torch.zeros(1, dtype=torch.int64), 0))
