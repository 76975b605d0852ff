"""Checkpoint metadata back to typed configs, refusing an existing target, and the
write-then-rename directory that replaces an old output only once the new one is complete."""

from __future__ import annotations

import dataclasses

import pytest

from gspo_megatron.checkpoint.meta import (TargetExistsError, check_target, model_config_from_meta,
                                           partial_dir, publish)
from gspo_megatron.config.schema import FP8Config, ModelConfig, ParallelConfig


def test_meta_round_trips_to_dataclasses():
    model = ModelConfig(arch="qwen3", num_layers=3, fp8=FP8Config(enabled=True))
    meta = {"model": dataclasses.asdict(model), "parallel": dataclasses.asdict(ParallelConfig(tp=2))}
    assert model_config_from_meta(meta) == model


def test_partial_then_publish_replaces_old_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(TargetExistsError, match=f"{out}: already exists"):
        check_target(out, overwrite=False)
    assert check_target(out, overwrite=True) == out
    tmp = partial_dir(out)
    assert tmp.name == "out.partial" and not any(tmp.iterdir())
    (tmp / "new").write_text("new")
    publish(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert not tmp.exists() and not (tmp_path / "out.old").exists()
