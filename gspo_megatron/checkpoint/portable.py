"""Rewrite a training checkpoint's optimizer state in the portable form, in place.

Training saves the distributed optimizer in the fast form (``learner/checkpointing.py``:
megatron-core's ``dp_reshardable``, every rank its own shard, no gather), which loads under the
layout it was saved with only. To resume under another TP / PP / EP / ETP / CP, this loads the
checkpoint under its own layout (the data-parallel size may differ, so fewer processes do) and
saves it again with the optimizer in the portable, layout-independent form; the directory is
replaced only once the new one is complete. The portable save gathers each data-parallel
group's optimizer state on every rank of it (12 bytes per parameter of the group), which is why
training does not write it.

    torchrun --nproc-per-node=N -m gspo_megatron.cli.reshard --portable-optimizer \\
        --ckpt runs/r1/checkpoints/step_000100 --config runs/r1/config.yaml
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

KEPT_META = ("format", "has_optimizer", "world_size", "optimizer_form", "step", "model",
             "parallel", "frozen")
"""What the learner writes into gspo_meta.json itself; everything else the trainer passed
(the dataset's identity) is carried over."""


def make_portable(ckpt_dir: str | Path, cfg, runtime) -> Path:
    """Collective, on a runtime with the checkpoint's layout (``cfg.parallel``)."""
    from gspo_megatron.learner.checkpointing import (PORTABLE_FORM, optimizer_form, read_meta)
    from gspo_megatron.learner.learner import Learner

    meta = read_meta(ckpt_dir)
    if not meta.get("has_optimizer"):
        log.info("%s holds weights only: nothing to convert", ckpt_dir)
        return Path(ckpt_dir)
    if optimizer_form(meta) == PORTABLE_FORM:
        log.info("%s: the optimizer is in the portable form already", ckpt_dir)
        return Path(ckpt_dir)
    learner = Learner(cfg, runtime,
                      total_steps=cfg.trainer.num_steps * cfg.batch.num_mini_batches)
    try:
        extra = learner.load_checkpoint(ckpt_dir)
        passed = {k: v for k, v in meta.items() if k not in KEPT_META}
        learner.save_checkpoint(ckpt_dir, extra=extra, meta=passed, form=PORTABLE_FORM)
    finally:
        learner.close()
    log.info("%s: optimizer rewritten in the portable form (loads under any layout)", ckpt_dir)
    return Path(ckpt_dir)
