"""One rollout batch: prompts -> n samples each -> rewards -> group advantages -> dynamic sampling.

Runs on the process that drives the rollout engine (the main rank). The result is a plain,
picklable :class:`ScoredRollout` that the loop broadcasts to every learner rank. Generation seeds
depend only on (run seed, step, round), so a resumed run draws exactly the samples that an
uninterrupted one would.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from gspo_megatron.algorithms.advantages import DynamicSamplingBuffer, compute_group_advantages
from gspo_megatron.rollout.types import GenerationRequest, Sample, SamplingParams, prefix_cache_hit

log = logging.getLogger(__name__)


@dataclass
class ScoredRollout:
    """Samples of whole prompt groups (n consecutive samples per prompt) with rewards."""

    samples: List[Sample] = field(default_factory=list)
    rewards: List[float] = field(default_factory=list)
    advantages: List[float] = field(default_factory=list)
    metrics: Dict[str, float] = field(default_factory=dict)
    group_rewards: Dict[str, List[float]] = field(default_factory=dict)
    """Rewards of every generated group by prompt, dropped ones included (for query-set
    refresh); a prompt whose groups appear more than once holds all of their rewards."""
    num_prompts_drawn: int = 0
    """Prompts taken from the sampler (more than the batch when dynamic sampling refilled)."""
    token_lags: Optional[List[List[int]]] = None
    """Per sample, per response token: RL steps between the weights that generated it and the
    update it trains (``rollout.max_staleness >= 2``; None: every token is of the current or,
    one step off-policy, the previous weights)."""

    @property
    def num_sequences(self) -> int:
        return len(self.samples)


def generation_seed(run_seed: int, step: int, round_index: int = 0) -> int:
    return (run_seed * 1_000_003 + step * 101 + round_index) % (2**31)


def _score_round(prompts, engine, reward_runner, params: SamplingParams, n: int, algo_cfg):
    requests = [GenerationRequest(p.prompt_id, p.prompt_token_ids, n=n) for p in prompts]
    by_key = {s.key: s for s in engine.generate(requests, params)}
    # Engines return samples sorted by (prompt_id, index); regroup them in the prompts' order.
    samples = [by_key[(p.prompt_id, i)] for p in prompts for i in range(n)]
    by_id = {p.prompt_id: p for p in prompts}
    rewards = reward_runner.score(samples, by_id)
    groups = torch.tensor(rewards, dtype=torch.float64).view(len(prompts), n)
    adv, zero_var = compute_group_advantages(groups, mode=algo_cfg.advantage,
                                             eps=algo_cfg.advantage_eps)
    return samples, groups, adv, zero_var


def collect_rollout(sampler, engine, reward_runner, tokenizer, cfg, step: int) -> ScoredRollout:
    """Generate and score ``batch.num_prompts_per_step`` groups (fewer if dynamic sampling runs dry)."""
    n = cfg.rollout.n_samples_per_prompt
    dyn = cfg.algo.dynamic_sampling
    groups = DynamicSamplingBuffer(cfg.batch.num_prompts_per_step, drop_zero_variance=dyn.enabled)
    out = ScoredRollout()
    start = time.perf_counter()
    all_rewards: List[float] = []
    rounds = 1 + (dyn.max_rounds if dyn.enabled else 0)
    for round_index in range(rounds):
        if groups.is_full:
            break
        prompts = sampler.next_batch(groups.num_missing)
        out.num_prompts_drawn += len(prompts)
        params = SamplingParams.from_config(cfg.rollout,
                                            seed=generation_seed(cfg.trainer.seed, step, round_index))
        params = SamplingParams(**{**params.__dict__,
                                   "stop_token_ids": tuple(_eos_ids(tokenizer))})
        samples, rewards, adv, zero_var = _score_round(prompts, engine, reward_runner, params, n,
                                                       cfg.algo)
        all_rewards.extend(rewards.flatten().tolist())
        for g, prompt in enumerate(prompts):
            # a prompt drawn twice in one step keeps both groups' rewards
            out.group_rewards.setdefault(prompt.prompt_id, []).extend(rewards[g].tolist())
        groups.add([(samples[g * n:(g + 1) * n], rewards[g].tolist(), adv[g].tolist())
                    for g in range(len(prompts))], zero_var)
    for group_samples, group_rewards, group_adv in groups.take():
        out.samples.extend(group_samples)
        out.rewards.extend(group_rewards)
        out.advantages.extend(group_adv)
    if out.num_sequences == 0:
        raise RuntimeError(f"step {step}: dynamic sampling dropped every group in {rounds} rounds "
                           "(all rewards equal); lower the difficulty or disable "
                           "algo.dynamic_sampling")
    out.metrics = _rollout_metrics(out, all_rewards, groups, n, time.perf_counter() - start)
    out.metrics.update({k: v for k, v in engine.metrics.as_dict().items()
                        if k.startswith("rollout/tokens_per_s")})
    out.metrics.update(reward_runner.last_stats())
    return out


def _nearest_rank(sorted_values: List[int], q: float) -> float:
    """The ``q``-quantile by the nearest-rank rule (a value of the list, no interpolation)."""
    return float(sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)])


def _rollout_metrics(out: ScoredRollout, all_rewards: List[float], groups: DynamicSamplingBuffer,
                     n: int, seconds: float) -> Dict[str, float]:
    """Rewards of every generated sample (dropped groups included); lengths of the kept ones
    (their spread, p90 / p10 and max / min, is what a long-tail workload is measured by)."""
    lengths = sorted(len(s.response_token_ids) for s in out.samples)
    rewards_t = torch.tensor(all_rewards)
    hit = prefix_cache_hit(out.samples)  # server engines: rollout.sglang.routing's effect
    return {**({"rollout/prefix_cache_hit": hit} if hit is not None else {}),
        "reward/mean": float(rewards_t.mean()),
        "reward/std": float(rewards_t.std()) if len(all_rewards) > 1 else 0.0,
        "rollout/zero_variance_group_frac": groups.num_zero_variance / max(groups.num_seen, 1),
        "rollout/dropped_groups": float(groups.num_dropped),
        "rollout/num_sequences": float(out.num_sequences),
        "rollout/response_len_mean": sum(lengths) / len(lengths),
        "rollout/response_len_max": float(lengths[-1]),
        "rollout/response_len_min": float(lengths[0]),
        "rollout/response_len_p10": _nearest_rank(lengths, 0.1),
        "rollout/response_len_p90": _nearest_rank(lengths, 0.9),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in out.samples) / len(lengths),
        "time/rollout_s": seconds,
    }


def _eos_ids(tokenizer) -> List[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
