"""The RL step against the rollout staleness k (``planner/timing.py``): hand-computed values on a
toy fleet, the order of k (0 <= 1, 2 <= 4, 1 <= 2 unless re-prefill outweighs the tail), equality
when every response is as long and the learner is the bottleneck, the tail dominating a long cap,
and the table in ``gspo-plan``'s report and in ``docs/planner.md``."""

from __future__ import annotations

import itertools
import shutil
from dataclasses import replace

import pytest

from gspo_megatron.cli.plan import main as gspo_plan
from gspo_megatron.config import load_config
from gspo_megatron.planner.hardware import Hardware
from gspo_megatron.planner.model_shape import ModelShape
from gspo_megatron.planner.plan import hardware_from_config, plain_config, plan_config
from gspo_megatron.planner.report import DOC_BEGIN, DOC_END, describe
from gspo_megatron.planner.rollout_memory import RolloutEstimate
from gspo_megatron.planner.timing import (ResponseLengths, bound_by, estimate_times,
                                          longest_response_steps, requests_in_flight_at_sync,
                                          step_seconds, steps_per_second)
from tests.test_config import REPO

TOY = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=4, head_dim=16, vocab_size=1000)
# 1 TB/s HBM at the assumed 0.6 efficiency: 0.6e12 B/s. Weights 0.6 GB: 1 ms per decode step;
# 10 kB of KV per token.
TOY_HW = Hardware(hbm_tb_per_s=1.0, bf16_tflops=100.0)
TOY_SERVER = RolloutEstimate(weights_bytes=0.6e9, kv_cache_bytes=1e9, kv_bytes_per_token=1e4,
                             max_tokens=100_000, max_sequences=100, seq_len=1200)


def toy_times(mean_frac=0.5, truncated_frac=0.2, num_seqs=80, max_tokens=1000, prompt=200,
              max_concurrency=10):
    """2 servers x TP1, 10 sequences at once each, prompts of 200 tokens, a 1,000-token cap."""
    lengths = ResponseLengths(prompt_tokens=prompt, mean_tokens=mean_frac * max_tokens,
                              max_tokens=max_tokens, truncated_frac=truncated_frac)
    server = replace(TOY_SERVER, seq_len=prompt + max_tokens)
    return estimate_times(TOY, hw=TOY_HW, learner_gpus=1, mfu=0.5, recompute="none",
                          tokens_per_step=1.0, num_seqs=num_seqs, lengths=lengths,
                          logprob_pass=False, num_servers=2, server_tp=1, rollout=server,
                          max_concurrency=max_concurrency)


def test_hand_computed_batch_times_on_a_toy_fleet():
    t = toy_times()
    # 40 sequences per server, C = 10; full step: (0.6e9 + 10 x 600 ctx x 1e4) / 0.6e12 = 1.1 ms
    assert t.concurrency == 10
    assert t.rollout_s == pytest.approx(40 * 500 * 1.1e-3 / 10)                # T_gen = 2.2 s
    assert t.rollout_tokens_per_s == pytest.approx(2 * 10 / 1.1e-3)
    # the last request is admitted after (40 - 10) x 500 x 1.1 ms / 10 = 1.65 s; the tail: 20% of
    # the last wave (2 sequences) decode 1,000 steps of (0.6e9 + 2 x 600 x 1e4) / 0.6e12 = 1.02 ms
    assert t.tail_concurrency == pytest.approx(2.0)
    assert t.rollout_batch_s == pytest.approx(1.65 + 1000 * 0.612e9 / 0.6e12)  # 2.67 s
    assert t.longest_response_s == pytest.approx(1000 * 1.1e-3)                 # servers full
    # re-prefill: 200 prompt + 500 partial tokens at 50% of 100 TFLOP/s
    a = TOY.active_params()
    flops = 700 * (2 * a + 2 * 2 * 4 * 16 * 700)
    assert t.reprefill_per_request_s == pytest.approx(flops / 0.5e14)


def test_hand_computed_steps_in_each_regime():
    t = replace(toy_times(), weight_sync_floor_s=0.1, pause_s=0.0, reprefill_per_request_s=0.01)
    batch = 1.65 + 1000 * 0.612e9 / 0.6e12
    # generation-bound (learner 1 s < T_gen 2.2 s): every server holds C = 10 at each sync
    t1 = replace(t, learner_s=1.0)
    assert step_seconds(t1, 0) == pytest.approx(batch + 1.0 + 0.1)
    assert step_seconds(t1, 1) == pytest.approx(batch + 0.1)
    assert requests_in_flight_at_sync(t1, 2) == 10
    assert step_seconds(t1, 2) == pytest.approx(2.2 + 10 * 0.01 + 0.1)         # 2.4 s
    assert step_seconds(t1, 4) == pytest.approx(2.4)
    assert bound_by(t1, 2) == "generation + re-prefill"
    assert longest_response_steps(t1, 2) == pytest.approx(1.1 / 2.4)
    assert longest_response_steps(t1, 1) == 0.0
    # learner 2.5 s: between T_gen and T_batch, only the tail (2 per server) is in flight
    t2 = replace(t, learner_s=2.5)
    assert requests_in_flight_at_sync(t2, 2) == pytest.approx(2.0)
    assert step_seconds(t2, 2) == pytest.approx(2.5 + 0.1)
    assert step_seconds(t2, 1) == pytest.approx(batch + 0.1)
    # learner 3 s: slower than the whole batch, nothing in flight, every k >= 1 the same
    t3 = replace(t, learner_s=3.0)
    assert requests_in_flight_at_sync(t3, 2) == 0
    assert [step_seconds(t3, k) for k in (1, 2, 4)] == pytest.approx([3.1] * 3)
    assert bound_by(t3, 1) == bound_by(t3, 4) == "learner"
    # a longest response of 6 s spans 2.5 steps: beyond k = 2, within k = 4; the step is the same
    t4 = replace(t1, longest_response_s=6.0)
    assert step_seconds(t4, 2) == step_seconds(t4, 4) == step_seconds(t1, 2)
    assert longest_response_steps(t4, 2) == longest_response_steps(t4, 4) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        step_seconds(t, -1)


# (mean share, share at the cap, sequences per step, learner seconds); a share at the cap above
# the mean is refused by the config
GRID = [g for g in itertools.product((0.05, 0.2, 0.5, 1.0), (0.0, 0.05, 0.5, 1.0), (5, 40, 400),
                                     (0.01, 1.0, 30.0)) if g[1] <= g[0]]


@pytest.mark.parametrize("mean, truncated, num_seqs, learner_s", GRID)
def test_more_staleness_is_never_slower_than_it_pays_for(mean, truncated, num_seqs, learner_s):
    """k = 0 <= 1 and 2 <= 4 always; 1 <= 2 unless the re-prefill outweighs the tail."""
    t = replace(toy_times(mean, truncated, num_seqs), learner_s=learner_s)
    rate = steps_per_second(t)
    assert list(rate) == [0, 1, 2, 4]
    assert rate[0] <= rate[1] and rate[2] <= rate[4]
    reprefill = requests_in_flight_at_sync(t, 2) * t.reprefill_per_request_s
    if reprefill <= t.rollout_batch_s - t.rollout_s:
        assert rate[1] <= rate[2] * (1 + 1e-12)


def test_the_grid_holds_points_on_both_sides_of_the_reprefill_condition():
    """The k = 1 <= 2 check above sits under an ``if``: the grid must take it (and leave it)
    at enough points for the check to mean something (issue 51)."""
    taken = []
    for mean, truncated, num_seqs, learner_s in GRID:
        t = replace(toy_times(mean, truncated, num_seqs), learner_s=learner_s)
        reprefill = requests_in_flight_at_sync(t, 2) * t.reprefill_per_request_s
        taken.append(reprefill <= t.rollout_batch_s - t.rollout_s)
    assert sum(taken) >= 10 and not all(taken), (sum(taken), len(taken))


def production_times(mean: float, truncated: float):
    cfg = plain_config(load_config(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml",
                                   [f"plan.mean_response_frac={mean}",
                                    f"plan.truncated_frac={truncated}"]))
    return plan_config(cfg, hardware_from_config(cfg)).times


@pytest.mark.parametrize("mean, truncated", [(0.25, 0.01), (0.25, 0.2), (0.5, 0.05), (0.5, 0.2)])
def test_production_config_is_monotonic_in_k(mean, truncated):
    """The 30B config on its 4 nodes at its assumptions (0.5, 0.05) and with longer tails."""
    rate = steps_per_second(production_times(mean, truncated))
    assert rate[0] < rate[1] <= rate[2] <= rate[4]


def test_production_config_with_responses_near_the_cap_loses_a_little_at_k2():
    """Mean 75% of the cap: eight waves of long responses leave the throughput bound no tail to
    beat, and k = 2 re-prefills 64 requests per server at every sync for nothing."""
    t = production_times(0.75, 0.05)
    tail = t.rollout_batch_s - t.rollout_s
    reprefill = t.concurrency * t.reprefill_per_request_s
    assert 0 <= tail < reprefill
    assert step_seconds(t, 2) - step_seconds(t, 1) == pytest.approx(reprefill - tail)
    assert step_seconds(t, 2) < 1.01 * step_seconds(t, 1)


def test_no_tail_and_a_slow_learner_make_every_overlap_equal():
    """Every response at the cap: the batch is its throughput-bound time; with a learner 100x
    slower, k = 1, 2, 4 all run at the learner's pace and nothing is in flight at a sync."""
    t = toy_times(mean_frac=1.0, truncated_frac=1.0)
    assert t.rollout_batch_s == pytest.approx(t.rollout_s)
    t = replace(t, learner_s=100 * t.rollout_batch_s)
    steps = [step_seconds(t, k) for k in (1, 2, 4)]
    assert steps[0] == steps[1] == steps[2] == t.learner_s + t.sync_s
    assert step_seconds(t, 0) == pytest.approx(t.rollout_s + t.learner_s + t.sync_s)


def test_no_tail_and_generation_bound_k2_pays_reprefill_for_nothing():
    t = replace(toy_times(mean_frac=1.0, truncated_frac=1.0), learner_s=0.01)
    assert step_seconds(t, 2) - step_seconds(t, 1) == pytest.approx(
        t.concurrency * t.reprefill_per_request_s)


def test_the_tail_dominates_when_the_cap_is_far_above_the_mean():
    """Mean 1% of a 100k-token cap: the batch ends with one longest response decoded alone."""
    t = toy_times(mean_frac=0.01, truncated_frac=0.001, max_tokens=100_000)
    assert t.tail_concurrency == 1.0
    tail = 100_000 * (0.6e9 + 1 * 50_100 * 1e4) / 0.6e12  # one sequence, 50,100 tokens of ctx
    assert t.rollout_batch_s > 5 * t.rollout_s and tail > 0.8 * t.rollout_batch_s
    t = replace(t, learner_s=t.rollout_s / 2)
    assert bound_by(t, 0) == "generation, then learner"
    assert bound_by(t, 1) == "generation incl. tail"
    assert step_seconds(t, 1) > 5 * step_seconds(t, 2)
    # ... but with the servers kept full that response spans ~25 steps: beyond k = 2 and 4
    assert longest_response_steps(t, 4) > 20


def test_the_report_shows_the_table_and_the_doc_is_the_tools_output(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = plain_config(load_config(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml"))
    text = describe(plan_config(cfg, hardware_from_config(cfg)), "30B")
    assert "RL steps against rollout.max_staleness (k)" in text
    assert "ASSUMED_PAUSE_PER_SYNC_S" in text and "plan.truncated_frac" in text
    for k in ("0*", "1 ", "2 ", "4 "):
        assert f"\n    {k}" in text, k
    colocated = plain_config(load_config(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml",
                                         ["rollout.mode=colocated"]))
    text = describe(plan_config(colocated, hardware_from_config(colocated)), "colocated")
    assert "\n    0*" in text and "\n    1 " not in text and "refused" in text

    # docs/planner.md's section is exactly what `gspo-plan ... --doc` writes now
    doc = REPO / "docs" / "planner.md"
    copy = tmp_path / "planner.md"
    shutil.copyfile(doc, copy)
    argv = ["configs/qwen3_30b_a3b_gspo.yaml", "--nodes", "4", "--doc", "docs/planner.md"]
    assert f"gspo-plan {' '.join(argv)}" in doc.read_text()
    assert gspo_plan(argv[:-1] + [str(copy)]) == 0
    written = copy.read_text().replace(str(copy), "docs/planner.md")
    section = written.split(DOC_BEGIN)[1].split(DOC_END)[0]
    assert section == doc.read_text().split(DOC_BEGIN)[1].split(DOC_END)[0], \
        "docs/planner.md is stale: rerun gspo-plan configs/qwen3_30b_a3b_gspo.yaml --nodes 4 " \
        "--doc docs/planner.md"
    assert "| 2 |" in section and "| **0** (config) |" in section
    capsys.readouterr()
