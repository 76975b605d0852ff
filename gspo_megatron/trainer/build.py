"""Build the parts of a run from its config, and the few operations that span several parts.

The loop (``trainer/loop.py``) only sequences; everything that knows how a part is made lives
here: the learner on every rank, the rollout engine, rewards and logger on the main rank, the
data sampler on every rank (they advance in step, so no prompts are broadcast), the run's
checkpoints (``trainer/checkpoints.py``: resume decision, save, rotation), and the weight sync
that streams the learner's parameters, gathered into Hugging Face names, into the engine.

Inputs are checked (``trainer/preflight.py``) and the resume decision is taken before the
learner is built, so a bad path or a changed dataset fails in seconds with nothing written.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch.distributed as dist
from omegaconf import OmegaConf

from gspo_megatron.algorithms.losses import get_policy_loss
from gspo_megatron.data.dataset import load_prompt_dataset
from gspo_megatron.data.sampler import PromptSampler
from gspo_megatron.learner.learner import Learner
from gspo_megatron.learner.sft_loss import sft_loss
from gspo_megatron.rewards.runner import RewardRequest, RewardRunner
from gspo_megatron.trainer.hf_weights import (export_learner_to_hf, learner_hf_tensors,
                                              load_hf_into_learner)
from gspo_megatron.trainer.checkpoints import RunCheckpoints, data_identity, plan_resume
from gspo_megatron.trainer.metrics_log import MetricsLogger
from gspo_megatron.trainer.plot import plot_history
from gspo_megatron.trainer.preemption import PreemptionFlag
from gspo_megatron.trainer.preflight import (check_initial_weights, check_input_files,
                                             load_tokenizer)

log = logging.getLogger(__name__)


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

    # ---- end of run ----------------------------------------------------------------------
    def finish(self) -> None:
        """Plot and export the final policy to Hugging Face format."""
        out = export_learner_to_hf(self.learner, self.run_dir / "hf_export",
                                   tokenizer_dir=self.cfg.model.hf_path)
        if self.runtime.is_main:
            if self.cfg.logging.plot:
                try:
                    plot_history(self.logger.history, self.run_dir / "metrics.png")
                except OSError as exc:  # the plot is a convenience; metrics.jsonl has the data
                    log.warning("could not write %s: %s", self.run_dir / "metrics.png", exc)
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


def build_parts(cfg, runtime, preemption: Optional[PreemptionFlag] = None) -> TrainerParts:
    """Construct every part of a run for this process (collective: call on every rank)."""
    check_input_files(cfg)
    run_dir = Path(cfg.logging.run_dir)
    tokenizer = load_tokenizer(cfg.model.hf_path)
    train = load_prompt_dataset(cfg.data.train_path, tokenizer, cfg.data)
    sampler = PromptSampler(train.records, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    eval_records = (load_prompt_dataset(cfg.data.eval_path, tokenizer, cfg.data).records
                    if cfg.data.eval_path and runtime.is_main else None)
    data = data_identity(cfg.data.train_path, sampler.state_dict())
    resume_from = plan_resume(cfg, data, runtime.is_main)
    check_initial_weights(cfg, resuming=resume_from is not None)
    learner = Learner(cfg, runtime, total_steps=cfg.trainer.num_steps * cfg.batch.num_mini_batches)
    checkpoints = RunCheckpoints(cfg, learner, sampler, runtime.is_main, data, resume_from)
    parts = TrainerParts(cfg=cfg, runtime=runtime, learner=learner, tokenizer=tokenizer,
                         sampler=sampler, policy_loss=get_policy_loss(cfg.algo.loss), sft_loss=sft_loss,
                         preemption=preemption or PreemptionFlag(), run_dir=run_dir,
                         checkpoints=checkpoints, eval_prompts=eval_records)
    if resume_from is None:  # otherwise the run's own checkpoint holds the weights
        _load_initial(learner, cfg)
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
        from gspo_megatron.distributed.host_address import update_group_address
        from gspo_megatron.distributed.runtime import free_port

        build_transport(cfg.rollout.weight_sync, parts.engine, mode=cfg.rollout.mode,
                        server_tp_size=cfg.rollout.sglang.tp,
                        master_address=update_group_address(cfg.rollout.weight_sync.master_address,
                                                            cfg.rollout.sglang.server_addresses),
                        master_port=cfg.rollout.weight_sync.master_port or free_port(),
                        config_dir=cfg.model.hf_path)
        parts.reward_runner = RolloutScorer(RewardRunner.from_config(cfg.reward), tokenizer)
    if runtime.world_size > 1:
        dist.barrier()
    return parts


def _load_initial(learner: Learner, cfg) -> None:
    """Weights before RL: a converted checkpoint, else the HF directory itself."""
    if cfg.checkpoint.load_dir:
        learner.load_weights(cfg.checkpoint.load_dir)
    else:
        load_hf_into_learner(learner, cfg.model.hf_path)
