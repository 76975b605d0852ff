"""Write a randomly initialised Qwen3-MoE checkpoint of any geometry, one tensor at a time.

The checkpoint is what the hub serves, minus training: config.json as given, bf16 weights drawn
at the model's init scale (transformers' ``_init_weights``: ``normal(0, initializer_range)`` for
every matrix, ones for every RMSNorm), in the hub's on-disk layout (one tensor per expert
projection, ``model-0000X-of-0000N.safetensors`` shards with ``model.safetensors.index.json``),
generation_config.json and the tokenizer files. Tensor names and shapes come from the project's
own mapping (``checkpoint/mapping.py``: ``expected_hf_shapes``), the list every loader checks a
checkpoint against; a test checks it against transformers' ``Qwen3MoeForCausalLM``.

Memory: tensors are generated one at a time and handed to the project's shard writer
(``checkpoint/hf_io.py``), which writes a shard as soon as the next tensor would overflow it, so
the process holds at most one shard plus one tensor (the 622 MB embedding of the real
vocabulary) however large the model.

Determinism: each tensor has its own generator, seeded from ``(seed, tensor name)``, so the same
seed gives byte-identical files and a 2-layer checkpoint shares its first layer with the 1-layer
one.

Nothing is half-written: everything that can be checked first is (tokenizer size against
``vocab_size``, free disk space); the files go to ``<out>.partial``, which is read back through the
loaders' own checks (``checkpoint/hf_checks.py``) and only then renamed to ``<out>``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from gspo_megatron.checkpoint.convert import model_config_for_hf_dir
from gspo_megatron.checkpoint.export import hf_export_nbytes
from gspo_megatron.checkpoint.hf_checks import check_tokenizer_fits, open_validated
from gspo_megatron.checkpoint.hf_io import (GENERATION_CONFIG, TOKENIZER_FILES,
                                            SafetensorsShardWriter, copy_hf_assets)
from gspo_megatron.checkpoint.mapping import expected_hf_shapes, hf_file_order
from gspo_megatron.checkpoint.meta import check_target, partial_dir, publish
from gspo_megatron.config.schema import ModelConfig
from gspo_megatron.learner.disk_space import check_free_space
from gspo_megatron.model.hf_config import model_config_from_hf

log = logging.getLogger(__name__)

DTYPE = torch.bfloat16


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def random_tensors(cfg: ModelConfig, init_std: float, seed: int
                   ) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(hub name, bf16 tensor)`` of every weight of ``cfg``, each made when asked for."""
    shapes = expected_hf_shapes(cfg)
    for name in hf_file_order(list(shapes)):
        tensor = torch.empty(shapes[name], dtype=DTYPE)
        if tensor.dim() == 1:
            tensor.fill_(1.0)  # RMSNorm weights (Qwen3 has no biases)
        else:
            generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
            tensor.normal_(0.0, init_std, generator=generator)
        yield name, tensor


def _write_json(path: Path, value: Dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _check_tokenizer(tokenizer_dir: Path, cfg: ModelConfig) -> None:
    from transformers import AutoTokenizer

    num_tokens = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    check_tokenizer_fits(num_tokens, cfg.vocab_size, tokenizer_dir / "tokenizer.json",
                         "the geometry's config.json")


def write_random_checkpoint(out_dir: Path, hf_config: Dict[str, Any],
                            generation_config: Dict[str, Any], tokenizer_dir: Optional[Path],
                            seed: int, max_shard_bytes: int) -> Path:
    """Write the checkpoint of ``hf_config`` (a config.json dict) to ``out_dir``, which must not
    exist; see the module docstring. ``tokenizer_dir`` holds the tokenizer files to copy (None:
    no tokenizer)."""
    out = check_target(out_dir, overwrite=False)
    cfg = model_config_from_hf(hf_config, source="the geometry's config.json")
    if tokenizer_dir is not None:
        _check_tokenizer(Path(tokenizer_dir), cfg)
    check_free_space(out.parent, hf_export_nbytes(cfg, DTYPE, tokenizer_dir), f"checkpoint {out}")
    tmp = partial_dir(out)
    try:
        writer = SafetensorsShardWriter(tmp, max_shard_bytes)
        for name, tensor in random_tensors(cfg, hf_config["initializer_range"], seed):
            writer.add(name, tensor)
        files = writer.finish()
        _write_json(tmp / "config.json", hf_config)
        _write_json(tmp / GENERATION_CONFIG, generation_config)
        copy_hf_assets(tokenizer_dir, tmp, TOKENIZER_FILES)
        open_validated(tmp, model_config_for_hf_dir(tmp))  # the loaders' checks, before publishing
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s: %d tensors, %.2f GB in %d shards", out, len(expected_hf_shapes(cfg)),
             writer.total_bytes / 1e9, len(files))
    return out
