"""pi_old of one rollout batch: the mini-batches with the log-probs the ratio divides by, and,
with routing replay, the MoE routing each mini-batch's training pass must replay: recorded by
the learner's old-policy pass (``algo.routing_replay=learner``, R2) or the rollout engine's,
carried by the samples (``rollout``, R3; the old-policy pass replays it too).

    old = old_policy_pass(learner, batch, cfg)
    for mini, routing in zip(old.mini_batches, old.routings):
        learner.train_step(mini, loss, routing=routing)

``algo.old_logprob_source=rollout`` (paper section 5.4): the engine's log-probs, already in the
batch, no learner pass. ``learner``: a forward pass per mini-batch recomputes them with the
weights that generated the rollout (before the step's first update); the pass runs per
mini-batch, not over the whole batch, because a recorded routing can only be replayed on the
micro-batches it was recorded on (``learner/routing.py``), and the cost is the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from gspo_megatron.config.schema import routing_replay_mode
from gspo_megatron.learner.batch import SequenceBatch
from gspo_megatron.learner.routing import RoutingTape
from gspo_megatron.trainer.batching import split_mini_batches, with_old_logprobs


@dataclass
class OldPolicy:
    """The step's mini-batches (``old_logprobs`` set) and their routings (None: no replay)."""

    mini_batches: List[SequenceBatch]
    routings: List[Optional[RoutingTape]]
    metrics: Dict[str, float] = field(default_factory=dict)


def old_policy_pass(learner, batch: SequenceBatch, cfg,
                    saved: Optional[List[List[torch.Tensor]]] = None) -> OldPolicy:
    """Split ``batch`` into ``batch.num_mini_batches`` and attach pi_old (collective).

    ``saved``: the learner's pi_old of these mini-batches from a checkpoint (one tensor per
    sequence, per mini-batch), attached without a pass; a one-step off-policy run keeps it for
    its in-flight rollout, whose generating weights are gone after a restart."""
    minis = split_mini_batches(batch, cfg.batch.num_mini_batches, cfg.rollout.n_samples_per_prompt)
    replay = routing_replay_mode(cfg.algo)
    engine_routing = [learner.rollout_routing(m) if replay == "rollout" else None for m in minis]
    if saved is None and cfg.algo.old_logprob_source != "learner":
        return OldPolicy(minis, engine_routing)
    if saved is not None and [len(s) for s in saved] != [len(m) for m in minis]:
        raise ValueError("saved old log-probs do not match the rollout's mini-batches")
    out_minis, routings, gaps = [], [], []
    for i, mini in enumerate(minis):
        if saved is not None:
            logprobs, routing = saved[i], engine_routing[i]
        else:
            out = learner.compute_logprobs(mini, record_routing=replay == "learner",
                                           replay=engine_routing[i])
            logprobs = out.logprobs
            routing = out.routing if replay == "learner" else engine_routing[i]
        # Engine vs learner log-probs: on-policy and one step off (pi_old under the generating
        # weights) the same weights in two engines; at k >= 2 pi_old is the proximal policy, so
        # the gap also holds the lag (train/mismatch_* and the lag metrics split it).
        if mini.rollout_logprobs is not None:
            gaps += [float((a - b).abs().mean()) for a, b in zip(logprobs, mini.rollout_logprobs)]
        out_minis.append(with_old_logprobs(mini, logprobs))
        routings.append(routing)
    metrics = {"rollout/learner_vs_engine_abs_logp": sum(gaps) / len(gaps)} if gaps else {}
    return OldPolicy(out_minis, routings, metrics)
