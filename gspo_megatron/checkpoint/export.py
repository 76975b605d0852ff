"""Export a gspo-megatron checkpoint as a Hugging Face model directory.

Loads the checkpoint into the model built for the current layout (any layout: dist_checkpointing
reshards), streams full tensors to rank 0 with :func:`gather.iter_hf_tensors`, and writes sharded
safetensors (``max_shard_bytes`` each) with ``model.safetensors.index.json``, ``config.json``,
``generation_config.json`` and the tokenizer files (from ``tokenizer_dir``, else the HF directory
the checkpoint was converted from). Vocabulary padding is removed. Rank 0 writes into
``<out>.partial`` and renames it into place at the end (:func:`write_hf_directory`, also used
for the trainer's final export): the expected size is checked against the free space first, and
a failed write removes the partial directory and raises one :class:`OutputWriteError` naming the
path and the cause on every rank, after the tensor stream (a collective) has been drained.

    torchrun --nproc_per_node=8 tools/export_megatron_to_hf.py --ckpt ckpt/step_100 \
        --out hf_out --ep 8 --max-shard-size 5GB
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from gspo_megatron.checkpoint.convert import build_model_chunks
from gspo_megatron.checkpoint.gather import iter_hf_tensors
from gspo_megatron.checkpoint.hf_io import (GENERATION_CONFIG, TOKENIZER_FILES,
                                            PlannedShardWriter, copy_hf_assets)
from gspo_megatron.checkpoint.mapping import expected_hf_shapes, hf_file_order
from gspo_megatron.checkpoint.meta import (check_target, model_config_from_meta, partial_dir,
                                           publish, resolve_checkpoint)
from gspo_megatron.config.schema import ModelConfig, ParallelConfig
from gspo_megatron.learner.disk_space import (OutputWriteError, check_free_space,
                                              describe_write_failure)
from gspo_megatron.model.hf_config import hf_config_from_model_config

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a plain byte count -> bytes (> 0).

    Raises ``ValueError`` naming the text; argparse uses this as the option's ``type``.
    """
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "B": 1}
    s = str(text).strip().upper()
    factor = next((f for suffix, f in units.items() if s.endswith(suffix)), 1)
    number = next((s[: -len(suffix)] for suffix in units if s.endswith(suffix)), s)
    try:
        size = int(float(number) * factor)
    except ValueError:
        raise ValueError(f"'{text}' is not a size (examples: 5GB, 500MB, 2GiB, 1000000)") from None
    if size <= 0:
        raise ValueError(f"'{text}' must be a positive size")
    return size


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


# config.json fields that are training recipe, not architecture: the run's own values (an RL run
# trains with router_aux_loss_coef 0, slime's choice) must not replace the source model's, or a
# user who fine-tunes the export silently gets another recipe.
RECIPE_FIELDS = ("router_aux_loss_coef",)


def _hf_config(cfg: ModelConfig, source_dir: Optional[Path], dtype: torch.dtype) -> Dict[str, Any]:
    """The source's config.json with every field kept (token ids, recipe fields such as
    ``router_aux_loss_coef``) except architecture fields the trained model differs in;
    ``torch_dtype`` is the exported weights' dtype. Without a source: the model's own fields."""
    ours = hf_config_from_model_config(cfg)
    base: Dict[str, Any] = {}
    if source_dir is not None and (source_dir / "config.json").is_file():
        base = json.loads((source_dir / "config.json").read_text())
        for key in RECIPE_FIELDS:
            if key in base:
                ours.pop(key, None)
        changed = sorted(k for k, v in ours.items()
                         if k in base and k != "torch_dtype" and base[k] != v)
        if changed:
            log.warning("exported architecture differs from %s in %s", source_dir / "config.json",
                        ", ".join(f"{k}: {base[k]!r} -> {ours[k]!r}" for k in changed))
    base.update(ours)
    base["torch_dtype"] = _HF_DTYPE_NAMES[dtype]
    return base


def _generation_config(hf_config: Dict[str, Any]) -> Dict[str, Any]:
    gen = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if hf_config.get(key) is not None:
            gen[key] = hf_config[key]
    return gen


def write_hf_metadata(out: Path, cfg: ModelConfig, source_dir: Optional[Path],
                      dtype: torch.dtype) -> None:
    """config.json, generation_config.json and tokenizer files next to the weights.

    A config.json with the same content as the source's is the source's file, byte for byte
    (key order and formatting included); a changed one is written sorted and indented.
    """
    hf_config = _hf_config(cfg, source_dir, dtype)
    source_config = source_dir / "config.json" if source_dir is not None else None
    if source_config is not None and source_config.is_file() and \
            json.loads(source_config.read_text()) == hf_config:
        shutil.copy2(source_config, out / "config.json")
    else:
        (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
    copied = copy_hf_assets(source_dir, out)
    if GENERATION_CONFIG not in copied:
        (out / GENERATION_CONFIG).write_text(json.dumps(_generation_config(hf_config), indent=2))
    if source_dir is None or not any(n.startswith("tokenizer") for n in copied):
        log.warning("no tokenizer files copied into %s (source: %s); pass --tokenizer-dir",
                    out, source_dir)


def _agree(error: Optional[BaseException], out: Path, what: str) -> None:
    """Rank 0's write failure, as one OutputWriteError on every rank (collective)."""
    message = None
    if error is not None:
        shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)
        message = (str(error) if isinstance(error, OutputWriteError)
                   else describe_write_failure(error, out, what))
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [message]
        torch.distributed.broadcast_object_list(box, src=0)
        message = box[0]
    if message:
        raise OutputWriteError(message)


SAFETENSORS_ENTRY_BYTES = 64
"""Header bytes per tensor beyond its name: ``{"dtype":"BF16","shape":[..],"data_offsets":[..]}``."""
METADATA_BYTES = 8 << 10
"""config.json, the shard index and what rounding adds."""


def hf_export_nbytes(cfg: ModelConfig, dtype: torch.dtype, source_dir: Optional[Path] = None) -> int:
    """Bytes an export of ``cfg`` in ``dtype`` writes: tensor data, safetensors headers, the
    metadata files and the tokenizer files copied from ``source_dir``."""
    size = torch.empty((), dtype=dtype).element_size()
    shapes = expected_hf_shapes(cfg)
    data = sum(int(torch.Size(shape).numel()) * size for shape in shapes.values())
    headers = sum(len(name) + SAFETENSORS_ENTRY_BYTES for name in shapes)
    assets = sum((Path(source_dir) / name).stat().st_size
                 for name in TOKENIZER_FILES + (GENERATION_CONFIG,)
                 if source_dir is not None and (Path(source_dir) / name).is_file())
    return data + headers + assets + METADATA_BYTES


def write_hf_directory(named_tensors: Iterable[Tuple[str, torch.Tensor]], out: Path,
                       cfg: ModelConfig, source_dir: Optional[Path], dtype: torch.dtype,
                       max_shard_bytes: int, log_every: int = 0) -> Tuple[int, int]:
    """Collective: rank 0 writes the stream (every rank drains it) as an HF directory at ``out``.

    The shards are laid out from ``cfg`` before the first tensor arrives (the hub's file order,
    ``max_shard_bytes`` each) and every tensor is written to its place as it comes, so rank 0
    holds no shard in memory, only the tensor being written.

    Returns ``(num_tensors, num_shards)`` on rank 0 (``(0, 0)`` elsewhere).
    """
    what = f"Hugging Face export {out.name}"
    error: Optional[BaseException] = None
    writer = None
    if _rank() == 0:
        try:
            check_free_space(out.parent, hf_export_nbytes(cfg, dtype, source_dir), what)
            shapes = expected_hf_shapes(cfg)
            writer = PlannedShardWriter(partial_dir(out), [(n, shapes[n], dtype) for n in
                                                           hf_file_order(list(shapes))],
                                        max_shard_bytes)
        except (OSError, OutputWriteError) as exc:
            error = exc
    _agree(error, out, what)
    start, count = time.monotonic(), 0
    for name, tensor in named_tensors:  # drain on every rank: the gathers are collective
        if writer is None or error is not None:
            continue
        try:
            writer.add(name, tensor.to(dtype))
        except Exception as exc:  # noqa: BLE001 - safetensors' Rust errors are plain Exceptions
            error = exc
        del tensor  # a view into its gathered bucket: not kept while the next one is gathered
        count += 1
        if log_every and count % log_every == 0:
            log.info("exported %d tensors, %.2f GB, %.1f s", count, writer.written_bytes / 1e9,
                     time.monotonic() - start)
    files = []
    if writer is not None and error is None:
        try:
            files = writer.finish()
            write_hf_metadata(writer.dir, cfg, source_dir, dtype)
            publish(writer.dir, out)
        except Exception as exc:  # noqa: BLE001 - as above
            error = exc
    if writer is not None:
        writer.close()
    _agree(error, out, what)
    return count, len(files)


def export_megatron_to_hf(ckpt_dir: str | Path, out_dir: str | Path, parallel: ParallelConfig,
                          max_shard_bytes: int = 5 * 10**9, tokenizer_dir: Optional[str] = None,
                          dtype: Optional[str] = None, overwrite: bool = False,
                          log_every: int = 100) -> Path:
    """Collective: run on every rank of a runtime initialised with ``parallel``."""
    from gspo_megatron.learner.checkpointing import load_model_weights, read_meta

    out = check_target(out_dir, overwrite)
    ckpt_dir = resolve_checkpoint(ckpt_dir)
    meta = read_meta(ckpt_dir)
    cfg = model_config_from_meta(meta)
    chunks = build_model_chunks(cfg, parallel)
    load_model_weights(chunks, ckpt_dir)
    out_dtype = _TORCH_DTYPES[dtype] if dtype else next(chunks[0].parameters()).dtype
    source = tokenizer_dir or meta.get("hf_source") or cfg.hf_path
    start = time.monotonic()
    count, num_shards = write_hf_directory(iter_hf_tensors(chunks, cfg, dst="rank0"), out, cfg,
                                           Path(source) if source else None, out_dtype,
                                           max_shard_bytes, log_every)
    if _rank() == 0:
        log.info("exported %s -> %s: %d tensors in %d shards, %.1f s", ckpt_dir, out, count,
                 num_shards, time.monotonic() - start)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out
