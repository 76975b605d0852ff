"""The forward-only learner gives the training Learner's log-probs, at TP2 x EP2 on 2 gloo ranks,
and refuses to train."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_on_ranks
from tests.test_learner_learner import make_batch, tiny_cfg


def _both(rank: int):
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner
    from gspo_megatron.learner.logprob_learner import LogprobLearner

    cfg = tiny_cfg(tp=2, ep=2, sp=True)
    rt = init_distributed(cfg.parallel, seed=3)
    learner = Learner(cfg, rt)
    policy = LogprobLearner(cfg, rt)
    assert policy.optimizer is None
    assert not any(p.requires_grad for p in policy.model[0].parameters())
    policy.model[0].load_state_dict(learner.model[0].module.state_dict())
    batch = make_batch(0)
    want = learner.compute_logprobs(batch, temperature=1.0).logprobs
    got = policy.compute_logprobs(batch, temperature=1.0).logprobs
    with pytest.raises(TypeError, match="forward-only"):
        policy.train_step(batch, None)
    return [float((a - b).abs().max()) for a, b in zip(want, got)], [len(g) for g in got]


def test_logprob_learner_equals_learner_at_tp2_ep2():
    results = run_on_ranks(_both, world_size=2, timeout_s=300)
    for gaps, lengths in results:
        assert lengths == [len(t) - p for t, p in zip(make_batch(0).token_ids,
                                                      make_batch(0).prompt_lens)]
        assert max(gaps) == 0.0, gaps
