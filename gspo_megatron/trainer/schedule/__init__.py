"""When rollouts are generated and taken: one file per ``rollout.max_staleness`` (k).

    base.py               the interface the loop calls (RolloutSchedule, ReadyRollout)
    on_policy.py          k = 0: generate in step, sync after the update
    one_step.py           k = 1: generate step k+1 while step k trains
    one_step_threads.py      its thread split, and whether the overlap pays on this machine
    stepwise.py              the machinery of k = 0 and k = 1 (one rollout per step, checkpoints)
    k_stale.py            k >= 2: continuous generation across weight updates, staleness bound
    k_stale_generator.py     the generator: admission, earliest-deadline-first taking, drops
    k_stale_ledger.py        async_groups.jsonl: what became of every prompt group
    collect.py            one rollout batch: generate, score, group advantages (k = 0 and 1)

``schedule_for`` builds the loop's schedule from the config. The modules are imported there,
not here: ``trainer/batching.py`` imports ``collect`` and ``k_stale`` imports ``batching``.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional

from gspo_megatron.config.schema import rollout_staleness


def schedule_for(cfg, engine, sampler, reward_runner, tokenizer, learner, *, produce, prepare,
                 sync_weights, is_main: bool, world_size: int,
                 wait_timeout_s: Optional[float] = None,
                 abandonable: Optional[Callable[[], ContextManager]] = None) -> Any:
    """The ``RolloutSchedule`` of ``rollout.max_staleness``: ``OnPolicyRollouts`` (0),
    ``OneStepRollouts`` (1) or ``AsyncRollouts`` (>= 2). ``produce(step)``: the main rank's
    rollout of a step (k <= 1); ``prepare(rollout, saved_old_logprobs)``: the batch and pi_old
    (collective); ``sync_weights()``: the loop's sync, called by the hooks around the update."""
    from contextlib import nullcontext

    k = rollout_staleness(cfg.rollout)
    abandonable = abandonable or nullcontext
    if k >= 2:
        from gspo_megatron.trainer.schedule.k_stale import AsyncRollouts
        return AsyncRollouts(cfg, engine, sampler, reward_runner, tokenizer, prepare, learner,
                             is_main=is_main, world_size=world_size, sync_weights=sync_weights,
                             abandonable=abandonable)
    if k == 1:
        from gspo_megatron.trainer.schedule.one_step import OneStepRollouts
        step_schedule = OneStepRollouts
    else:
        from gspo_megatron.trainer.schedule.on_policy import OnPolicyRollouts
        step_schedule = OnPolicyRollouts
    return step_schedule(produce, prepare, learner, sampler, is_main=is_main, world_size=world_size,
               learner_logprobs=cfg.algo.old_logprob_source == "learner",
               sync_weights=sync_weights, last_step=cfg.trainer.num_steps,
               wait_timeout_s=wait_timeout_s, abandonable=abandonable)


__all__ = ["schedule_for"]
