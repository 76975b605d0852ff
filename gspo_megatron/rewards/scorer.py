"""Score generated samples: decode each response and hand it, with its prompt's reference answer
and metadata, to a :class:`~gspo_megatron.rewards.runner.RewardRunner`.

The rollout step and the held-out evaluation both score through this one object, so a failing
or slow reward is counted the same way in both (0 reward, ``reward/num_errors`` /
``reward/num_timeouts``).

    scorer = RolloutScorer(RewardRunner.from_config(cfg.reward), tokenizer)
    rewards = scorer.score(samples, {r.prompt_id: r for r in prompts})   # one per sample
    metrics.update(scorer.last_stats())
"""

from __future__ import annotations

from typing import Dict, List

from gspo_megatron.rewards.runner import RewardRequest, RewardRunner


class RolloutScorer:
    """Decode responses and score them with the reward runner (0 for a failing reward)."""

    def __init__(self, runner: RewardRunner, tokenizer) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self._stats: Dict[str, float] = {}

    def score(self, samples, records_by_id) -> List[float]:
        """One reward per sample, in order; ``records_by_id`` maps prompt ids to prompt records
        (anything with ``answer`` and ``metadata``)."""
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
        """Counters of the last :meth:`score` call, as run metrics."""
        return dict(self._stats)
