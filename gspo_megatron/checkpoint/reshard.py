"""Re-save a gspo-megatron checkpoint under another parallel layout.

dist_checkpointing stores global tensors, so loading is layout-independent: every rank builds its
part of the model for the *target* layout, loads the source checkpoint into it (Megatron reads
only the slices this rank needs; embedding rows added or dropped for the target's vocabulary
padding), and saves it again with the target layout recorded in ``gspo_meta.json``. Memory per
process is that process's share of the model. Weights only: optimizer state is not carried over
(the learner's own loader reshards training checkpoints, optimizer included).

    torchrun --nproc_per_node=2 tools/reshard.py --ckpt ckpt_tp2 --out ckpt_pp2 --pp 2
"""

from __future__ import annotations

import logging
from pathlib import Path

from gspo_megatron.checkpoint.convert import build_model_chunks, resolve_pipeline_split
from gspo_megatron.checkpoint.meta import check_target, model_config_from_meta
from gspo_megatron.config.schema import ParallelConfig

log = logging.getLogger(__name__)


def reshard_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, parallel: ParallelConfig,
                       overwrite: bool = False) -> Path:
    """Collective: run on every rank of a runtime initialised with the target ``parallel``."""
    from gspo_megatron.learner.checkpointing import (load_model_weights, read_meta,
                                                     save_model_weights)

    check_target(out_dir, overwrite)
    meta = read_meta(ckpt_dir)
    cfg = model_config_from_meta(meta)
    parallel = resolve_pipeline_split(cfg, parallel)
    chunks = build_model_chunks(cfg, parallel)
    load_model_weights(chunks, ckpt_dir)
    new_meta = {k: v for k, v in meta.items() if k not in ("format", "has_optimizer")}
    new_meta.update(model=cfg, parallel=parallel)
    save_model_weights(chunks, out_dir, new_meta)
    log.info("resharded %s (%s) -> %s (%s)", ckpt_dir, meta.get("parallel"), out_dir, parallel)
    return Path(out_dir)
