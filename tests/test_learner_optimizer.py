"""The optimizer helpers: resetting Adam's state equals starting a fresh optimizer."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_on_ranks
from tests.test_learner_learner import _gspo, make_batch, tiny_cfg


def _reset_vs_fresh(rank: int, root: str) -> dict:
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner
    from gspo_megatron.learner.optimizer import reset_adam_state

    cfg = tiny_cfg()
    cfg.optimizer.warmup_steps = 0
    runtime = init_distributed(cfg.parallel, seed=3)
    used = Learner(cfg, runtime, total_steps=10)
    lp = used.compute_logprobs(make_batch(0)).logprobs
    used.train_step(make_batch(0, old=lp), _gspo())
    used.save_weights(f"{root}/after_first")
    dropped = reset_adam_state(used.optimizer)
    used.train_step(make_batch(1, old=lp), _gspo())

    fresh = Learner(cfg, runtime, total_steps=10)
    fresh.load_weights(f"{root}/after_first")
    fresh.train_step(make_batch(1, old=lp), _gspo())
    pairs = zip(used.model[0].module.parameters(), fresh.model[0].module.parameters())
    diff = max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)
    return {"dropped": dropped, "diff": diff}


@pytest.mark.slow
def test_reset_adam_state_equals_a_fresh_optimizer(tmp_path):
    out = run_on_ranks(_reset_vs_fresh, world_size=1, timeout_s=300, root=str(tmp_path))[0]
    assert out["dropped"] > 0
    assert out["diff"] < 1e-7, out["diff"]
