"""The machinery of the two step-by-step schedules: one rollout per step, produced in step
(``on_policy.py``, k = 0) or one step ahead (``one_step.py``, k = 1).

With ``rollout.max_staleness=1`` the rollout of step k+1 is generated while the learner trains
on step k, by the weights the learner had before step k (synced to the engine just before the
submission); step k+1 then trains on samples one update old. The same structure as slime's
``train_async.py`` and verl's one-step-off-policy recipe (generate the next batch before training
on the current one), written as one small object here so the loop stays a one-page read:

    rollout = pipeline.take(k)      # collective; blocks until step k's rollout is ready
    pipeline.submit(k + 1)          # after the weight sync: generation starts in the background
    train(rollout)

Production runs on the main rank in a background thread: the embedded engine then lives in its
own process (``rollout.embedded.process``), SGLang servers are remote, so the thread only waits.
Every rank tracks what was submitted, so the collectives (broadcast, log-prob pass) line up.

When a rollout is received, the loop's ``prepare`` turns it into the step's batch and pi_old
(``trainer/old_policy.py``). Old log-probs recomputed by the learner
(``algo.old_logprob_source=learner``) are taken under the *generating* weights: a
:class:`WeightSnapshot` is kept from submission to use, and ``prepare`` runs inside it.

Checkpoints stay exact: :meth:`checkpoint_state` finishes the in-flight rollout (and its learner
log-probs, while the snapshot still exists) and returns it as plain values for the checkpoint;
:meth:`restore` puts it back, so a resumed run trains on exactly the samples and pi_old an
uninterrupted one would have. The sampler state saved next to it already counts the rollout's
prompts. (The learner's recorded MoE routing, R2, is not saved: config validation refuses it with
the overlap. The engine's routing, R3, is part of the samples and is saved with them.)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Dict, Optional

import torch

from gspo_megatron.learner.weight_snapshot import WeightSnapshot, weights_swapped_in
from gspo_megatron.rollout.types import Sample
from gspo_megatron.trainer.preemption import AbandonMarker, StepAbandoned, raise_if_abandoned
from gspo_megatron.trainer.schedule.base import (ReadyRollout, RolloutSchedule, SyncWeights,
                                                 broadcast_from_main)
from gspo_megatron.trainer.schedule.collect import ScoredRollout

log = logging.getLogger(__name__)


class RolloutTimeout(RuntimeError):
    """A background rollout did not finish within its deadline."""


class _Background:
    """One call of ``fn`` in a daemon thread; ``result()`` joins and re-raises its error."""

    def __init__(self, fn: Callable[[], ScoredRollout], name: str) -> None:
        self._out: Dict[str, object] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._out["value"] = fn()
        except BaseException as exc:  # re-raised in the loop's thread
            self._out["error"] = exc

    def wait(self, timeout_s: Optional[float]) -> None:
        """Until ``fn`` returned; RolloutTimeout when it has not within ``timeout_s`` (None: no
        deadline, for engines without one of their own)."""
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            raise RolloutTimeout(f"background rollout {self._thread.name} did not finish within "
                                 f"{timeout_s:g}s (its deadline: the engine's stall bound, from "
                                 "rollout.sglang.request_timeout_s and max_retries)")

    def result(self, timeout_s: Optional[float] = None) -> ScoredRollout:
        """The value (or the error) of ``fn``, waited for as :meth:`wait` does."""
        self.wait(timeout_s)
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


class RolloutPipeline(RolloutSchedule):
    """Submits and hands over rollouts; see the module docstring. ``overlap``: the next step's
    rollout is generated while this one trains (``one_step.py`` sets it)."""

    overlap = False

    def __init__(self, produce: Callable[[int], ScoredRollout],
                 prepare: Callable[[ScoredRollout, Optional[list]], Any], learner, sampler, *,
                 is_main: bool, world_size: int, learner_logprobs: bool,
                 sync_weights: SyncWeights = dict, last_step: Optional[int] = None,
                 wait_timeout_s: Optional[float] = None,
                 abandonable: Callable[[], ContextManager] = nullcontext) -> None:
        self.max_staleness = int(self.overlap)
        self.sync_weights = sync_weights
        """The loop's collective sync, called by the hooks around the update."""
        self.last_step = last_step
        """The run's last RL step (no rollout is submitted past it); None: no end."""
        self.produce = produce
        self.prepare = prepare
        """``prepare(rollout, saved_old_logprobs)``: the step's batch and pi_old (collective);
        ``saved_old_logprobs`` (per mini-batch, per sequence) come from a checkpoint."""
        self.learner = learner
        self.sampler = sampler
        self.is_main = is_main
        self.world_size = world_size
        self.learner_logprobs = learner_logprobs
        self.wait_timeout_s = wait_timeout_s
        """The longest ``take`` waits for a background rollout (the engine's own stall deadline
        for SGLang servers, whose every request is bounded; None: the engine has no bound)."""
        self.abandonable = abandonable
        """Marks the main rank's wait for a rollout as one a deadline may cut
        (``trainer.preemption.PreemptionFlag.abandonable``)."""
        self._sampler_at_submit: Optional[dict] = None
        """The sampler's state before the pending rollout drew its prompts (every rank): what a
        checkpoint of an abandoned step holds, so that the resumed run draws them again."""
        self._step: Optional[int] = None  # the submitted step, on every rank
        self._version = 0
        self._snapshot: Optional[WeightSnapshot] = None
        self._job: Optional[_Background] = None
        self._ready: Optional[ReadyRollout] = None
        self._restored: Optional[tuple] = None  # (rollout, saved old log-probs) from a checkpoint

    def has(self, step: int) -> bool:
        return self._step == step

    def submit(self, step: int, trained_steps: int) -> None:
        """Start producing ``step``'s rollout with the engine's current weights, the learner's
        after ``trained_steps`` RL steps."""
        if self._step is not None:
            raise RuntimeError(f"rollout {self._step} is still pending; take it before submitting {step}")
        self._step, self._version = step, trained_steps
        self._sampler_at_submit = self.sampler.state_dict()
        if self.overlap and self.learner_logprobs:
            self._snapshot = WeightSnapshot.take(self.learner)
        if self.is_main and self.overlap:
            self._job = _Background(lambda: self.produce(step), name=f"rollout-{step}")

    def start(self, step: int) -> None:
        """Main rank: begin producing the submitted ``step`` in the background now, if it is
        not already (on-policy it is otherwise produced inside :meth:`take`), so that the
        caller can do collective work meanwhile (finish a checkpoint written in the
        background)."""
        if (self.is_main and self._step == step and self._job is None and self._ready is None
                and self._restored is None):
            self._job = _Background(lambda: self.produce(step), name=f"rollout-{step}")

    def wait_idle(self) -> None:
        """Let the in-flight generation finish (the engine is free after), keeping its result;
        at most ``wait_timeout_s`` (RolloutTimeout after it, naming the rollout and the deadline)."""
        if self._job is not None:
            self._job.wait(self.wait_timeout_s)

    def take(self, step: int) -> ReadyRollout:
        """Collective: ``step``'s rollout on every rank (submitted earlier, or produced now)."""
        if self._ready is None:
            self._ready = self._receive(step)
        ready, self._ready, self._step, self._snapshot = self._ready, None, None, None
        return ready

    def _receive(self, step: int) -> ReadyRollout:
        if self._step != step:
            raise RuntimeError(f"take({step}) but the pending rollout is for step {self._step}")
        t0 = time.perf_counter()
        if self._restored is not None:
            (rollout, saved), self._restored = self._restored, None
        else:
            saved = None
            rollout = broadcast_from_main(self._main_rank_rollout(step) if self.is_main else None,
                                          self.world_size)
            raise_if_abandoned(rollout)
            if not self.is_main:  # every rank's sampler keeps the main rank's data position
                self.sampler.next_batch(rollout.num_prompts_drawn)
        wait_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        snapshot = self._snapshot or WeightSnapshot(self.learner.step, [])  # none: current weights
        with weights_swapped_in(self.learner, snapshot):
            prepared = self.prepare(rollout, saved)
        return ReadyRollout(rollout, prepared, policy_lag=step - 1 - self._version,
                            wait_s=wait_s, prepare_s=time.perf_counter() - t1)

    def _main_rank_rollout(self, step: int):
        """Main rank: ``step``'s rollout, or an :class:`AbandonMarker` when a deadline cut the
        wait for it (the background job, if any, is left to the engine's cancellation)."""
        try:
            with self.abandonable():
                job = self._job
                rollout = job.result(self.wait_timeout_s) if job is not None else self.produce(step)
        except StepAbandoned as exc:
            return AbandonMarker(str(exc))
        self._job = None
        return rollout

    def retire_saturated(self, group_rewards) -> list:
        """Every rank, so the samplers stay identical (``data.retire_solved_prompts``)."""
        return self.sampler.retire_saturated(group_rewards)

    # ---- checkpoints -----------------------------------------------------------------------
    def checkpoint_state(self) -> Optional[dict]:
        """Collective: the in-flight rollout, finished, as plain values (None when none is)."""
        if self._step is None:
            return None
        if self._ready is None:
            self._ready = self._receive(self._step)
        ready = self._ready
        old = None
        if self.learner_logprobs:  # the generating weights are gone after a restart: keep pi_old
            old = [[t.tolist() for t in mini.old_logprobs]
                   for mini in ready.prepared.old.mini_batches]
        return {"step": self._step, "version": self._version,
                "rollout": dataclasses.asdict(ready.rollout), "old_logprobs": old}

    def abandon_state(self):
        """``(pending rollout, sampler state)`` of a checkpoint of the state before the open
        step, which is dropped: nothing pending, the sampler before the step's prompts were
        drawn. With the overlap the resumed run generates that rollout again, with the newer
        weights (its policy lag is 0 for that one step)."""
        return None, self._sampler_at_submit

    def restore(self, state: Optional[dict]) -> None:
        """Put back what :meth:`checkpoint_state` saved (its prompts are already drawn)."""
        if not state:
            return
        if "async" in state:
            raise ValueError("the checkpoint's pending rollouts were written by a run with "
                             "rollout.max_staleness >= 2; resume it with that setting")
        data = dict(state["rollout"])
        data["samples"] = [Sample(**s) for s in data["samples"]]
        old = state["old_logprobs"]
        if old is not None:
            old = [[torch.tensor(x, dtype=torch.float32) for x in mini] for mini in old]
        self._step, self._version = int(state["step"]), int(state["version"])
        self._restored = (ScoredRollout(**data), old)

    def close(self) -> None:
        """Wait for a background generation (after an error, before the engine shuts down); one
        past its deadline is left to the engine's shutdown, logged, not raised over the error
        that ended the run."""
        try:
            self.wait_idle()
        except RolloutTimeout as exc:
            log.error("%s; shutting the engine down under it", exc)
