"""Write every asset of a real-width Qwen3-MoE run into one directory.

Layout of ``out_dir``::

    model/        HF Qwen3-MoE at the hub's widths with 1 or 2 layers (random bf16 init):
                  config.json, model-0000X-of-0000N.safetensors + index,
                  generation_config.json, the real tokenizer files
    data/train.jsonl, data/eval.jsonl   the arithmetic questions of ``task.py``

The directory appears whole or not at all: everything is written to ``<out_dir>.partial`` and
renamed at the end. The same seed gives byte-identical files.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gspo_megatron.checkpoint.meta import check_target, partial_dir, publish
from gspo_megatron.real_geometry.checkpoint_writer import write_random_checkpoint
from gspo_megatron.real_geometry.geometries import GENERATION_CONFIG, geometry_config
from gspo_megatron.real_geometry.task import write_question_datasets
from gspo_megatron.real_geometry.tokenizer_fetch import fetch_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Qwen3Assets:
    """Paths of the written assets."""

    model_dir: Path
    train_path: Path
    eval_path: Path


def make_qwen3_assets(out_dir: Path, geometry: str = "30b", num_layers: int = 1, seed: int = 0,
                      cache_dir: Optional[Path] = None, max_shard_bytes: int = 10**9,
                      overwrite: bool = False) -> Qwen3Assets:
    """Fetch the tokenizer (cached), write the checkpoint and the task under ``out_dir``."""
    out = check_target(out_dir, overwrite)
    hf_config = geometry_config(geometry, num_layers)
    tmp = partial_dir(out)
    try:
        with tempfile.TemporaryDirectory(prefix="qwen3-tokenizer-") as tokenizer_dir:
            fetch_tokenizer(Path(tokenizer_dir), cache_dir)
            write_random_checkpoint(tmp / "model", hf_config, GENERATION_CONFIG,
                                    Path(tokenizer_dir), seed, max_shard_bytes)
        write_question_datasets(tmp / "data")
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("Qwen3 %s assets (%d layers) in %s", geometry, num_layers, out)
    return Qwen3Assets(model_dir=out / "model", train_path=out / "data" / "train.jsonl",
                       eval_path=out / "data" / "eval.jsonl")
