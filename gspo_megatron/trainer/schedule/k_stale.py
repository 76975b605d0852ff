"""k >= 2 (``rollout.max_staleness``): continuous generation across weight updates; the loop's
side of the generator (``k_stale_generator.py``). The calls of ``base.RolloutSchedule``:

    rollouts.submit(step, trained_steps)  # first step only: the generator starts (main rank)
    ready = rollouts.take(step)           # collective: B groups no older than k, prepared
    train(ready); rollouts.after_update(step)   # sync, then synced(step): the servers go on

``take`` prepares the batch under the learner's *current* weights: pi_old is then the proximal
policy of the decoupled objective (the weights before this update), and ``algo.tis`` weighs each
sequence by ``min(exp(mean_t(logp_prox - logp_behav)), C)`` against the log-probs the engine
sampled with (docs/algorithms.md). No weight snapshot is kept, whatever k is.

Versions and lags. The engine's weight versions are ``str(learner.step)`` (optimizer steps);
:meth:`synced` records which RL step each version belongs to, so a token's lag is counted in RL
steps: ``trained steps now - RL steps trained when its version was synced``.

Metrics per step (``async/...``): the fraction of tokens at each lag ``0 .. k``, the mean lag, the
fraction of samples spanning more than one version, groups dropped as too old or for equal
rewards, groups in flight and buffered, samples resumed across a weight update; the clip
fraction by lag comes from the loss (``train/clip_frac_*_lag*``).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Dict, List, Optional

from gspo_megatron.data.records import PromptRecord
from gspo_megatron.rollout.types import Sample, SamplingParams, prefix_cache_hit
from gspo_megatron.trainer.batching import token_lags
from gspo_megatron.trainer.preemption import AbandonMarker, StepAbandoned, raise_if_abandoned
from gspo_megatron.trainer.schedule.base import (ReadyRollout, RolloutSchedule, SyncWeights,
                                                 broadcast_from_main)
from gspo_megatron.trainer.schedule.collect import ScoredRollout, _eos_ids
from gspo_megatron.trainer.schedule.k_stale_generator import (AsyncGenerator, FinishedGroup,
                                                              sample_versions)
from gspo_megatron.trainer.schedule.k_stale_ledger import GroupLedger

log = logging.getLogger(__name__)


def groups_in_flight(cfg) -> int:
    """``rollout.async_groups_in_flight``, or (0) the groups that fill the client's concurrency
    cap over the fleet: the requests an on-policy batch would have in flight at once."""
    r = cfg.rollout
    if r.async_groups_in_flight:
        return int(r.async_groups_in_flight)
    servers = len(r.sglang.server_addresses) or r.sglang.num_servers
    cap = r.sglang.max_concurrency_per_server * max(servers, 1)
    return max(1, -(-cap // r.n_samples_per_prompt))


def engine_versions(samples: List[Sample]) -> Dict[str, int]:
    """Response tokens per weight version, as the engine reported them (``{"12": 30, ...}``):
    the raw record the ledger keeps beside each group's lag, so an audit can recount the lags
    without this module's version map (``lag_of``)."""
    counts: Dict[str, int] = {}
    for sample in samples:
        for version in sample_versions(sample):
            counts[str(version)] = counts.get(str(version), 0) + 1
    return counts


def engine_servers(samples: List[Sample]) -> Optional[list]:
    """Where a group's tokens came from and what was resent: ``[{address: tokens}, [reason,
    ...]]`` (each reason cut to 200 characters), the ledger's ``served`` record of the group;
    None for an engine without servers."""
    if all(s.served_by is None for s in samples):
        return None
    tokens: Dict[str, int] = {}
    for sample in samples:
        for address, count in (sample.served_by or {}).items():
            tokens[address] = tokens.get(address, 0) + count
    return [tokens, [reason[:200] for sample in samples for reason in sample.resent]]


class AsyncRollouts(RolloutSchedule):
    """Continuous generation with a staleness bound; see the module docstring."""

    def __init__(self, cfg, engine, sampler, reward_runner, tokenizer,
                 prepare: Callable[[ScoredRollout, Optional[list]], Any], learner, *,
                 is_main: bool, world_size: int, sync_weights: SyncWeights = dict,
                 abandonable: Callable[[], ContextManager] = nullcontext) -> None:
        self.cfg = cfg
        self.sync_weights = sync_weights
        """The loop's collective sync (``after_update``)."""
        self.abandonable = abandonable
        """Marks the main rank's wait for finished groups as one a deadline may cut."""
        self.prepare = prepare
        self.learner = learner
        self.sampler = sampler
        self.is_main = is_main
        self.world_size = world_size
        self.k = self.max_staleness = int(cfg.rollout.max_staleness)
        self._version_step: Dict[int, int] = {}
        """Weight version (learner optimizer step) -> RL steps trained when it was synced."""
        self._trained = 0
        self._started = False
        self._score_lock = threading.Lock()
        self._reward_runner = reward_runner
        self.generator: Optional[AsyncGenerator] = None
        if is_main:
            r = cfg.rollout
            params = SamplingParams.from_config(r, seed=cfg.trainer.seed)
            params = SamplingParams(**{**params.__dict__,
                                       "stop_token_ids": tuple(_eos_ids(tokenizer))})
            stall = getattr(engine, "stall_timeout_s", None)
            self.generator = AsyncGenerator(
                engine, sampler, self._score, params, n=r.n_samples_per_prompt,
                groups_per_step=cfg.batch.num_prompts_per_step, max_staleness=self.k,
                groups_in_flight=groups_in_flight(cfg),
                run_seed=cfg.trainer.seed, advantage_mode=cfg.algo.advantage,
                advantage_eps=cfg.algo.advantage_eps,
                drop_zero_variance=cfg.algo.dynamic_sampling.enabled,
                wait_timeout_s=stall() if stall is not None else r.sglang.request_timeout_s)
        self.engine = engine
        self._last_counters: Dict[str, float] = {}
        self.ledger = GroupLedger(cfg.logging.run_dir) if is_main else None
        """``async_groups.jsonl``: every group taken, dropped or left (``k_stale_ledger.py``)."""
        self._ledger_started = False
        self._taken: Optional[List[FinishedGroup]] = None
        """Main rank: the groups of the step being trained, until its sync (a dropped step
        puts them back)."""

    def _score(self, samples: List[Sample], record: PromptRecord) -> List[float]:
        with self._score_lock:  # one reward batch at a time: the runner keeps its last stats
            return self._reward_runner.score(samples, {record.prompt_id: record})

    # ---- the loop's calls ------------------------------------------------------------------
    def has(self, step: int) -> bool:
        """True once the generator runs: every later step takes from it."""
        return self._started

    def submit(self, step: int, trained_steps: int) -> None:
        """Start the generator (main rank) on the weights the engine now serves."""
        self.synced(trained_steps)
        self._started = True
        if self.ledger is not None and not self._ledger_started:
            self.ledger.start(None)
            self._ledger_started = True
        if self.generator is not None and not self.generator.started:
            self.generator.start()

    def synced(self, trained_steps: int) -> None:
        """The engine now serves the learner's weights after ``trained_steps`` RL steps."""
        self._taken = None
        self._trained = trained_steps
        self._version_step[int(self.learner.step)] = trained_steps
        if self.generator is not None:
            self.generator.synced(int(self.learner.step))

    def after_update(self, step: int) -> Dict[str, float]:
        """Sync the weights of ``step``, then count the lags of later tokens from them."""
        metrics = self.sync_weights()
        self.synced(trained_steps=step)
        return metrics

    def lag_of(self, version: int) -> int:
        """RL steps the learner has trained since the weights of ``version`` were synced."""
        if version not in self._version_step:
            raise RuntimeError(f"a sample carries weight version {version}, which this run "
                               f"never synced (known: {sorted(self._version_step)})")
        return self._trained - self._version_step[version]

    def start(self, step: int) -> None:
        """Nothing to start: the generator runs all the time."""

    def wait_idle(self) -> None:
        """Nothing to wait for: evaluation and probes share the servers with the generator."""

    def retire_saturated(self, group_rewards) -> List[str]:
        if self.generator is None:
            return self.sampler.retire_saturated(group_rewards)
        with self.generator.lock:
            return self.sampler.retire_saturated(group_rewards)

    def take(self, step: int) -> ReadyRollout:
        """Collective: ``B`` groups no older than ``k`` on every rank, prepared under the
        current weights (pi_old is the proximal policy)."""
        rollout, wait_s = None, 0.0
        if self.is_main:
            rollout, wait_s = self._main_rank_take(step)
        rollout = broadcast_from_main(rollout, self.world_size)
        raise_if_abandoned(rollout)
        t0 = time.perf_counter()
        prepared = self.prepare(rollout, None)
        lag = max((max(lags, default=0) for lags in rollout.token_lags), default=0)
        return ReadyRollout(rollout, prepared, policy_lag=lag, wait_s=wait_s,
                            prepare_s=time.perf_counter() - t0)

    def _main_rank_take(self, step: int):
        """Main rank: the step's rollout and the seconds waited, or an :class:`AbandonMarker`
        when a deadline cut the wait (the groups stay buffered: ``take`` removes them last)."""
        try:
            with self.abandonable():
                groups, wait_s = self.generator.take(self.lag_of)
        except StepAbandoned as exc:
            return AbandonMarker(str(exc)), 0.0
        self._taken = groups
        rollout = self._scored(groups)
        served = [(g, engine_servers(g.samples)) for g in groups]
        self.ledger.write(step, taken=[[g.index, g.record.prompt_id,
                                        max((max(x) for x in lags if x), default=0),
                                        engine_versions(g.samples)]
                                       for g, lags in zip(groups, self._group_lags(rollout))],
                          served=[[g.index, g.record.prompt_id, *where] for g, where in served
                                  if where is not None],
                          dropped=self.generator.drain_events())
        return rollout, wait_s

    def _scored(self, groups: List[FinishedGroup]) -> ScoredRollout:
        out = ScoredRollout()
        out.token_lags = []
        for g in groups:
            out.samples.extend(g.samples)
            out.rewards.extend(g.rewards)
            out.advantages.extend(g.advantages)
            out.group_rewards.setdefault(g.record.prompt_id, []).extend(g.rewards)
            out.token_lags.extend(token_lags(g.samples, self.lag_of))
        out.num_prompts_drawn = len(groups)
        out.metrics = self._metrics(out)
        return out

    def _group_lags(self, rollout: ScoredRollout) -> List[List[List[int]]]:
        n = self.cfg.rollout.n_samples_per_prompt
        return [rollout.token_lags[i:i + n] for i in range(0, len(rollout.token_lags), n)]

    def _metrics(self, out: ScoredRollout) -> Dict[str, float]:
        lags = [lag for per in out.token_lags for lag in per]
        lengths = [len(s.response_token_ids) for s in out.samples]
        metrics = {f"async/lag{j}_token_frac": sum(x == j for x in lags) / max(len(lags), 1)
                   for j in range(self.k + 1)}
        metrics["async/lag_mean"] = sum(lags) / max(len(lags), 1)
        metrics["async/multi_version_sample_frac"] = (
            sum(len(set(sample_versions(s))) > 1 for s in out.samples) / len(out.samples))
        gauges = self.generator.gauges()
        for key in ("dropped_stale_groups", "dropped_zero_variance_groups",
                    "discarded_in_flight_groups"):  # per step, from the running totals
            metrics[f"async/{key}"] = gauges[key] - self._last_counters.get(key, 0.0)
            self._last_counters[key] = gauges[key]
        metrics["async/in_flight_groups"] = gauges["in_flight_groups"]
        metrics["async/buffer_groups"] = gauges["buffer_groups"]
        partial = getattr(self.engine, "partial_rollout_metrics", None)
        if partial is not None:  # per step, from the engine's running totals
            for key, total in partial().items():
                metrics[key] = total - self._last_counters.get(key, 0.0)
                self._last_counters[key] = total
        rewards = out.rewards
        metrics.update({
            "reward/mean": sum(rewards) / len(rewards),
            "rollout/num_sequences": float(len(out.samples)),
            "rollout/response_len_mean": sum(lengths) / len(lengths),
            "rollout/response_len_max": float(max(lengths)),
            "rollout/truncated_frac": sum(s.finish_reason == "length" for s in out.samples)
            / len(lengths)})
        hit = prefix_cache_hit(out.samples)
        if hit is not None:
            metrics["rollout/prefix_cache_hit"] = hit
        return metrics

    # ---- checkpoints -----------------------------------------------------------------------
    def checkpoint_state(self) -> Optional[dict]:
        """The generator's buffer and prompts in flight, the version map (main rank's values;
        every rank saves what the main rank sent)."""
        state = None
        if self.is_main:  # drops so far belong to the steps this checkpoint holds
            self.ledger.write(self._trained, dropped=self.generator.drain_events())
            state = {"async": self.generator.snapshot(), "trained": self._trained,
                     "version_step": {str(v): s for v, s in self._version_step.items()}}
        return broadcast_from_main(state, self.world_size)

    def abandon_state(self):
        """``(pending state, sampler state)`` of a checkpoint of the state before the open step:
        the generator's buffer (with the open step's groups put back, if it had taken them) and
        groups in flight, the sampler as it is (None: the live one). Collective."""
        if self._taken and self.generator is not None:
            self.generator.put_back(self._taken)
        self._taken = None
        return self.checkpoint_state(), None

    def restore(self, state: Optional[dict]) -> None:
        if not state:
            return
        if "async" not in state:
            raise ValueError("the checkpoint's pending rollout was written by a run with "
                             "rollout.max_staleness <= 1; resume it with that setting")
        self._version_step = {int(v): int(s) for v, s in state["version_step"].items()}
        self._trained = int(state["trained"])
        if self.generator is not None:
            self.generator.restore(state["async"])
            # per-step counters count from the checkpoint's totals (the discarded groups: new)
            self._last_counters = {k: float(v) for k, v in state["async"]["counters"].items()}
            self.ledger.start(self._trained)
            self._ledger_started = True
        else:  # every rank's sampler holds the main rank's position
            self.sampler.load_state_dict(state["async"]["sampler"])

    def close(self) -> None:
        """Stop the generator; the ledger names the groups it leaves unfinished."""
        if self.generator is None:
            return
        self.generator.close()
        if self._ledger_started:
            self.ledger.write(self._trained, dropped=self.generator.drain_events(),
                              left=self.generator.unfinished())
