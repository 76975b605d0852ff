"""The GSPO loop, readable as one function: generate -> score -> update -> sync -> log -> save.

    for step in steps:
        rollout  = collect_rollout(...)                  # main rank: engine + rewards + advantages
        batch    = broadcast(rollout) -> SequenceBatch   # every learner rank
        old      = old_policy_pass(learner, batch)       # pi_old per mini-batch: learner or engine
        probe    = ExpertVolatilityProbe.start(...)      # MoE routing of a sample, before ...
        for mini, routing in old: learner.train_step(mini, loss, routing)  # routing: replay or None
        probe.finish()                                   # ... and after: expert volatility
        sync_weights(learner -> engine)
        log / evaluate / checkpoint

Parts are built in ``trainer/build.py``; this module only sequences them. Preemption (SIGUSR1 /
SIGTERM) checkpoints after the current step and exits with 124 so the Slurm script requeues.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Dict

import torch
import torch.distributed as dist
from tqdm import tqdm

from gspo_megatron.learner.optimizer import constant_learning_rate, reset_adam_state
from gspo_megatron.trainer.batching import rollout_to_sequence_batch, sft_batch
from gspo_megatron.trainer.build import TrainerParts
from gspo_megatron.trainer.evaluation import evaluate_accuracy
from gspo_megatron.trainer.expert_volatility import ExpertVolatilityProbe
from gspo_megatron.trainer.old_policy import old_policy_pass
from gspo_megatron.trainer.preemption import REQUEUE_EXIT_CODE
from gspo_megatron.trainer.sft_stop import SftStopRule
from gspo_megatron.trainer.rollout_step import collect_rollout

log = logging.getLogger(__name__)


def _broadcast_object(obj, parts: TrainerParts):
    if parts.runtime.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _any_rank(flag: bool, parts: TrainerParts) -> bool:
    if parts.runtime.world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class GSPOTrainer:
    """Sequences the parts of a run; see the module docstring for the order."""

    def __init__(self, parts: TrainerParts) -> None:
        self.p = parts
        self.cfg = parts.cfg
        self.step = 0

    # ---- the phases ----------------------------------------------------------------------
    def sync_weights(self) -> Dict[str, float]:
        start = time.perf_counter()
        stats = self.p.weight_sync()
        if self._colocated_main():  # the KV cache comes back and generation goes on
            self.p.engine.resume_memory()
        return {"time/weight_sync_s": time.perf_counter() - start, **stats}

    def _colocated_main(self) -> bool:
        return self.p.runtime.is_main and self.cfg.rollout.mode == "colocated"

    def evaluate(self) -> Dict[str, float]:
        if not self.p.runtime.is_main or self.p.eval_prompts is None:
            return {}
        return evaluate_accuracy(self.p.engine, self.p.eval_prompts, self.p.reward_runner,
                                 self.p.tokenizer, self.cfg)

    def cold_start(self) -> Dict[str, float]:
        """Supervised steps on reference answers before RL (the paper cold-starts its model);
        ``trainer.sft_stop_loss`` may end them early (``trainer/sft_stop.py``)."""
        t = self.cfg.trainer
        stop = SftStopRule(t.sft_stop_loss)
        steps = 0
        with constant_learning_rate(self.p.learner.optimizer, self.p.learner.scheduler, t.sft_lr):
            for i in tqdm(range(t.num_sft_steps), desc="cold-start SFT", dynamic_ncols=True,
                          disable=not self.p.runtime.is_main):
                records = self.p.sampler.next_batch(t.sft_batch_size)
                batch = sft_batch(records, self.p.tokenizer)
                metrics = self.p.learner.train_step(batch, self.p.sft_loss, temperature=1.0)
                steps = i + 1
                done = stop.update(metrics.get("loss", float("nan")))
                if self.p.runtime.is_main and (i % 50 == 0 or done or steps == t.num_sft_steps):
                    log.info("sft step %d/%d loss %.4f%s", steps, t.num_sft_steps,
                             metrics.get("loss", float("nan")),
                             f" (mean {stop.mean_loss:.4f} < {t.sft_stop_loss}: stop)" if done else "")
                if done:
                    break
        if t.num_sft_steps and t.reset_optimizer_after_sft:
            reset_adam_state(self.p.learner.optimizer)
        return {"sft/num_steps": float(steps), "sft/loss_mean": stop.mean_loss} if steps else {}

    def rl_step(self) -> Dict[str, float]:
        cfg, p = self.cfg, self.p
        t0 = time.perf_counter()
        rollout = None
        if p.runtime.is_main:
            rollout = collect_rollout(p.sampler, p.engine, p.reward_runner, p.tokenizer, cfg,
                                      self.step)
        if self._colocated_main():  # the learner's phases get the servers' memory
            p.engine.release_memory()
        rollout = _broadcast_object(rollout, p)
        if not p.runtime.is_main:  # every rank's sampler keeps the main rank's data position
            p.sampler.next_batch(rollout.num_prompts_drawn)
        batch = rollout_to_sequence_batch(rollout)
        metrics = dict(rollout.metrics)
        if cfg.data.retire_solved_prompts:  # every rank, so the samplers stay identical
            metrics["data/retired"] = float(len(p.sampler.retire_saturated(rollout.group_rewards)))
            metrics["data/active_prompts"] = float(p.sampler.num_active)

        t1 = time.perf_counter()
        if p.reference is not None:
            batch = replace(batch, ref_logprobs=p.reference.compute_logprobs(batch).logprobs)
        old = old_policy_pass(p.learner, batch, cfg)  # + the routing to replay (routing replay)
        metrics.update(old.metrics)
        metrics["time/old_logprobs_s"] = time.perf_counter() - t1

        volatility = ExpertVolatilityProbe.start(p.learner, batch, cfg)
        t2 = time.perf_counter()
        per_mini: Dict[str, list] = {}
        for mini, routing in zip(old.mini_batches, old.routings):
            for k, v in p.learner.train_step(mini, p.policy_loss, routing=routing).items():
                per_mini.setdefault(f"train/{k}", []).append(v)
        # Mean over the mini-batches that report a metric (a length bucket may be empty in some).
        metrics.update({k: sum(v) / len(v) for k, v in per_mini.items()})
        metrics["time/update_s"] = time.perf_counter() - t2
        metrics.update(volatility.finish())
        metrics.update(self.sync_weights())
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    # ---- the run -------------------------------------------------------------------------
    def _preempted_before_first_step(self) -> bool:
        """A signal during start-up or the cold start: nothing new to save, exit for requeue."""
        if not _any_rank(self.p.preemption.requested, self.p):
            return False
        log.warning("preemption signal before the first RL step: exiting %d without a new "
                    "checkpoint", REQUEUE_EXIT_CODE)
        return True

    def run(self) -> int:
        cfg, p = self.cfg, self.p
        resumed = p.checkpoints.resume()
        self.step = resumed.step if resumed else 0
        p.logger.start(self.step if resumed else None)  # metrics agree with the checkpoint
        if self._preempted_before_first_step():
            return REQUEUE_EXIT_CODE
        if resumed is None:
            sft = self.cold_start()
            if self._preempted_before_first_step():
                return REQUEUE_EXIT_CODE
            self.sync_weights()
            if p.runtime.is_main:
                p.logger.log(0, {**sft, **self.evaluate()})
        else:
            self.sync_weights()
        eval_every = cfg.trainer.eval_every_steps
        bar = tqdm(total=cfg.trainer.num_steps, initial=self.step, desc="GSPO steps",
                   disable=not p.runtime.is_main, dynamic_ncols=True)
        while self.step < cfg.trainer.num_steps:
            metrics = self.rl_step()
            self.step += 1
            bar.update(1)
            bar.set_postfix(reward=f"{metrics.get('reward/mean', 0.0):.3f}")
            last = self.step == cfg.trainer.num_steps
            if last or (eval_every and self.step % eval_every == 0):
                metrics.update(self.evaluate())
            if p.runtime.is_main:
                p.logger.log(self.step, metrics)
                log.info("step %d/%d %s", self.step, cfg.trainer.num_steps, _summary(metrics))
            preempted = _any_rank(p.preemption.requested, p)
            every = cfg.checkpoint.save_every_steps
            if last or preempted or (every and self.step % every == 0):
                p.checkpoints.save(self.step)
            if preempted and not last:
                log.warning("checkpointed step %d after %s; exiting %d for requeue", self.step,
                            p.preemption.signal_name or "a signal on another rank", REQUEUE_EXIT_CODE)
                return REQUEUE_EXIT_CODE
        bar.close()
        p.finish()
        return 0


def _summary(metrics: Dict[str, float], keys=("reward/mean", "eval/accuracy", "train/clip_frac_token",
                                               "train/clip_frac_seq", "time/step_s")) -> str:
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


def run_training(parts: TrainerParts) -> int:
    """Run the loop; the exit code is 0, or 124 after a preemption checkpoint."""
    try:
        return GSPOTrainer(parts).run()
    finally:
        parts.close()


__all__ = ["GSPOTrainer", "run_training"]
