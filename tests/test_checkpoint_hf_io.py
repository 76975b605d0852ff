"""Safetensors streaming: the shard writer respects its byte budget, names shards and writes an
index that the reader reads back tensor by tensor; views of shared storage are written safely;
the planned writer lays shards out first and takes tensors in any order into files safetensors
itself reads; the reader reads slices; a directory without weights and a broken index are named
in the error."""

from __future__ import annotations

import json

import pytest
import torch

from gspo_megatron.checkpoint.hf_io import (HFCheckpointError, HFCheckpointReader,
                                            PlannedShardWriter, SafetensorsShardWriter,
                                            copy_hf_assets)


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


def test_planned_writer_takes_tensors_in_any_order_into_safetensors_files(tmp_path):
    from safetensors.torch import load_file

    tensors = {f"w{i}": torch.randn(16, 16).to(torch.bfloat16) for i in range(5)}  # 512 B each
    tensors["odd"] = torch.arange(7, dtype=torch.bfloat16)  # 14 B: later offsets not 8-aligned
    fused = torch.randn(8, 16, dtype=torch.bfloat16)
    tensors["gate"], tensors["up"] = fused.chunk(2)  # views of one storage
    tensors["t"] = torch.randn(16, 4, dtype=torch.bfloat16).t()  # not contiguous
    plan = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = PlannedShardWriter(tmp_path, plan, max_shard_bytes=1100)
    assert writer.files == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    for name in reversed(list(tensors)):
        writer.add(name, tensors[name])
    assert writer.finish() == writer.files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 512 + 14 + 2 * 128 + 128
    assert index["weight_map"]["w0"] == index["weight_map"]["w1"] == writer.files[0]
    loaded = {}
    for f in writer.files:
        loaded.update(load_file(str(tmp_path / f)))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    reader = HFCheckpointReader(tmp_path)
    assert torch.equal(reader.get_slice("w3", (slice(None), slice(4, 8))), tensors["w3"][:, 4:8])


def test_planned_writer_refuses_what_was_not_planned_and_names_what_never_came(tmp_path):
    plan = [("a", (2, 2), torch.float32), ("b", (3,), torch.float32)]
    writer = PlannedShardWriter(tmp_path, plan, max_shard_bytes=10**6)
    with pytest.raises(ValueError, match="'c' is not one of the 2 planned"):
        writer.add("c", torch.zeros(1))
    with pytest.raises(ValueError, match=r"'a': \[2, 3\] torch.float32, planned \[2, 2\]"):
        writer.add("a", torch.zeros(2, 3))
    writer.add("a", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="'a' written twice"):
        writer.add("a", torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"1 planned tensors never came, e.g. \['b'\]"):
        writer.finish()
