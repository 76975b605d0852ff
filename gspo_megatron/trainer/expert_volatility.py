"""Expert volatility: how much one step's updates change the MoE routing of its own rollout.

The GSPO paper (section 5.3) reports that on the 48-layer Qwen3-30B-A3B about 10% of the experts
activated for a rollout change after one gradient update, which is why GRPO's token ratios
become noisy there (and need Routing Replay) while GSPO's sequence ratios do not. Here, each step:

    probe = ExpertVolatilityProbe.start(learner, batch, cfg)   # before the step's updates
    ... train on the mini-batches ...
    metrics.update(probe.finish())                             # after them

records the top-k experts of every MoE layer for a sample of the rollout batch (evenly spaced
sequences, ``algo.diagnostics.expert_volatility_num_seqs``) with the weights that generated it,
records them again after the updates, and reports over the (response token, MoE layer) pairs
``routing/expert_set_changed_frac`` (the top-k set differs) and
``routing/activated_expert_changed_frac`` (activated experts no longer activated, the paper's
measure). The cost is two forward passes over the sample. Dense models report nothing.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

from gspo_megatron.learner.batch import SequenceBatch
from gspo_megatron.trainer.batching import take_sequences


def evenly_spaced(num_total: int, num_wanted: int) -> list:
    """``num_wanted`` indices spread over ``range(num_total)`` (all of them when it is less)."""
    if num_wanted >= num_total:
        return list(range(num_total))
    return [(k * num_total) // num_wanted for k in range(num_wanted)]


class ExpertVolatilityProbe:
    """Routing of a sample before the updates; :meth:`finish` compares it with after."""

    def __init__(self, learner=None, sample: Optional[SequenceBatch] = None, before=None,
                 seconds: float = 0.0) -> None:
        self.learner, self.sample, self.before, self.seconds = learner, sample, before, seconds

    @classmethod
    def start(cls, learner, batch: SequenceBatch, cfg) -> "ExpertVolatilityProbe":
        """Record the sample's routing now (collective); an inert probe when off or dense."""
        num = cfg.algo.diagnostics.expert_volatility_num_seqs
        if num == 0 or not any(learner.routers):
            return cls()
        start = time.perf_counter()
        # Never fewer sequences than data-parallel ranks (every rank needs one to plan).
        sample = take_sequences(batch, evenly_spaced(len(batch), max(num, learner.dp_size)))
        before = learner.record_routing(sample)
        return cls(learner, sample, before, time.perf_counter() - start)

    def finish(self) -> Dict[str, float]:
        """Routing after the updates vs before, as ``routing/*`` metrics ({} when inert)."""
        if self.learner is None:
            return {}
        start = time.perf_counter()
        after = self.learner.record_routing(self.sample)
        out = {f"routing/{k}": v for k, v in self.learner.routing_change(self.before, after).items()}
        out["time/expert_volatility_s"] = self.seconds + time.perf_counter() - start
        return out
