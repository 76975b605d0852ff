"""Safetensors streaming: the shard writer respects its byte budget, names shards and writes an
index that the reader reads back tensor by tensor; views of shared storage are written safely;
a directory without weights and a broken index are named in the error."""

from __future__ import annotations

import json

import pytest
import torch

from gspo_megatron.checkpoint.hf_io import (HFCheckpointError, HFCheckpointReader,
                                            SafetensorsShardWriter, copy_hf_assets)


def test_writer_shards_by_budget_and_reader_streams_back(tmp_path):
    fused = torch.randn(8, 16)
    tensors = {f"w{i}": torch.randn(16, 16) for i in range(5)}  # 1024 bytes each
    tensors["gate"], tensors["up"] = fused.chunk(2)  # views of one storage
    writer = SafetensorsShardWriter(tmp_path, max_shard_bytes=2100)
    for name, t in tensors.items():
        writer.add(name, t)
    files = writer.finish()
    assert files == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert all((tmp_path / f).stat().st_size < 2100 + 1024 for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 1024 + 512
    reader = HFCheckpointReader(tmp_path)
    for name, t in tensors.items():
        assert reader.shape(name) == tuple(t.shape) and torch.equal(reader.get(name), t)
    assert reader.validate({"w0": (16, 16)}, "config.json") == sorted(set(tensors) - {"w0"})
    with pytest.raises(HFCheckpointError, match="'w0' has shape \\[16, 16\\] but cfg implies"):
        reader.validate({"w0": (16, 8)}, "cfg")
    with pytest.raises(HFCheckpointError, match="tensor 'nope' required by cfg"):
        reader.validate({"nope": (1,)}, "cfg")
    with pytest.raises(ValueError, match="'w0' written twice"):
        w = SafetensorsShardWriter(tmp_path / "again", 100)
        w.add("w0", tensors["w0"])
        w.add("w0", tensors["w0"])


def test_reader_errors_name_the_directory_or_index(tmp_path):
    with pytest.raises(HFCheckpointError, match=f"{tmp_path}: neither model.safetensors.index"):
        HFCheckpointReader(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match="model.safetensors.index.json: not a safetensors"):
        HFCheckpointReader(tmp_path)


def test_single_file_checkpoint_and_asset_copy(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": torch.ones(3)}, str(src / "model.safetensors"))
    (src / "tokenizer.json").write_text("{}")
    assert torch.equal(HFCheckpointReader(src).get("a"), torch.ones(3))
    dst = tmp_path / "dst"
    dst.mkdir()
    assert copy_hf_assets(src, dst) == ["tokenizer.json"]
    assert copy_hf_assets(None, dst) == []
