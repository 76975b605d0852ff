"""Stream Hugging Face safetensors checkpoints in and out, one tensor at a time.

:class:`HFCheckpointReader` opens the shards listed in ``model.safetensors.index.json`` (or a
single ``model.safetensors``) lazily with ``safe_open`` and reads one tensor per call, so host
memory never holds more than the tensor being converted. It checks, before any weight is read,
that every shard exists and parses and that every tensor the config implies is present with the
right shape; each failure names the file and key.

:class:`SafetensorsShardWriter` fills shards up to a byte budget and writes the index at the end,
so its writer holds at most one shard in memory. :class:`PlannedShardWriter` lays the shards out
from the list of tensors to come (names, shapes, dtype) and writes each tensor into its place the
moment it arrives, in any order, so it holds nothing: export uses it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files copied next to the weights so that the exported directory is a complete HF model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that is missing, damaged, or does not match its config."""


class HFCheckpointReader:
    """Lazy, per-tensor access to a (sharded) safetensors checkpoint directory."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        self._handles: Dict[str, object] = {}
        self.weight_map = self._read_weight_map()
        missing = sorted({f for f in self.weight_map.values() if not (self.dir / f).is_file()})
        if missing:
            example = next(k for k, f in self.weight_map.items() if f == missing[0])
            raise HFCheckpointError(f"{self.dir / missing[0]}: shard listed in {INDEX_FILE} is "
                                    f"missing (it holds '{example}' and others)")

    def _read_weight_map(self) -> Dict[str, str]:
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                return dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise HFCheckpointError(f"{index}: not a safetensors index ({exc})") from None
        single = self.dir / SINGLE_FILE
        if single.is_file():
            return {k: SINGLE_FILE for k in self._open(SINGLE_FILE).keys()}
        raise HFCheckpointError(f"{self.dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")

    def _open(self, filename: str):
        if filename not in self._handles:
            from safetensors import safe_open

            path = self.dir / filename
            try:
                self._handles[filename] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for bad headers
                raise HFCheckpointError(f"{path}: cannot read safetensors file ({exc})") from None
        return self._handles[filename]

    def file_of(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise HFCheckpointError(f"{self.dir}: tensor '{name}' is not in the checkpoint") from None

    def shape(self, name: str) -> Tuple[int, ...]:
        filename = self.file_of(name)
        try:
            return tuple(self._open(filename).get_slice(name).get_shape())
        except HFCheckpointError:
            raise
        except Exception as exc:
            raise HFCheckpointError(f"{self.dir / filename}: tensor '{name}': {exc}") from None

    def get(self, name: str) -> torch.Tensor:
        filename = self.file_of(name)
        try:
            return self._open(filename).get_tensor(name)
        except HFCheckpointError:
            raise
        except Exception as exc:
            raise HFCheckpointError(f"{self.dir / filename}: cannot read tensor '{name}' "
                                    f"({exc})") from None

    def get_slice(self, name: str, index: Tuple[slice, ...]) -> torch.Tensor:
        """``tensor[index]`` read from the file without reading the rest of the tensor."""
        filename = self.file_of(name)
        try:
            return self._open(filename).get_slice(name)[index]
        except HFCheckpointError:
            raise
        except Exception as exc:
            raise HFCheckpointError(f"{self.dir / filename}: cannot read tensor '{name}' "
                                    f"({exc})") from None

    def check_files(self) -> None:
        """Every shard opens and is as long as its header says (a truncated file is named)."""
        for filename in sorted(set(self.weight_map.values())):
            self._check_file_size(filename)

    def validate(self, expected: Dict[str, Tuple[int, ...]], config_file: str) -> List[str]:
        """Check files, names and shapes against the config; return the unused keys."""
        self.check_files()
        for name, shape in expected.items():
            if name not in self.weight_map:
                raise HFCheckpointError(f"{self.dir}: tensor '{name}' required by {config_file} "
                                        "is not in the checkpoint")
            got = self.shape(name)
            if got != tuple(shape):
                raise HFCheckpointError(
                    f"{self.dir / self.weight_map[name]}: tensor '{name}' has shape {list(got)} "
                    f"but {config_file} implies {list(shape)}")
        return sorted(set(self.weight_map) - set(expected))

    def _check_file_size(self, filename: str) -> None:
        """A truncated file can still have a readable header; compare data end and file size."""
        path = self.dir / filename
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFCheckpointError(f"{path}: truncated safetensors file (no header)")
            header_len = int.from_bytes(head, "little")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise HFCheckpointError(f"{path}: truncated or corrupt safetensors header") from None
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        need = 8 + header_len + max(ends, default=0)
        have = path.stat().st_size
        if have < need:
            raise HFCheckpointError(f"{path}: truncated safetensors file ({have} bytes, "
                                    f"header needs {need})")
        self._open(filename)


class SafetensorsShardWriter:
    """Append tensors; a shard is written whenever the next tensor would exceed the budget."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: Dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: List[List[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._buffer or any(name in s for s in self._shards):
            raise ValueError(f"tensor '{name}' written twice")
        t = tensor.detach().cpu().contiguous()
        if t.untyped_storage().nbytes() != t.nbytes:  # a view: safetensors refuses shared storage
            t = t.clone()
        nbytes = t.numel() * t.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = t
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self._buffer, str(self.dir / f"shard-{len(self._shards)}.tmp"),
                  metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._buffer, self._buffer_bytes = {}, 0

    def finish(self) -> List[str]:
        """Write the last shard, give shards their final names and write the index."""
        if self._buffer:
            self._flush()
        n = len(self._shards)
        weight_map: Dict[str, str] = {}
        files = []
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f"shard-{i}.tmp", self.dir / final)
            weight_map.update({k: final for k in names})
            files.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        return files


_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_MAX_WRITE = 1 << 30  # os.pwrite writes at most ~2 GiB per call on Linux


class PlannedShardWriter:
    """Safetensors shards laid out before any tensor arrives; each tensor is written to its place.

    ``tensors`` lists ``(name, shape, dtype)`` in file order; shards are filled in that order up
    to ``max_shard_bytes`` (a tensor larger than the budget gets a shard of its own), named
    ``model-0000i-of-0000N.safetensors``, and created with their headers at once. :meth:`add`
    takes the tensors in any order and writes each one's bytes at its offset, so nothing is
    buffered; :meth:`finish` checks that every planned tensor came, syncs the files and writes
    the index. The files are ordinary safetensors files (the header padded to 8 bytes, as
    safetensors itself does).
    """

    def __init__(self, out_dir: str | Path,
                 tensors: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]],
                 max_shard_bytes: int) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        shards: List[List[Tuple[str, Tuple[int, ...], torch.dtype, int]]] = [[]]
        size = 0
        for name, shape, dtype in tensors:
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        self._place: Dict[str, Tuple[str, int, Tuple[int, ...], torch.dtype]] = {}
        self.files = [self._create(i, len(shards), shard)
                      for i, shard in enumerate(shards) if shard]
        self._fds: Dict[str, int] = {}
        self._written: set = set()
        self.total_bytes = sum(n for shard in shards for *_, n in shard)
        self.written_bytes = 0

    def _create(self, index: int, count: int, shard) -> str:
        """Write one shard's header and size the file; remember where each tensor goes."""
        filename = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype, nbytes in shard:
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(self.dir / filename, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)
        start = 8 + len(raw)
        for name, shape, dtype, _ in shard:
            self._place[name] = (filename, start + header[name]["data_offsets"][0], shape, dtype)
        return filename

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._place:
            raise ValueError(f"tensor '{name}' is not one of the {len(self._place)} planned")
        if name in self._written:
            raise ValueError(f"tensor '{name}' written twice")
        filename, offset, shape, dtype = self._place[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor '{name}': {list(tensor.shape)} {tensor.dtype}, planned "
                             f"{list(shape)} {dtype}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        view, done, fd = memoryview(data), 0, self._fd(filename)
        while done < len(view):
            done += os.pwrite(fd, view[done:done + _MAX_WRITE], offset + done)
        self._written.add(name)
        self.written_bytes += len(view)

    def _fd(self, filename: str) -> int:
        if filename not in self._fds:
            self._fds[filename] = os.open(self.dir / filename, os.O_WRONLY)
        return self._fds[filename]

    def close(self) -> None:
        """Close the files (after :meth:`finish`, or to abandon the output)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def finish(self) -> List[str]:
        """Check that every planned tensor was written, sync the shards, write the index."""
        missing = sorted(set(self._place) - self._written)
        if missing:
            self.close()
            raise ValueError(f"{len(missing)} planned tensors never came, e.g. {missing[:5]}")
        for filename in self.files:
            os.fsync(self._fd(filename))
        self.close()
        weight_map = {name: place[0] for name, place in self._place.items()}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        return list(self.files)


def copy_hf_assets(src_dir: Optional[str | Path], dst_dir: str | Path,
                   names: Iterable[str] = TOKENIZER_FILES + (GENERATION_CONFIG,)) -> List[str]:
    """Copy tokenizer files and generation_config.json that exist in ``src_dir``."""
    if src_dir is None:
        return []
    src = Path(src_dir)
    copied = []
    for name in names:
        if (src / name).is_file():
            shutil.copy2(src / name, Path(dst_dir) / name)
            copied.append(name)
    return copied
