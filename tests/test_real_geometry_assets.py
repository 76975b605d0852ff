"""The asset writer on a tiny geometry with the real vocabulary and tokenizer: model/ loads in
transformers with the real tokenizer, data/ holds the questions, the directory appears whole and
is byte-identical for one seed."""

from __future__ import annotations

import pytest

from gspo_megatron.real_geometry import geometries
from gspo_megatron.real_geometry.assets import make_qwen3_assets
from tests.qwen3_assets import REAL_VOCAB, TINY, qwen3_tokenizer_dir  # noqa: F401


@pytest.fixture()
def tiny_geometry(monkeypatch, qwen3_tokenizer_dir):  # noqa: F811  (fills the tokenizer cache)
    monkeypatch.setitem(geometries.GEOMETRIES, "tiny", {**TINY, "vocab_size": REAL_VOCAB})
    return "tiny"


def _files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_writes_model_and_data_whole_and_deterministic(tmp_path, tiny_geometry):
    from transformers import AutoTokenizer

    assets = make_qwen3_assets(tmp_path / "a", geometry=tiny_geometry, num_layers=1,
                               max_shard_bytes=10**7)
    names = sorted(p.name for p in assets.model_dir.iterdir())
    assert names == ["config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    assert assets.train_path.is_file() and assets.eval_path.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no .partial left
    assert len(AutoTokenizer.from_pretrained(assets.model_dir)) == 151669
    again = make_qwen3_assets(tmp_path / "b", geometry=tiny_geometry, num_layers=1,
                              max_shard_bytes=10**7)
    assert _files(tmp_path / "a") == _files(tmp_path / "b") and again.model_dir.is_dir()


def test_existing_output_needs_overwrite(tmp_path, tiny_geometry):
    (tmp_path / "a").mkdir()
    with pytest.raises(FileExistsError, match="use --overwrite"):
        make_qwen3_assets(tmp_path / "a", geometry=tiny_geometry)
    assets = make_qwen3_assets(tmp_path / "a", geometry=tiny_geometry, overwrite=True,
                               max_shard_bytes=10**8)
    assert (assets.model_dir / "model-00001-of-00001.safetensors").is_file()
