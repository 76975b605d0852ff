"""A run's training checkpoints: choose where to resume, save, rotate.

Checkpoints live in ``<checkpoint root>/step_<N>`` (``learner/checkpoint_files.py``). At start,
:func:`plan_resume` picks the newest *complete* step (its files match its manifest),
names every newer damaged one it skips, and checks that the checkpoint was trained on the same
prompts (``data`` in its ``gspo_meta.json``), with the same frozen groups, and, when its
optimizer is in the fast form, under the same layout, before any weight is loaded: a changed
dataset or layout is a clear error at start-up (with the conversion command for the layout)
instead of a failed resume. A fresh start with
``checkpoint.resume=never`` in a directory that already holds checkpoints moves them into
``superseded_<time>/`` so that a later ``resume=auto`` cannot mix two runs. After each save,
rotation keeps the newest ``checkpoint.keep_last`` complete steps (never fewer than one) and
removes damaged steps older than the newest complete one.

The decision is taken on rank 0 (one shared file system) and broadcast, so every rank loads the
same step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from gspo_megatron.config.validate import ConfigError
from gspo_megatron.learner.checkpoint_files import (DISCARDED_SUFFIX, CheckpointError,
                                                    checkpoint_root, list_step_dirs, scan_steps,
                                                    step_dir)
from gspo_megatron.learner.checkpoint_write import SaveReport
from gspo_megatron.config.freeze import frozen_set
from gspo_megatron.learner.checkpointing import conversion_hint, fast_form_mismatch, read_meta
from gspo_megatron.learner.freeze import check_same_frozen_groups

log = logging.getLogger(__name__)

FRESH_START_HINT = ("start fresh with a new logging.run_dir, or with checkpoint.resume=never "
                    "(moves this run's checkpoints into superseded_<time>/)")


@dataclass
class ResumeState:
    step: int
    extra: Dict[str, Any]


def data_identity(train_path: str, sampler_state: Dict[str, Any]) -> Dict[str, Any]:
    """What a checkpoint records about its prompts (``data`` in gspo_meta.json)."""
    return {"train_path": str(train_path), "num_prompts": sampler_state["num_records"],
            "fingerprint": sampler_state["fingerprint"], "seed": sampler_state["seed"],
            "shuffle": sampler_state["shuffle"]}


def data_mismatch(saved: Dict[str, Any], now: Dict[str, Any], where: Path) -> Optional[str]:
    """Why a checkpoint's prompts are not the current ones (None when they are)."""
    if saved.get("seed") != now["seed"]:
        return (f"trainer.seed is {now['seed']} but {where} was trained with "
                f"trainer.seed={saved.get('seed')} (it decides the prompt order)")
    if saved.get("shuffle") != now["shuffle"]:
        return (f"data.shuffle is {now['shuffle']} but {where} was trained with "
                f"data.shuffle={saved.get('shuffle')}")
    if (saved.get("fingerprint"), saved.get("num_prompts")) != (now["fingerprint"],
                                                               now["num_prompts"]):
        return (f"data.train_path changed since {where} was saved: it was trained on "
                f"{saved.get('train_path')} ({saved.get('num_prompts')} prompts, id fingerprint "
                f"{saved.get('fingerprint')}), now {now['train_path']} has {now['num_prompts']} "
                f"prompts (id fingerprint {now['fingerprint']})")
    return None


def _broadcast(obj):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def plan_resume(cfg, data: Dict[str, Any], is_main: bool) -> Optional[Path]:
    """Where to resume from (None: a fresh start), decided on rank 0 and agreed by all ranks."""
    decision: Any = None
    if is_main:
        try:
            decision = _decide(cfg.checkpoint, checkpoint_root(cfg.checkpoint, cfg.logging.run_dir),
                               data, frozen_set(cfg.optimizer.freeze), cfg.parallel,
                               str(Path(cfg.logging.run_dir) / "config.yaml"))
        except ConfigError as exc:
            decision = exc
    decision = _broadcast(decision)
    if isinstance(decision, ConfigError):
        raise decision
    return Path(decision) if decision else None


def _decide(ckpt_cfg, root: Path, data: Dict[str, Any], frozen: tuple = (), parallel=None,
            config: str = "<the run's config.yaml>") -> Optional[str]:
    mode = ckpt_cfg.resume
    if mode == "never":
        return None
    scan = scan_steps(root)
    newest = scan.newest
    for step, d, reason in scan.damaged:
        if newest is None or step > newest[0]:
            log.warning("skipping damaged checkpoint %s: %s", d, reason)
    if newest is None:
        if mode == "always":
            raise ConfigError(f"checkpoint.resume=always but {root} holds no complete "
                              "checkpoint" + (f" ({len(scan.damaged)} damaged)"
                                              if scan.damaged else ""))
        return None
    path = newest[1]
    try:
        meta = read_meta(path)
    except CheckpointError as exc:
        raise ConfigError(f"checkpoint.resume: {exc}") from None
    saved = meta.get("data")
    problem = data_mismatch(saved, data, path) if saved else None
    if problem:
        raise ConfigError(f"{problem}; to resume, undo that change, or {FRESH_START_HINT}")
    check_same_frozen_groups(meta, frozen, path)  # before the learner is built
    if parallel is not None:
        mismatch = fast_form_mismatch(meta, parallel)
        if mismatch:
            raise ConfigError(
                f"{path}: its optimizer state is in the fast form of the layout it was saved under "
                f"({mismatch}); resume under that layout, or write the portable form first: "
                f"{conversion_hint(path, meta, config)}")
    log.info("resuming from %s (newest complete checkpoint)", path)
    return str(path)


def _supersede(root: Path) -> None:
    aside = root / time.strftime("superseded_%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for d in sorted(root.glob("step_*")):
        d.rename(aside / d.name)
    log.warning("checkpoint.resume=never: moved this directory's earlier checkpoints into %s",
                aside)


class RunCheckpoints:
    """Resuming, saving and rotation for one run (every rank holds one).

    A save may be left writing in the background (``background=True``: megatron-core's
    sharded part written by a thread, ``learner/checkpoint_write.py``) while the loop waits for
    the next rollout; :meth:`finish_pending` completes it (collective) and must come before
    anything changes the weights. One save at a time: a new one finishes the pending one
    first. Rotation renames the retired steps at once and deletes them in a thread of the main
    rank, so a 400 GB ``rmtree`` never holds a step. Every finished save is a line of
    ``<run dir>/checkpoints.jsonl`` (main rank) and a :class:`SaveReport` in :attr:`reports`
    until the loop logs it.
    """

    def __init__(self, cfg, learner, sampler, is_main: bool, data: Dict[str, Any],
                 resume_from: Optional[Path]) -> None:
        self.cfg = cfg.checkpoint
        self.root = checkpoint_root(cfg.checkpoint, cfg.logging.run_dir)
        self.learner = learner
        self.sampler = sampler
        self.is_main = is_main
        self.data = data
        self.resume_from = resume_from
        """Chosen by :func:`plan_resume` before the learner was built; None: a fresh start."""
        self.record_path = Path(cfg.logging.run_dir) / "checkpoints.jsonl"
        self.pending: Optional[Tuple[int, Any]] = None
        """``(step, PendingSave)`` of a save still being written."""
        self.reports: List[Tuple[int, SaveReport]] = []
        """Finished saves the loop has not logged yet."""
        self._deleter: Optional[threading.Thread] = None

    def resume(self) -> Optional[ResumeState]:
        """Load the planned checkpoint (collective); None on a fresh start."""
        if self.resume_from is None:
            if self.is_main and self.cfg.resume == "never" and list_step_dirs(self.root):
                _supersede(self.root)
            return None
        extra = self.learner.load_checkpoint(self.resume_from)
        try:
            self.sampler.load_state_dict(extra["sampler"])
        except ValueError as exc:  # checkpoints older than the data check in plan()
            raise ConfigError(f"{self.resume_from}: {exc}; {FRESH_START_HINT}") from None
        if self.is_main:
            log.info("resumed from %s (step %d)", self.resume_from, extra["trainer_step"])
        return ResumeState(step=int(extra["trainer_step"]), extra=extra)

    # ---- during the run ------------------------------------------------------------------
    def save(self, step: int, extra: Optional[Dict[str, Any]] = None,
             sampler_state: Optional[Dict[str, Any]] = None, background: bool = False) -> Path:
        """Checkpoint ``step`` (collective), then rotate old ones on rank 0. ``extra``: the
        loop's own plain values (the in-flight rollout of a one-step off-policy run);
        ``sampler_state``: the data position to save instead of the live one (a step that was
        dropped had drawn its prompts already); ``background``: leave the writes to a thread
        and return (:meth:`finish_pending` completes the checkpoint)."""
        self.finish_pending()
        path = step_dir(self.root, step)
        sampler_state = sampler_state if sampler_state is not None else self.sampler.state_dict()
        result = self.learner.save_checkpoint(path, extra={**(extra or {}), "trainer_step": step,
                                                           "sampler": sampler_state},
                                              meta={"data": self.data}, background=background)
        if background:
            self.pending = (step, result)
        else:
            self._saved(step, result)
        return path

    def finish_pending(self) -> Optional[SaveReport]:
        """Collective: complete the save being written in the background (None when none is)."""
        if self.pending is None:
            return None
        (step, pending), self.pending = self.pending, None
        report = pending.finish()
        self._saved(step, report)
        return report

    def _saved(self, step: int, report: SaveReport) -> None:
        self.reports.append((step, report))
        if self.is_main:
            record = {"step": step, "time": time.time(), **asdict(report)}
            try:
                with open(self.record_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as exc:  # a record of the save, never worth failing the run
                log.warning("cannot write %s: %s", self.record_path, exc)
            self.rotate()
            log.info("saved checkpoint %s (%.1fs, %.1fs of it blocking)", report.directory,
                     report.total_s, report.blocking_s)

    def rotate(self) -> None:
        """Keep the newest ``keep_last`` complete steps; drop damaged ones older than those.
        A dropped step is renamed at once and deleted by a thread (one at a time)."""
        scan = scan_steps(self.root)
        if scan.newest is None:
            return
        keep = scan.complete[-max(self.cfg.keep_last, 1):]
        retired = [d for _, d in scan.complete[:-len(keep)]]
        for step, d, reason in scan.damaged:
            if step < scan.newest[0]:
                log.warning("removing damaged checkpoint %s (%s)", d, reason)
                retired.append(d)
        if not retired:
            return
        gone = []
        for d in retired:
            aside = d.with_name(d.name + DISCARDED_SUFFIX)
            os.replace(d, aside)
            gone.append(aside)
        self.wait_for_deletes()
        self._deleter = threading.Thread(target=_delete, args=(gone,), daemon=True,
                                         name="checkpoint-rotation")
        self._deleter.start()

    def wait_for_deletes(self) -> None:
        """Until the rotation's deletes are done (before the next ones, and at the run's end)."""
        if self._deleter is not None:
            self._deleter.join()
            self._deleter = None

    def close(self) -> None:
        """The run ends (a finished run has nothing pending). A save still pending here is one
        an error cut short: its writes are waited for and its partial directory removed, since
        the other ranks may be gone; the rotation's deletes are waited for."""
        if self.pending is not None:
            (_, pending), self.pending = self.pending, None
            pending.abandon()
        self.wait_for_deletes()


def _delete(paths: List[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
