"""After a weight sync, check on every rollout server that the learner's weights arrived.

``rollout.weight_sync.verify``: each server generates a few tokens from a fixed prompt (the run's
first training prompt) at the run's temperature, and the learner recomputes the log-probs of
exactly those tokens (``Learner.compute_logprobs``, the pass that gives pi_old). The two are the
same policy's numbers when the update arrived: on the tiny fp32 model ~5e-7 per token (issue 28,
docs/real_sglang.md), while a server left with another update's weights is off by ~1e-1. A gap
above ``weight_sync.verify_tolerance`` (mean per token) stops the run with an error naming the
server, instead of training on samples from other weights. Cost: one short generation per
server and one forward pass over as many sequences, per sync.

Collective: every learner rank calls it (the main rank asks the servers and broadcasts their
answers; every rank takes part in the learner's pass). Server engines only: the embedded engine
shares the learner's process and takes weights by copy, checked bit for bit by its own tests.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from gspo_megatron.learner.batch import SequenceBatch
from gspo_megatron.rollout.types import SamplingParams

log = logging.getLogger(__name__)


class WeightsDidNotArrive(RuntimeError):
    """A rollout server answers with log-probs of other weights than the learner's."""


class SyncCheck:
    """Probe every server after a sync; ``__call__`` returns ``weight_sync/probe_abs_logp``."""

    def __init__(self, learner, engine, prompt_token_ids: Sequence[int], temperature: float,
                 tolerance: float, is_main: bool, max_new_tokens: int = 8) -> None:
        self.learner = learner
        self.engine = engine
        self.prompt = list(prompt_token_ids)
        self.params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=0)
        self.tolerance = tolerance
        self.is_main = is_main

    def _broadcast(self, obj):
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return obj

    def __call__(self, weight_version: Optional[str] = None) -> Dict[str, float]:
        probes = self.engine.probe_servers(self.prompt, self.params) if self.is_main else None
        probes = self._broadcast(probes)
        addresses: List[str] = sorted(probes)
        if not addresses:
            return {}
        # Every data-parallel rank needs a share: with fewer live servers than ranks (a server
        # died, a small fleet), the probes are repeated to a multiple of the ranks.
        dp = max(int(getattr(self.learner, "dp_size", 1)), 1)
        rows = [self.prompt + list(probes[a][0]) for a in addresses]
        rows = (rows * dp)[:-(-len(rows) // dp) * dp]
        batch = SequenceBatch(token_ids=rows, prompt_lens=[len(self.prompt)] * len(rows))
        learner_lp = self.learner.compute_logprobs(batch, temperature=self.params.temperature).logprobs
        if not self.is_main:
            return {}
        gaps = {a: float((torch.tensor(probes[a][1], dtype=torch.float32) - lp).abs().mean())
                for a, lp in zip(addresses, learner_lp)}
        worst = max(gaps, key=gaps.get)
        if gaps[worst] > self.tolerance:
            raise WeightsDidNotArrive(
                f"after the weight update to version {weight_version}, rollout server {worst} "
                f"answers a probe with log-probs {gaps[worst]:.3g} per token away from the "
                f"learner's (tolerance {self.tolerance:g}, rollout.weight_sync.verify_tolerance): "
                "it does not serve the learner's weights; its log names what it loaded")
        return {"weight_sync/probe_abs_logp": gaps[worst]}
