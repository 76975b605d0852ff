"""Convert a Hugging Face Qwen3 / Qwen3-MoE checkpoint into a gspo-megatron distributed checkpoint.

Every rank builds its part of the Megatron model for the current parallel layout (on CPU), then
reads, one parameter at a time, only the rows or columns of the HF tensors that its TP / EP / PP
slice holds (``safe_open`` slices: whole query groups of q/k/v, its share of gate and up, its
padded vocabulary rows), maps them (fused QKV, fused gate/up, vocab padding) and copies them into
the parameter. The result is saved with ``dist_checkpointing`` through the learner's
``save_model_weights``, which writes the parameters themselves, one at a time. Host memory per
process is that process's share of the model plus about two of its parameter slices, so a 30B
model is converted with as many processes (``--pp``/``--ep``) as it takes to fit.

Since dist_checkpointing stores global tensors, the checkpoint loads under any other layout; the
layout used for conversion only decides how the work and memory are split.

    torchrun --nproc_per_node=8 tools/convert_hf_to_megatron.py --hf-dir Qwen3-30B-A3B \
        --out ckpt/qwen3_30b --ep 8
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import torch

from gspo_megatron.checkpoint import mapping
from gspo_megatron.checkpoint.hf_checks import open_validated
from gspo_megatron.checkpoint.hf_io import HFCheckpointReader
from gspo_megatron.checkpoint.local_params import iter_local_units
from gspo_megatron.checkpoint.meta import check_target
from gspo_megatron.config.pipeline_split import (PipelineSplitError, stage_layer_counts,
                                                 suggest_uneven_split)
from gspo_megatron.config.schema import ModelConfig, ParallelConfig
from gspo_megatron.model.hf_config import model_config_from_hf, read_hf_config

log = logging.getLogger(__name__)

_HF_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}


def model_config_for_hf_dir(hf_dir: str | Path, base: Optional[ModelConfig] = None) -> ModelConfig:
    """ModelConfig of an HF directory; ``params_dtype: auto`` follows the checkpoint's dtype."""
    hf = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf, base, source=str(Path(hf_dir) / "config.json"))
    hf_dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "")
    if cfg.params_dtype == "auto" and hf_dtype in _HF_DTYPES:
        cfg = replace(cfg, params_dtype=_HF_DTYPES[hf_dtype])
    return replace(cfg, hf_path=str(Path(hf_dir).resolve()))


def resolve_pipeline_split(cfg: ModelConfig, parallel: ParallelConfig) -> ParallelConfig:
    """``parallel`` with a valid layers-per-stage split for this model.

    The tools' layout only splits work and memory (checkpoints store global layer indices), so
    when ``--pp`` does not divide the layer count and no split was given, a balanced uneven one
    is chosen instead of failing. An explicit split that Megatron cannot build is refused
    (:class:`PipelineSplitError`, naming the flag).
    """
    first = parallel.num_layers_in_first_pipeline_stage
    last = parallel.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        split = suggest_uneven_split(cfg.num_layers, parallel.pp)
        if split is None:
            return parallel
        if _is_main():
            log.info("pp=%d does not divide %d layers: first stage %d, last stage %d layers",
                     parallel.pp, cfg.num_layers, *split)
        first, last = split
        parallel = replace(parallel, num_layers_in_first_pipeline_stage=first,
                           num_layers_in_last_pipeline_stage=last)
    try:
        stage_layer_counts(cfg.num_layers, parallel.pp, first, last, parallel.vpp)
    except PipelineSplitError as exc:
        raise PipelineSplitError(f"--first-stage-layers/--last-stage-layers: {exc}") from None
    return parallel


def build_model_chunks(cfg: ModelConfig, parallel: ParallelConfig,
                       initialize: bool = False) -> List[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage). Needs Megatron parallel state.

    Without ``initialize`` the parameters are left uninitialised (``torch.empty``): every caller
    here overwrites all of them (from HF tensors or a checkpoint), and random initialisation of a
    large model on CPU costs more than the conversion itself. Uneven pipeline stages are chosen
    here when needed (:func:`resolve_pipeline_split`).
    """
    from gspo_megatron.model.provider import build_gpt_model, build_transformer_config

    parallel = resolve_pipeline_split(cfg, parallel)
    config = build_transformer_config(cfg, parallel)
    config.perform_initialization = initialize
    if parallel.vpp:
        return [build_gpt_model(cfg, parallel, vp_stage=i, config=config)
                for i in range(parallel.vpp)]
    return [build_gpt_model(cfg, parallel, config=config)]


def _is_main() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def fill_from_hf(chunks: List[torch.nn.Module], reader: HFCheckpointReader, cfg: ModelConfig,
                 padded_vocab: int, log_every: int = 100) -> int:
    """Copy this rank's slice of every parameter from the HF checkpoint, reading only that slice
    of each HF tensor (plus vocabulary padding); returns the bytes copied."""
    start, num_bytes, count = time.monotonic(), 0, 0
    with torch.no_grad():
        for chunk in chunks:
            for unit in iter_local_units(chunk, cfg):
                local = mapping.local_from_hf(unit.name, reader, cfg, unit.spec, unit.tp_rank,
                                              unit.tp_size, padded_vocab)
                if tuple(local.shape) != tuple(unit.tensor.shape):
                    raise mapping.MappingError(
                        f"'{unit.name}' from {mapping.hf_names(unit.name, cfg)}: slice shape "
                        f"{list(local.shape)} does not fit parameter {list(unit.tensor.shape)}")
                unit.tensor.copy_(local)
                num_bytes += local.numel() * local.element_size()
                del local
                count += 1
                if log_every and count % log_every == 0 and _is_main():
                    log.info("converted %d tensors, %.2f GB, %.1f s", count, num_bytes / 1e9,
                             time.monotonic() - start)
    return num_bytes


def convert_hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, parallel: ParallelConfig,
                           base: Optional[ModelConfig] = None, overwrite: bool = False,
                           log_every: int = 100) -> Path:
    """Collective: run on every rank of a runtime initialised with ``parallel``."""
    from gspo_megatron.learner.checkpointing import save_model_weights
    from gspo_megatron.model.provider import padded_vocab_size

    hf_dir = Path(hf_dir)
    check_target(out_dir, overwrite)
    cfg = model_config_for_hf_dir(hf_dir, base)
    reader, unused = open_validated(hf_dir, cfg)
    if unused and _is_main():
        log.warning("%s: %d tensors not used by the Qwen3 mapping, e.g. %s", hf_dir, len(unused),
                    unused[:5])
    start = time.monotonic()
    parallel = resolve_pipeline_split(cfg, parallel)
    chunks = build_model_chunks(cfg, parallel)
    built = time.monotonic()
    padded = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, parallel.tp)
    num_bytes = fill_from_hf(chunks, reader, cfg, padded, log_every)
    filled = time.monotonic()
    meta = {"step": 0, "model": cfg, "parallel": parallel, "hf_source": str(hf_dir.resolve())}
    save_model_weights(chunks, out_dir, meta)
    if _is_main():
        log.info("converted %s -> %s: rank 0 filled %.2f GB; build %.1f s, fill %.1f s, "
                 "save %.1f s", hf_dir, out_dir, num_bytes / 1e9, built - start, filled - built,
                 time.monotonic() - filled)
    return Path(out_dir)
