"""Checkpoint metadata helpers and write-then-rename directories for conversion and export.

Checkpoint I/O itself is the learner's (:mod:`gspo_megatron.learner.checkpointing`:
``save_model_weights`` / ``load_model_weights`` / ``read_meta``), so converted checkpoints and
training checkpoints are the same format. Here: turning ``gspo_meta.json`` back into typed
configs, refusing to overwrite a target by accident, and the temp-dir-then-rename pattern for the
Hugging Face directories that export writes (rank 0 only).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict

from gspo_megatron.config.schema import FP8Config, ModelConfig


class TargetExistsError(FileExistsError):
    """The output directory exists and overwriting was not asked for."""


def model_config_from_meta(meta: Dict[str, Any]) -> ModelConfig:
    """The typed model config a checkpoint was written with (``gspo_meta.json``'s ``model``)."""
    values = dict(meta["model"])
    values["fp8"] = FP8Config(**(values.get("fp8") or {}))
    return ModelConfig(**values)


def check_target(out_dir: str | Path, overwrite: bool) -> Path:
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise TargetExistsError(f"{out}: already exists (use --overwrite to replace it)")
    return out


def partial_dir(out_dir: str | Path) -> Path:
    """Fresh hidden sibling directory to write into before the final rename."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, out_dir: str | Path) -> None:
    """Move a finished partial directory into place, replacing an old one."""
    out = Path(out_dir)
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint directory, or a run's checkpoint root (its newest complete ``step_*``,
    skipping damaged ones with a warning); :class:`CheckpointError` otherwise."""
    from gspo_megatron.learner.checkpoint_files import newest_complete

    return newest_complete(path)
