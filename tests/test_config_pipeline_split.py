"""Layers per pipeline stage: our pure function against Megatron-Core 0.16.1's own
(``get_num_layers_to_build`` / ``get_transformer_layer_offset``, and the refusals of
``TransformerConfig``), the suggested uneven splits, and the config keys named on refusal."""

from __future__ import annotations

import itertools

import pytest
import torch

from gspo_megatron.config import ConfigError, load_config
from gspo_megatron.config.pipeline_split import (PipelineSplitError, stage_layer_counts,
                                                 suggest_uneven_split)
from tests.test_config import REPO


def _megatron(num_layers, pp, first, last):
    """Megatron's counts and offsets, or the exception it raises."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        cfg = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                num_layers_in_first_pipeline_stage=first,
                                num_layers_in_last_pipeline_stage=last)
        counts = [get_num_layers_to_build(cfg, pp_rank=r) for r in range(pp)]
        offsets = [get_transformer_layer_offset(cfg, pp_rank=r) for r in range(pp)]
    except (ValueError, AssertionError) as exc:
        return exc
    if sum(counts) != num_layers or min(counts) < 1:
        return ValueError(f"Megatron would build {counts}")
    return counts, offsets


CASES = [(n, pp, first, last) for n, pp in [(3, 2), (4, 2), (7, 3), (94, 4), (94, 8), (12, 4)]
         for first, last in itertools.product([None, 1, 2, 11, 23], [None, 1, 2, 11, 23])]


@pytest.mark.parametrize("num_layers,pp,first,last", CASES)
def test_counts_and_offsets_match_megatron(num_layers, pp, first, last):
    expected = _megatron(num_layers, pp, first, last)
    if isinstance(expected, Exception):
        with pytest.raises(PipelineSplitError):
            stage_layer_counts(num_layers, pp, first, last)
        return
    counts = stage_layer_counts(num_layers, pp, first, last)
    offsets = [sum(counts[:stage]) for stage in range(len(counts))]  # first layer of each stage
    assert (counts, offsets) == expected


@pytest.mark.parametrize("num_layers,pp,split", [(3, 2, (1, 2)), (94, 4, (23, 23)),
                                                 (94, 8, (11, 11)), (95, 2, (47, 48)),
                                                 (48, 4, None), (5, 4, (1, 2))])
def test_suggested_uneven_split_is_buildable_and_balanced(num_layers, pp, split):
    assert suggest_uneven_split(num_layers, pp) == split
    if split:
        counts = stage_layer_counts(num_layers, pp, *split)
        assert not isinstance(_megatron(num_layers, pp, *split), Exception)
        assert max(counts) - min(counts) <= 1 or pp == 4 and num_layers == 5


def test_impossible_split_is_refused():
    with pytest.raises(PipelineSplitError, match="cannot split 3 layers over pp=4"):
        suggest_uneven_split(3, 4)


def test_config_names_the_key_and_suggests_the_split():
    base = REPO / "configs" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=r"parallel.pp: pp=2 does not divide num_layers=3.*"
                                          r"num_layers_in_first_pipeline_stage=1 "
                                          r"parallel.num_layers_in_last_pipeline_stage=2"):
        load_config(base, ["model.num_layers=3", "parallel.pp=2"])
    with pytest.raises(ConfigError, match="parallel.num_layers_in_first_pipeline_stage: .*middle"):
        load_config(base, ["model.num_layers=3", "parallel.pp=2",
                           "parallel.num_layers_in_first_pipeline_stage=2",
                           "parallel.num_layers_in_last_pipeline_stage=2"])
    with pytest.raises(ConfigError, match="parallel.vpp: virtual pipeline stages with uneven"):
        load_config(base, ["model.num_layers=4", "parallel.pp=2", "parallel.vpp=2",
                           "parallel.num_layers_in_first_pipeline_stage=2"])
    cfg = load_config(base, ["model.num_layers=3", "parallel.pp=2",
                             "parallel.num_layers_in_first_pipeline_stage=1",
                             "parallel.num_layers_in_last_pipeline_stage=2"])
    assert cfg.parallel.num_layers_in_last_pipeline_stage == 2


def test_provider_passes_the_split_to_megatron():
    from gspo_megatron.config.schema import ModelConfig, ParallelConfig
    from gspo_megatron.model.provider import build_transformer_config

    parallel = ParallelConfig(pp=2, num_layers_in_first_pipeline_stage=1,
                              num_layers_in_last_pipeline_stage=2)
    tf = build_transformer_config(ModelConfig(num_layers=3, transformer_impl="local",
                                              params_dtype="fp32"), parallel, on_gpu=False)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    assert [get_num_layers_to_build(tf, pp_rank=r) for r in (0, 1)] == [1, 2]
