"""Build the parts of a run from its config, and the few operations that span several parts.

The loop (``trainer/loop.py``) only sequences; everything that knows how a part is made lives
here: the learner on every rank, the rollout engine, rewards and logger on the main rank, the
data sampler on every rank (they advance in step, so no prompts are broadcast), checkpoints with
the trainer state, and the weight sync that streams the learner's parameters, gathered into
Hugging Face names, into the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch.distributed as dist
from omegaconf import OmegaConf

from gspo_megatron.algorithms.losses import get_policy_loss
from gspo_megatron.config.validate import ConfigError
from gspo_megatron.data.dataset import load_prompt_dataset
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.learner.checkpointing import read_meta
from gspo_megatron.learner.learner import Learner
from gspo_megatron.learner.sft_loss import sft_loss
from gspo_megatron.rewards.runner import RewardRequest, RewardRunner
from gspo_megatron.trainer.hf_weights import (export_learner_to_hf, learner_hf_tensors,
                                              load_hf_into_learner)
from gspo_megatron.trainer.metrics_log import MetricsLogger
from gspo_megatron.trainer.plot import plot_history
from gspo_megatron.trainer.preemption import PreemptionFlag

log = logging.getLogger(__name__)

STEP_DIR_PREFIX = "step_"


class RolloutScorer:
    """Decode responses and score them with the reward runner (0 for a failing reward)."""

    def __init__(self, runner: RewardRunner, tokenizer) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self._stats: Dict[str, float] = {}

    def score(self, samples, records_by_id) -> List[float]:
        requests = []
        for s in samples:
            record = records_by_id[s.prompt_id]
            text = self.tokenizer.decode(s.response_token_ids, skip_special_tokens=True)
            requests.append(RewardRequest(s.prompt_id, text, record.answer, record.metadata))
        result = self.runner.compute(requests)
        st = result.stats
        self._stats = {"reward/num_errors": float(st.num_errors),
                       "reward/num_timeouts": float(st.num_timeouts),
                       "time/reward_mean_s": st.mean_time_s}
        return list(result.rewards)

    def last_stats(self) -> Dict[str, float]:
        return dict(self._stats)


@dataclass
class ResumeState:
    step: int
    extra: Dict[str, Any]


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
    ckpt_root: Path
    engine: Any = None
    reward_runner: Optional[RolloutScorer] = None
    eval_prompts: Optional[list] = None
    reference: Optional[Learner] = None
    """Frozen initial policy for the KL penalty (only when ``algo.kl_coef > 0``)."""
    logger: MetricsLogger = field(default=None)  # type: ignore[assignment]

    # ---- weight sync ---------------------------------------------------------------------
    def weight_sync(self) -> Dict[str, float]:
        """Stream every learner parameter, in HF names, into the engine (collective)."""
        named = learner_hf_tensors(self.learner)
        if self.runtime.is_main:
            stats = self.engine.update_weights(named, weight_version=str(self.learner.step))
            return {"weight_sync/gb": stats.num_bytes / 1e9, "weight_sync/gb_per_s": stats.gb_per_s}
        for _ in named:  # other ranks take part in the gathers and drop the results
            pass
        return {}

    # ---- checkpoints ---------------------------------------------------------------------
    def _complete_steps(self) -> List[int]:
        if not self.ckpt_root.is_dir():
            return []
        steps = []
        for d in self.ckpt_root.glob(f"{STEP_DIR_PREFIX}*"):
            if (d / "gspo_meta.json").is_file() and d.name[len(STEP_DIR_PREFIX):].isdigit():
                steps.append(int(d.name[len(STEP_DIR_PREFIX):]))
        return sorted(steps)

    def save(self, step: int) -> Path:
        path = self.ckpt_root / f"{STEP_DIR_PREFIX}{step:06d}"
        self.learner.save_checkpoint(path, extra={"trainer_step": step,
                                                  "sampler": self.sampler.state_dict()})
        if self.runtime.is_main:
            for old in self._complete_steps()[:-max(self.cfg.checkpoint.keep_last, 1)]:
                shutil.rmtree(self.ckpt_root / f"{STEP_DIR_PREFIX}{old:06d}", ignore_errors=True)
            log.info("saved checkpoint %s", path)
        return path

    def resume(self) -> Optional[ResumeState]:
        mode = self.cfg.checkpoint.resume
        steps = self._complete_steps()
        if mode == "never" or (mode == "auto" and not steps):
            return None
        if not steps:
            raise ConfigError(f"checkpoint.resume=always but {self.ckpt_root} holds no checkpoint")
        path = self.ckpt_root / f"{STEP_DIR_PREFIX}{steps[-1]:06d}"
        extra = self.learner.load_checkpoint(path)
        self.sampler.load_state_dict(extra["sampler"])
        if self.runtime.is_main:
            log.info("resumed from %s (step %d)", path, extra["trainer_step"])
        return ResumeState(step=int(extra["trainer_step"]), extra=extra)

    # ---- end of run ----------------------------------------------------------------------
    def finish(self) -> None:
        """Plot and export the final policy to Hugging Face format."""
        out = export_learner_to_hf(self.learner, self.run_dir / "hf_export",
                                   tokenizer_dir=self.cfg.model.hf_path)
        if self.runtime.is_main:
            if self.cfg.logging.plot:
                plot_history(self.logger.history, self.run_dir / "metrics.png",
                             bin_edges=self.cfg.algo.diagnostics.log_ratio_bin_edges)
            log.info("exported the final policy to %s", out)
            table = before_after_table(self.logger.history)
            if table:
                log.info("held-out evaluation, before and after RL:\n%s", table)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self.logger is not None:
            self.logger.close()


@contextlib.contextmanager
def constant_learning_rate(learner: Learner, lr: float):
    """Run a stage (the cold start) at its own constant lr, then give the RL schedule back
    untouched: its step count, warm-up and decay start after the stage."""
    sched, groups = learner.scheduler, learner.optimizer.param_groups
    saved = (sched.num_steps, sched.max_lr, sched.min_lr, sched.init_lr,
             [(g.get("max_lr"), g.get("min_lr")) for g in groups])
    sched.max_lr = sched.min_lr = sched.init_lr = lr
    for g in groups:
        g["max_lr"] = g["min_lr"] = g["lr"] = lr
    try:
        yield
    finally:
        sched.num_steps, sched.max_lr, sched.min_lr, sched.init_lr, per_group = saved
        for g, (max_lr, min_lr) in zip(groups, per_group):
            for key, value in (("max_lr", max_lr), ("min_lr", min_lr)):
                if value is None:
                    g.pop(key, None)
                else:
                    g[key] = value
        sched.step(increment=0)  # re-apply the schedule's lr for its current step


def before_after_table(history: List[Dict[str, float]]) -> str:
    """First and last evaluated rows of the run, side by side ('' when nothing was evaluated)."""
    evals = [row for row in history if "eval/accuracy" in row]
    if not evals:
        return ""
    first, last = evals[0], evals[-1]
    keys = [k for k in first if k.startswith("eval/") and k in last]
    lines = [f"{'metric':<20} {'step ' + str(int(first['step'])):>12} {'step ' + str(int(last['step'])):>12}"]
    lines += [f"{k:<20} {first[k]:>12.4f} {last[k]:>12.4f}" for k in keys]
    return "\n".join(lines)


def _weight_sync_address(sync_cfg) -> str:
    return (sync_cfg.master_address or os.environ.get("GSPO_WEIGHT_SYNC_ADDR")
            or socket.gethostbyname(socket.gethostname()))


def build_parts(cfg, runtime) -> TrainerParts:
    """Construct every part of a run for this process (collective: call on every rank)."""
    from transformers import AutoTokenizer

    if not cfg.model.hf_path:
        raise ConfigError("model.hf_path: the trainer needs a Hugging Face directory for the "
                          "tokenizer and the rollout engine's architecture")
    if not cfg.data.train_path:
        raise ConfigError("data.train_path: no training prompts given")
    run_dir = Path(cfg.logging.run_dir)
    ckpt_root = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    train = load_prompt_dataset(cfg.data.train_path, tokenizer, cfg.data)
    sampler = PromptSampler(train.records, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    learner = Learner(cfg, runtime, total_steps=cfg.trainer.num_steps * cfg.batch.num_mini_batches)
    parts = TrainerParts(cfg=cfg, runtime=runtime, learner=learner, tokenizer=tokenizer,
                         sampler=sampler, policy_loss=get_policy_loss(cfg.algo.loss), sft_loss=sft_loss,
                         preemption=PreemptionFlag(), run_dir=run_dir, ckpt_root=ckpt_root)
    _initial_weights(parts)
    if cfg.algo.kl_coef > 0:
        parts.reference = Learner(cfg, runtime, total_steps=1)
        _load_initial(parts.reference, cfg)
    parts.logger = MetricsLogger(run_dir, cfg.logging.wandb,
                                 OmegaConf.to_container(cfg, resolve=True), enabled=runtime.is_main)
    if runtime.is_main:
        from gspo_megatron.rollout.factory import build_engine
        from gspo_megatron.weight_sync.factory import build_transport

        parts.engine = build_engine(cfg.rollout, model_path=cfg.model.hf_path,
                                    log_dir=str(run_dir / "logs"))
        from gspo_megatron.distributed.runtime import free_port

        build_transport(cfg.rollout.weight_sync, parts.engine, mode=cfg.rollout.mode,
                        server_tp_size=cfg.rollout.sglang.tp,
                        master_address=_weight_sync_address(cfg.rollout.weight_sync),
                        master_port=cfg.rollout.weight_sync.master_port or free_port(),
                        config_dir=cfg.model.hf_path)
        parts.reward_runner = RolloutScorer(RewardRunner.from_config(cfg.reward), tokenizer)
        if cfg.data.eval_path:
            parts.eval_prompts = load_prompt_dataset(cfg.data.eval_path, tokenizer, cfg.data).records
    if runtime.world_size > 1:
        dist.barrier()
    return parts


def _initial_weights(parts: TrainerParts) -> None:
    """Weights before RL: a converted checkpoint, else the HF directory itself."""
    cfg = parts.cfg
    if any(parts._complete_steps()) and cfg.checkpoint.resume != "never":
        return  # resume() will load the run's own checkpoint
    _load_initial(parts.learner, cfg)


def _load_initial(learner: Learner, cfg) -> None:
    if cfg.checkpoint.load_dir:
        read_meta(cfg.checkpoint.load_dir)
        learner.load_weights(cfg.checkpoint.load_dir)
    else:
        load_hf_into_learner(learner, cfg.model.hf_path)
