"""Parameter counts: the planner's per-stage, per-rank numbers equal the ``numel`` of the models
Megatron-Core builds (dense and expert parameters separately, several layouts incl. an uneven
pipeline), and the whole-model counts of Qwen3-30B-A3B / Qwen3-235B-A22B match their model cards."""

from __future__ import annotations

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.config.freeze import FREEZE_GROUPS, parameter_group
from gspo_megatron.config.schema import ModelConfig, ParallelConfig
from gspo_megatron.planner.model_shape import Layout, ModelShape, ParamCounts
from tests.multiproc import run_on_ranks
from tests.test_config import REPO

MODELS = {
    "moe": dict(arch="qwen3_moe", num_layers=3, hidden_size=32, ffn_hidden_size=64,
                num_attention_heads=4, num_query_groups=2, head_dim=8, vocab_size=90,
                make_vocab_size_divisible_by=8, num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=16),
    "dense_tied": dict(arch="qwen3", num_layers=3, hidden_size=32, ffn_hidden_size=64,
                       num_attention_heads=4, num_query_groups=2, head_dim=8, vocab_size=90,
                       make_vocab_size_divisible_by=8, num_experts=0, tie_word_embeddings=True),
}
LAYOUTS = {"tp2": dict(tp=2, sp=True), "ep2": dict(ep=2), "pp2_uneven": dict(
    pp=2, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=2),
    "tp2_etp2": dict(tp=2, sp=True, etp=2)}


def _built_counts(rank: int, cases: list) -> dict:
    from megatron.core import parallel_state as ps

    from gspo_megatron.checkpoint.convert import build_model_chunks
    from tests.test_checkpoint_convert import reinit_layout

    out = {}
    for model_name, layout_name in cases:
        parallel = ParallelConfig(**LAYOUTS[layout_name])
        reinit_layout(parallel)
        cfg = ModelConfig(**MODELS[model_name], transformer_impl="local", params_dtype="fp32")
        chunk = build_model_chunks(cfg, parallel)[0]
        dense = sum(p.numel() for n, p in chunk.named_parameters() if ".experts." not in n)
        expert = sum(p.numel() for n, p in chunk.named_parameters() if ".experts." in n)
        groups: dict = {}
        for n, p in chunk.named_parameters():
            groups[parameter_group(n)] = groups.get(parameter_group(n), 0) + p.numel()
        out[(model_name, layout_name)] = (ps.get_pipeline_model_parallel_rank(), dense, expert,
                                          groups)
    return out


@pytest.mark.slow
def test_counts_equal_the_models_megatron_builds():
    cases = [(m, lay) for m in MODELS for lay in LAYOUTS
             if MODELS[m]["num_experts"] or lay in ("tp2", "pp2_uneven")]
    results = run_on_ranks(_built_counts, world_size=2, timeout_s=600, cases=cases)
    for rank_result in results:
        for (model_name, layout_name), (stage, dense, expert, groups) in rank_result.items():
            shape = ModelShape.from_model_config(ModelConfig(**MODELS[model_name]))
            layout = Layout.from_parallel_config(ParallelConfig(**LAYOUTS[layout_name]), 2)
            counts = ParamCounts.for_stage(shape, layout, stage)
            assert (counts.dense, counts.expert) == (dense, expert), (model_name, layout_name)
            for group in FREEZE_GROUPS:  # optimizer.freeze: each group's count is exact too
                one = ParamCounts.for_stage(shape, layout, stage, frozen=[group])
                assert one.frozen_dense + one.frozen_expert == groups.get(group, 0), \
                    (model_name, layout_name, group)


def test_frozen_groups_partition_the_model():
    shape = ModelShape.from_model_config(ModelConfig(**MODELS["moe"]))
    all_frozen = ParamCounts.for_stage(shape, Layout(), 0, frozen=FREEZE_GROUPS)
    assert all_frozen.trainable == 0 and all_frozen.frozen_expert == all_frozen.expert
    parts = [ParamCounts.for_stage(shape, Layout(), 0, frozen=[g]) for g in FREEZE_GROUPS]
    assert sum(p.total - p.trainable for p in parts) == all_frozen.total
    embedding = ParamCounts.for_stage(shape, Layout(), 0, frozen=["embedding", "output_layer"])
    assert embedding.total - embedding.trainable == 2 * 96 * 32 and embedding.frozen_expert == 0


def test_single_process_counts_are_the_whole_model():
    shape = ModelShape.from_model_config(ModelConfig(**MODELS["moe"]))
    counts = ParamCounts.for_stage(shape, Layout(), 0)
    h, d = 32, 8
    per_layer = h * (4 + 4) * d + 4 * d * h + 2 * h + 2 * d + 4 * h + 4 * 3 * h * 16
    assert counts.total == 3 * per_layer + 2 * 96 * h + h  # vocab 90 padded to 96
    assert shape.total_params() == counts.total - 2 * 6 * h


@pytest.mark.parametrize("config,total,active", [("qwen3_30b_a3b_gspo.yaml", 30.5, 3.3),
                                                 ("qwen3_235b_a22b_gspo.yaml", 235.1, 22.2)])
def test_production_models_match_their_model_cards(config, total, active):
    cfg = load_config(REPO / "configs" / config)
    shape = ModelShape.from_model_config(cfg.model)
    assert shape.total_params() / 1e9 == pytest.approx(total, abs=0.1)
    assert shape.active_params() / 1e9 == pytest.approx(active, abs=0.1)
