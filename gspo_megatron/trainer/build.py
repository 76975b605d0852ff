"""Build the parts of a run from its config; the parts' weight sync and close span several parts.

The loop (``trainer/loop.py``) only sequences; everything that knows how a part is made lives
here: the learner on every rank, the rollout engine, rewards and logger on the main rank, the
data sampler on every rank (they advance in step, so no prompts are broadcast), the run's
checkpoints (``trainer/checkpoints.py``: resume decision, save, rotation), the overlap's thread
tuner (``trainer/schedule/one_step_threads.py``), and the weight sync that streams the learner's
parameters, gathered into Hugging Face names, into the engine. The end of a run (export, plot)
is ``trainer/finish.py``'s.

Inputs are checked (``trainer/preflight.py``) and the resume decision is taken before the
learner is built, so a bad path or a changed dataset fails in seconds with nothing written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

import torch.distributed as dist
from omegaconf import OmegaConf

from gspo_megatron.algorithms.correction import describe as describe_correction
from gspo_megatron.algorithms.losses import get_policy_loss
from gspo_megatron.checkpoint.learner_hf import load_hf_into_learner
from gspo_megatron.config.schema import rollout_staleness
from gspo_megatron.data.dataset import load_prompt_dataset
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.learner.learner import Learner
from gspo_megatron.rewards.runner import RewardRunner
from gspo_megatron.rewards.scorer import RolloutScorer
from gspo_megatron.trainer.checkpoints import RunCheckpoints, data_identity, plan_resume
from gspo_megatron.trainer.metrics_log import MetricsLogger
from gspo_megatron.trainer.schedule.one_step_threads import overlap_thread_tuner
from gspo_megatron.trainer.deadline import save_prior_s
from gspo_megatron.trainer.preemption import PreemptionFlag
from gspo_megatron.trainer.preflight import (check_enough_prompts, check_hf_weights,
                                             check_initial_weights, check_input_files,
                                             load_tokenizer)

log = logging.getLogger(__name__)


@dataclass
class TrainerParts:
    """Everything one process of a run holds. Main-rank-only parts are None elsewhere."""

    cfg: Any
    runtime: Any
    learner: Learner
    tokenizer: Any
    sampler: PromptSampler
    policy_loss: Any
    sft_loss: Any
    preemption: PreemptionFlag
    run_dir: Path
    checkpoints: RunCheckpoints
    engine: Any = None
    reward_runner: Optional[RolloutScorer] = None
    eval_prompts: Optional[list] = None
    reference: Optional[Learner] = None
    """Frozen initial policy for the KL penalty (only when ``algo.kl_coef > 0``)."""
    logger: MetricsLogger = field(default=None)  # type: ignore[assignment]
    syncer: Any = None
    """``weight_sync.learner_sync.LearnerWeightSync`` (every rank)."""
    sync_check: Any = None
    """``trainer.sync_check.SyncCheck`` with ``rollout.weight_sync.verify`` (every rank)."""
    overlap_threads: Any = None
    """``schedule.one_step_threads.OverlapThreadTuner`` (main rank, overlap with the embedded
    engine): the learner's threads beside the engine's process, and the probe of the overlap."""
    closed: bool = field(default=False, init=False, repr=False)
    """Set by :meth:`close`, which then does nothing."""

    # ---- weight sync ---------------------------------------------------------------------
    def weight_sync(self) -> Dict[str, float]:
        """Stream every learner parameter, in HF names, into the engine (collective); the
        engine's update protocol (pause, abort, begin, buckets, end, flush, continue) included."""
        return self.syncer(str(self.learner.step))

    def close(self) -> None:
        """Stop the engine (or this stage's sender), then what the learner side holds. Safe to
        call twice: the loop closes its parts and the CLI closes them again whatever happened."""
        if self.closed:
            return
        self.closed = True
        if self.engine is not None:
            self.engine.shutdown()  # closes its attached transport
        elif self.syncer is not None and self.syncer.transport is not None:
            self.syncer.transport.close()  # a pipeline stage's broadcast sender
        self.close_learner_side()

    def close_learner_side(self) -> None:
        """The metrics logger and the learners: what a failed build closes (the engine is its
        caller's). Without it, each in-process run would keep its model and gloo groups."""
        if self.logger is not None:
            self.logger.close()
        if self.checkpoints is not None:  # its writer thread reads the learner's tensors
            self.checkpoints.close()
        for learner in (self.learner, self.reference):
            if learner is not None:
                learner.close()


def _start_engine(cfg, run_dir: Path):
    """The rollout engine (main rank). Started before the learner is built, so a server fleet or
    the embedded engine's process loads its model meanwhile (its handshake is read at first use)."""
    from gspo_megatron.rollout.factory import build_engine
    from gspo_megatron.rollout.sglang.server_keys import key_file_path
    from gspo_megatron.trainer.batching import rollout_routing_shape

    r = cfg.rollout
    return build_engine(r, model_path=cfg.model.hf_path, log_dir=str(run_dir / "logs"),
                        key_file=key_file_path(r.sglang.key_file, str(run_dir)),
                        routing_shape=rollout_routing_shape(cfg),
                        keep_partial_rollouts=rollout_staleness(r) >= 2)


def _build_weight_sync(parts: TrainerParts, cfg, runtime):
    """The engine's transport on the main rank; a stage sender elsewhere when needed."""
    from gspo_megatron.weight_sync.factory import (build_stage_transport, build_transport,
                                                   transport_dst)
    from gspo_megatron.weight_sync.learner_sync import LearnerWeightSync

    r = cfg.rollout
    dst = transport_dst(r.weight_sync, r.engine, r.mode)
    transport = None
    if runtime.is_main:
        transport = build_transport(r.weight_sync, parts.engine, r.engine, mode=r.mode,
                                    server_tp_size=r.sglang.tp, config_dir=cfg.model.hf_path,
                                    record_dir=str(parts.run_dir))
    elif dst == "stage":  # its clients send the keys the main rank's engine made or read
        from gspo_megatron.rollout.sglang.server_keys import key_file_path, read_keys, use_keys

        key_file = key_file_path(r.sglang.key_file, cfg.logging.run_dir)
        use_keys(read_keys(key_file) if os.path.exists(key_file) else None)
        transport = build_stage_transport(r.weight_sync, r.sglang.tp, record_dir=str(parts.run_dir))
    return LearnerWeightSync(parts.learner, parts.engine, transport, dst, r.weight_sync.bucket_bytes)


def _log_correction(cfg) -> None:
    """Name the importance correction that runs (``algo.tis``, its ``auto`` already resolved
    when the config was loaded), and warn of a combination the docs advise against."""
    tis = cfg.algo.tis
    text, warning = describe_correction(tis.mode, tis.level, tis.cap, cfg.algo.loss,
                                        rollout_staleness(cfg.rollout))
    log.info("%s", text)
    if warning:
        log.warning("%s", warning)


def build_parts(cfg, runtime, preemption: Optional[PreemptionFlag] = None) -> TrainerParts:
    """Construct every part of a run for this process (collective: call on every rank)."""
    check_input_files(cfg)
    if runtime.is_main:
        _log_correction(cfg)
    if runtime.is_main and cfg.rollout.engine == "embedded":
        check_hf_weights(cfg)  # the engine loads model.hf_path first
    threads = overlap_thread_tuner(cfg) if runtime.is_main else None
    engine = _start_engine(cfg, Path(cfg.logging.run_dir)) if runtime.is_main else None
    try:
        if engine is not None and cfg.rollout.mode == "colocated":
            # The servers sized their static pool on an empty GPU; the learner is built and runs
            # its first sync in what they give back (planner/colocated.py). The first sync
            # resumes only their weights, the KV cache comes back for the first rollout.
            engine.release_memory()
            log.info("colocated: the rollout engine released its memory before the learner is built")
        parts = _build_around_engine(cfg, runtime, preemption, engine)
        parts.overlap_threads = threads
        return parts
    except BaseException:
        if engine is not None:  # the engine is a process (or a fleet) of its own
            engine.shutdown()
        raise


def _build_around_engine(cfg, runtime, preemption, engine) -> TrainerParts:
    run_dir = Path(cfg.logging.run_dir)
    tokenizer = load_tokenizer(cfg.model.hf_path)
    train = load_prompt_dataset(cfg.data.train_path, tokenizer, cfg.data)
    check_enough_prompts(train.stats, cfg)
    sampler = PromptSampler(train.records, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    eval_records = (load_prompt_dataset(cfg.data.eval_path, tokenizer, cfg.data).records
                    if cfg.data.eval_path and runtime.is_main else None)
    data = data_identity(cfg.data.train_path, sampler.state_dict())
    resume_from = plan_resume(cfg, data, runtime.is_main)
    check_initial_weights(cfg, resuming=resume_from is not None)
    learner = Learner(cfg, runtime, total_steps=cfg.trainer.num_steps * cfg.batch.num_mini_batches)
    try:
        checkpoints = RunCheckpoints(cfg, learner, sampler, runtime.is_main, data, resume_from)
    except BaseException:
        learner.close()
        raise
    preemption = preemption or PreemptionFlag()
    preemption.times.save_prior_s = save_prior_s(
        (p for chunk in learner.model for p in chunk.parameters()), runtime.world_size,
        cfg.plan.checkpoint_write_gbps)
    parts = TrainerParts(cfg=cfg, runtime=runtime, learner=learner, tokenizer=tokenizer,
                         sampler=sampler, policy_loss=get_policy_loss(cfg.algo.loss),
                         sft_loss=get_policy_loss("sft"), preemption=preemption,
                         run_dir=run_dir, checkpoints=checkpoints, eval_prompts=eval_records,
                         engine=engine)
    try:
        _fill_parts(parts, cfg, runtime, resume_from, train.records, engine)
    except BaseException:
        parts.close_learner_side()  # the engine is build_parts' to stop
        raise
    return parts


def _fill_parts(parts: TrainerParts, cfg, runtime, resume_from, train_records, engine) -> None:
    """Weights, reference, logger, weight sync, sync check and rewards of a built learner."""
    learner = parts.learner
    if resume_from is None:  # otherwise the run's own checkpoint holds the weights
        _load_initial(learner, cfg)
    if cfg.algo.kl_coef > 0:
        parts.reference = Learner(cfg, runtime, total_steps=1)
        _load_initial(parts.reference, cfg)
    parts.logger = MetricsLogger(parts.run_dir, cfg.logging.wandb,
                                 OmegaConf.to_container(cfg, resolve=True), enabled=runtime.is_main)
    parts.syncer = _build_weight_sync(parts, cfg, runtime)
    if cfg.rollout.weight_sync.verify and cfg.rollout.engine in ("sglang", "reference"):
        from gspo_megatron.trainer.sync_check import SyncCheck

        parts.sync_check = SyncCheck(learner, engine, train_records[0].prompt_token_ids,
                                     cfg.rollout.temperature, cfg.rollout.weight_sync.verify_tolerance,
                                     runtime.is_main)
    if runtime.is_main:
        parts.reward_runner = RolloutScorer(RewardRunner.from_config(cfg.reward), parts.tokenizer)
    if runtime.world_size > 1:
        dist.barrier()


def _load_initial(learner: Learner, cfg) -> None:
    """Weights before RL: a converted checkpoint, else the HF directory itself."""
    if cfg.checkpoint.load_dir:
        learner.load_weights(cfg.checkpoint.load_dir)
    else:
        load_hf_into_learner(learner, cfg.model.hf_path)
