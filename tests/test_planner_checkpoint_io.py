"""The checkpoint of a layout (``planner/checkpoint_io.py``): the production config's numbers
against a count by hand, the preemption budget and the disk, the warnings config loading logs,
and ``gspo-plan --checkpoint-doc``."""

from __future__ import annotations

import logging

import pytest

from gspo_megatron.planner.checkpoint_io import (DOC_BEGIN, DOC_END, BudgetCheck,
                                                 checkpoint_report, plan_checkpoint)
from gspo_megatron.planner.model_shape import Layout, ModelShape
from gspo_megatron.planner.precision import Precision
from tests.test_config import REPO

QWEN3_30B = ModelShape(num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
                       num_attention_heads=32, num_query_groups=4, head_dim=128,
                       vocab_size=151936, num_experts=128, moe_router_topk=8,
                       moe_ffn_hidden_size=768)
PRODUCTION = Layout(tp=2, ep=8, etp=1, sp=True, world_size=16)


def test_the_production_checkpoint_against_a_count_by_hand():
    """Issue 49's figures: 30.5 B parameters x (2 bytes of bf16 weights + 12 of fp32 main
    weights and moments) = 427 GB; in the fast form each of 16 ranks writes 1/16 of it, each
    of 2 nodes half, ~53 GB is what the portable form gathered on every rank."""
    precision = Precision(param_bytes=2, main_param_bytes=2, moment_bytes=4)  # precision-aware
    plan = plan_checkpoint(QWEN3_30B, PRODUCTION, precision, nodes=2, write_gbps=2.0,
                           keep_last=3)
    params = QWEN3_30B.total_params() + 2 * 2048 * (QWEN3_30B.padded_vocab(1) - 151936)
    assert 30.4e9 < params < 30.6e9
    assert plan.checkpoint_bytes == pytest.approx(params * 14, rel=1e-6)
    assert plan.checkpoint_bytes / 1e9 == pytest.approx(427, abs=1)
    assert plan.rank_write_bytes == pytest.approx(plan.checkpoint_bytes / 16)
    assert plan.node_write_bytes == pytest.approx(plan.checkpoint_bytes / 2)
    assert plan.save_s == pytest.approx(plan.checkpoint_bytes / 2 / 2e9)
    assert plan.portable_rank_gather_bytes / 1e9 == pytest.approx(53, abs=1)
    # a save's host memory is one tensor: the fp32 main weight of the embedding's TP2 shard,
    # which fits whole in a rank's optimizer shard (1.4 B parameters)
    assert plan.rank_save_extra_bytes == pytest.approx(151936 * 2048 / 2 * 4, rel=1e-3)
    assert plan.rank_save_extra_bytes <= 1.25 * plan.rank_optimizer_shard_bytes
    # the precision-aware optimizer's shard, unscaled to fp32 for the save, on the GPU
    assert plan.rank_save_extra_gpu_bytes == pytest.approx(
        plan.rank_optimizer_shard_bytes / precision.optimizer_bytes * 12)
    assert plan.keep_bytes == pytest.approx(4 * plan.checkpoint_bytes)
    plain = plan_checkpoint(QWEN3_30B, PRODUCTION, Precision(), nodes=2, write_gbps=2.0,
                            keep_last=3)
    assert plain.checkpoint_bytes == plan.checkpoint_bytes and plain.rank_save_extra_gpu_bytes == 0


def test_the_budget_says_what_to_change():
    assert BudgetCheck(900, 492, 107).fits and BudgetCheck(900, 492, 107).problem() is None
    problem = BudgetCheck(600, 492, 107).problem()
    assert "launch.warning_lead_s=600 leaves 540s" in problem and "~599s" in problem
    assert "--signal=B:USR1@N" in problem


def test_config_loading_warns_of_a_short_lead_and_a_small_disk(caplog, monkeypatch, tmp_path):
    from gspo_megatron.config import load_config
    from gspo_megatron.planner import checkpoint_io
    from gspo_megatron.planner.fit_check import check_fit

    monkeypatch.setattr(checkpoint_io, "free_bytes", lambda _: 100e9)
    cfg = load_config(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml",
                      [f"logging.run_dir={tmp_path}/run"])
    with caplog.at_level(logging.WARNING, logger="gspo_megatron.planner.fit_check"):
        check_fit(cfg)
    assert "warning_lead_s" not in caplog.text  # the production config leaves room
    assert "checkpoint.keep_last=3: 3 + 1 checkpoints of ~427 GB need 1710 GB, 100 GB are free" \
        in caplog.text
    caplog.clear()
    cfg.launch.warning_lead_s = 600
    with caplog.at_level(logging.WARNING, logger="gspo_megatron.planner.fit_check"):
        check_fit(cfg)
    assert "launch.warning_lead_s=600 leaves 540s before the learner's deadline" in caplog.text


def test_the_report_and_the_doc_section(tmp_path):
    from gspo_megatron.cli.plan import main
    from gspo_megatron.config import load_config
    from gspo_megatron.planner.plan import hardware_from_config, plan_config

    cfg = load_config(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml")
    ckpt, budget, _, where = checkpoint_report(plan_config(cfg, hardware_from_config(cfg)), cfg)
    assert budget.lead_s == 900 and budget.fits and where.endswith("checkpoints")
    doc = tmp_path / "cluster.md"
    doc.write_text(f"before\n{DOC_BEGIN}\nold\n{DOC_END}\nafter\n")
    assert main([str(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml"), "--checkpoint-doc",
                 str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| checkpoint (weights + fp32 main weights and Adam moments) | 427 GB |" in text
    doc.write_text("no markers\n")
    assert main([str(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml"), "--checkpoint-doc",
                 str(doc)]) == 2
