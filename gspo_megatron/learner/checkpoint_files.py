"""Which files make a checkpoint complete, and the newest complete step of a run.

A gspo-megatron checkpoint directory holds what ``megatron.core.dist_checkpointing.save``
(megatron-core 0.16.1, ``torch_dist`` backend) writes, plus our ``gspo_meta.json``:

* ``common.pt``: the non-sharded state, written by rank 0 first
  (``dist_checkpointing/strategies/common.py``, ``COMMON_STATE_FNAME``);
* ``__<rank>_<i>.distcp``: each rank's shard data, one file per writer bucket
  (``strategies/filesystem_async.py``, ``FileSystemWriterAsync.prepare_write_data``);
* ``.metadata``: torch.distributed.checkpoint's global index of every shard, written by the
  coordinator once all shard writes succeeded (``strategies/state_dict_saver.py``,
  ``save_state_dict_async_finalize``);
* ``metadata.json``: backend and version, written last by ``serialization.save``
  (``core.py``, ``CONFIG_FNAME``); ``dist_checkpointing.load`` refuses a directory without it.

None of these lists the others, so a deleted ``.distcp`` or ``common.pt`` only shows up as a
``CheckpointingException`` deep inside a load. Hence ``manifest.json``: written by rank 0 after
everything else (file name -> size in bytes), through a temporary file and an atomic rename,
before the whole directory is renamed from ``<dir>.partial`` into place. A directory whose files
do not match its manifest (missing, truncated, extra manifest-less leftovers) is damaged.

    problems = verify_checkpoint("runs/x/checkpoints/step_000100")   # [] when complete
    found = scan_steps("runs/x/checkpoints")   # newest complete step + the damaged ones skipped
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "gspo-megatron-manifest-v1"
META_FILE = "gspo_meta.json"
STEP_PREFIX = "step_"
LEFTOVER_SUFFIXES = (".partial", ".old")
DISCARDED_SUFFIX = ".deleting"
"""A checkpoint rotation retired: renamed first (at once), deleted later (in the background);
one that is still there at start-up is deleted then."""
# dist_checkpointing.load needs these in every checkpoint (see the module docstring).
REQUIRED_FILES = ("common.pt", ".metadata", "metadata.json", META_FILE)


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or not ours; the message names the directory."""


def checkpoint_root(checkpoint_cfg, run_dir: str | Path) -> Path:
    """Where a run's ``step_*`` checkpoints live: ``checkpoint.dir``, else ``<run_dir>/checkpoints``."""
    return Path(checkpoint_cfg.dir or Path(run_dir) / "checkpoints")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:06d}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: str | Path) -> Dict[str, int]:
    """Record every file of ``directory`` with its size, atomically; returns the file map."""
    directory = Path(directory)
    files = {str(p.relative_to(directory)): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}
    tmp = directory / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files,
                               "total_bytes": sum(files.values())}, indent=1, sort_keys=True))
    _fsync_file(tmp)
    os.replace(tmp, directory / MANIFEST_FILE)
    return files


def read_manifest(directory: str | Path) -> Optional[Dict[str, int]]:
    """The manifest's file map, or None when there is no manifest."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        files = body["files"]
        if body.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {body.get('format')!r}")
        return {str(k): int(v) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None


def verify_checkpoint(directory: str | Path, require_manifest: bool = True) -> List[str]:
    """Problems that make ``directory`` unusable as a checkpoint; empty when it is complete.

    Without ``require_manifest`` a directory that has no manifest (written before gspo-megatron
    recorded one) passes if the files every checkpoint needs are present.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory}: not a directory"]
    try:
        manifest = read_manifest(directory)
    except CheckpointError as exc:
        return [str(exc)]
    if manifest is None:
        missing = [n for n in REQUIRED_FILES if not (directory / n).is_file()]
        if require_manifest:
            return [f"{directory}: no {MANIFEST_FILE} (the write did not finish)"
                    + (f"; missing {', '.join(missing)}" if missing else "")]
        return [f"{directory}: missing {name}" for name in missing]
    problems = []
    for name, size in manifest.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing (listed in {MANIFEST_FILE})")
        elif path.stat().st_size != size:
            problems.append(f"{path}: {path.stat().st_size} bytes, {MANIFEST_FILE} says {size}")
    return problems


def require_complete(directory: str | Path, require_manifest: bool = True) -> Path:
    """``directory`` if it is a complete checkpoint, else :class:`CheckpointError` naming why."""
    problems = verify_checkpoint(directory, require_manifest)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{directory}: damaged or incomplete checkpoint: "
                              + "; ".join(problems[:3]) + more)
    return Path(directory)


def list_step_dirs(root: str | Path) -> List[Tuple[int, Path]]:
    """``(step, dir)`` of every ``step_<N>`` directory under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        number = d.name[len(STEP_PREFIX):]
        if d.is_dir() and d.name.startswith(STEP_PREFIX) and number.isdigit():
            found.append((int(number), d))
    return sorted(found)


@dataclass
class StepScan:
    """What a checkpoint root holds: complete steps (oldest first) and damaged ones."""

    complete: List[Tuple[int, Path]] = field(default_factory=list)
    damaged: List[Tuple[int, Path, str]] = field(default_factory=list)

    @property
    def newest(self) -> Optional[Tuple[int, Path]]:
        return self.complete[-1] if self.complete else None


def scan_steps(root: str | Path) -> StepScan:
    """Sort a run's ``step_*`` directories into complete and damaged ones (with the reason)."""
    scan = StepScan()
    for step, d in list_step_dirs(root):
        problems = verify_checkpoint(d)
        if problems:
            scan.damaged.append((step, d, problems[0]))
        else:
            scan.complete.append((step, d))
    return scan


def newest_complete(root: str | Path) -> Path:
    """A checkpoint directory itself, or the newest complete ``step_*`` under a run's root."""
    root = Path(root)
    if (root / META_FILE).is_file():
        return require_complete(root, require_manifest=False)
    scan = scan_steps(root)
    for step, d, reason in scan.damaged:
        if scan.newest is None or step > scan.newest[0]:
            log.warning("skipping damaged checkpoint %s: %s", d, reason)
    if scan.newest is None:
        detail = f"; damaged: {scan.damaged[-1][2]}" if scan.damaged else ""
        raise CheckpointError(f"{root}: neither a gspo-megatron checkpoint (no {META_FILE}) nor "
                              f"a directory with a complete step_* checkpoint{detail}")
    return scan.newest[1]


def clean_leftovers(root: str | Path) -> List[Path]:
    """Tidy what an interrupted write left in ``root``; returns the paths it touched.

    ``X.partial`` is a write that did not finish (deleted) or, when it verifies complete and
    ``X`` is absent, a finished one whose final rename was interrupted (renamed into place).
    ``X.old`` is the previous version of a replaced ``X``: restored when ``X`` is absent and it
    is complete, deleted otherwise. ``X.deleting`` was retired by a rotation: deleted. Anything
    else is left alone.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    touched = []
    for d in sorted(p for p in root.iterdir() if p.name.endswith(DISCARDED_SUFFIX)):
        shutil.rmtree(d, ignore_errors=True)
        log.warning("removed %s, retired by a rotation that did not finish deleting it", d)
        touched.append(d)
    for suffix in LEFTOVER_SUFFIXES:  # .partial first: it is newer than .old
        for d in sorted(p for p in root.iterdir() if p.name.endswith(suffix) and p.is_dir()):
            final = d.with_name(d.name[: -len(suffix)])
            if not final.exists() and (d / MANIFEST_FILE).is_file() and not verify_checkpoint(d):
                os.replace(d, final)
                log.warning("moved %s into place as %s (its rename was interrupted)", d, final)
            else:
                shutil.rmtree(d, ignore_errors=True)
                log.warning("removed %s, left over by an interrupted write", d)
            touched.append(d)
    return touched
