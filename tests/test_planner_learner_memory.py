"""The learner memory estimate: Megatron's own weight + optimizer formula for dense models
(``theoretical_memory_usage.py``, transcribed here, not imported), the bytes per parameter of
each optimizer option, the recompute ordering, and peak memory measured on CPU within 15%."""

from __future__ import annotations

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.config.schema import GSPOConfig, ModelConfig
from gspo_megatron.planner.activations import MicroBatchShape
from gspo_megatron.planner.learner_memory import Workload, estimate_learner, estimate_stages
from gspo_megatron.planner.model_shape import Layout, ModelShape, ParamCounts
from gspo_megatron.planner.precision import Precision
from tests.test_config import REPO

DENSE = ModelShape(num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                   num_query_groups=8, head_dim=128, vocab_size=151936, qk_layernorm=False)


def megatron_weight_and_optimizer_bytes(shape: ModelShape, tp: int, pp: int, dp: int,
                                        distributed: bool) -> float:
    """Megatron-LM megatron/training/theoretical_memory_usage.py,
    compute_weight_and_optimizer_memory, for a dense SwiGLU RMSNorm GQA model."""
    h, a, g = shape.hidden_size, shape.num_attention_heads, shape.num_query_groups
    query_projection = shape.head_dim * a
    self_attn = 2 * h * h * ((1 + g / a) * query_projection / h)
    layer = 2 * h * (shape.ffn_hidden_size * 3 / 2 + 1) + self_attn
    embedding = h * shape.padded_vocab(tp)
    block = layer * shape.num_layers + h
    most_loaded = (block / pp + embedding) / tp
    if not shape.tie_word_embeddings and pp == 1:
        most_loaded += embedding / tp
    return most_loaded * (6 + 12 / dp if distributed else 18)


@pytest.mark.parametrize("tp,pp,dp,distributed", [(1, 1, 8, True), (2, 1, 4, True),
                                                  (4, 1, 2, False), (1, 1, 1, True)])
def test_dense_weights_and_optimizer_match_megatrons_formula(tp, pp, dp, distributed):
    layout = Layout(tp=tp, pp=pp, sp=tp > 1, world_size=tp * pp * dp)
    precision = Precision(distributed_optimizer=distributed)
    counts = ParamCounts.for_stage(DENSE, layout, 0)
    ours = counts.total * precision.bytes_per_param(layout.dense_shard_group)
    # Megatron divides the RMSNorm weights by TP; Megatron-Core replicates them on every rank.
    replicated = (2 * DENSE.num_layers + 1) * DENSE.hidden_size * (1 - 1 / tp)
    theirs = megatron_weight_and_optimizer_bytes(DENSE, tp, pp, dp, distributed) + \
        replicated * precision.bytes_per_param(layout.dense_shard_group)
    assert ours == pytest.approx(theirs, rel=1e-12)


def test_bytes_per_param_of_each_optimizer_option():
    assert Precision(distributed_optimizer=False).bytes_per_param(8) == 18  # Megatron's rule
    assert Precision().bytes_per_param(8) == 6 + 12 / 8
    cpu = GSPOConfig()
    cpu.model.params_dtype = "fp32"
    assert Precision.from_config(cpu, on_gpu=False).bytes_per_param(2) == 4 + 4 + 8 / 2
    cfg = GSPOConfig()
    cfg.optimizer.precision_aware, cfg.optimizer.moments_dtype = True, "bf16"
    assert Precision.from_config(cfg).bytes_per_param(4) == 2 + 4 + (2 + 4) / 4
    cfg.optimizer.moments_dtype, cfg.optimizer.cpu_offload = "fp32", True
    offloaded = Precision.from_config(cfg)
    assert offloaded.bytes_per_param(4) == 6 and offloaded.optimizer_bytes == 12


def _production(*overrides) -> tuple:
    cfg = load_config(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml", list(overrides))
    from gspo_megatron.planner.plan import hardware_from_config, plan_config

    return cfg, plan_config(cfg, hardware_from_config(cfg))


def test_recompute_modes_order_the_activation_memory():
    peaks = {mode: _production(f"model.recompute={mode}")[1].learner.training_bytes
             for mode in ("none", "selective", "full")}
    # Flash attention keeps no L x L scores: re-running core attention saves (almost) nothing.
    assert peaks["full"] < peaks["selective"] <= peaks["none"]
    local = {mode: _production(f"model.recompute={mode}", "model.transformer_impl=local",
                               "model.fp8.enabled=false", "optimizer.precision_aware=false",
                               "optimizer.moments_dtype=fp32")[1].learner.training_bytes
             for mode in ("none", "selective", "full")}
    assert local["full"] < local["selective"] < local["none"]


def test_cpu_offload_moves_the_optimizer_state_to_the_host():
    _, kept = _production()
    _, offloaded = _production("optimizer.cpu_offload=true", "optimizer.moments_dtype=fp32")
    state = {t.name: t.bytes for t in offloaded.learner.terms}["optimizer state"]
    assert state == 0 and offloaded.learner.host_bytes > 0
    assert offloaded.learner.peak_bytes < kept.learner.peak_bytes


def test_pipeline_first_stage_holds_more_micro_batches_in_flight():
    shape = ModelShape.from_model_config(ModelConfig(num_layers=8, hidden_size=256,
                                                     num_experts=0, arch="qwen3"))
    layout = Layout(pp=4, world_size=4)
    work = Workload(MicroBatchShape(4096, 1024, 3000), num_micro_batches=8, recompute="none")
    stages = estimate_stages(shape, layout, Precision(), work)
    acts = [next(t.bytes for t in s.terms if t.name.startswith("activations")) for s in stages]
    assert acts[0] == 4 * acts[3] and acts[1] == 3 * acts[3]
    assert estimate_learner(shape, layout, Precision(), work).stage in (0, 3)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["moe_tiny/1proc", "dense_small/pp2"])
def test_estimate_within_15_percent_of_measured_cpu_peak(case):
    from benchmarks.bench_planner_memory import compare

    result = compare(case)
    for rank in result["ranks"]:
        assert abs(rank["error"]) < 0.15, (case, rank)
