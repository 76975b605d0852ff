"""The optimizer helpers: resetting Adam's state equals starting a fresh optimizer; a constant-lr
stage hands the learning-rate schedule back where it was."""

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


def test_constant_learning_rate_stage_gives_the_schedule_back_untouched():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from gspo_megatron.learner.optimizer import constant_learning_rate

    def fresh():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
        opt.param_groups[0]["max_lr"] = 2e-3  # a per-group override the schedule reads first
        sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4,
                                        lr_warmup_steps=2, lr_decay_steps=10,
                                        lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=10, wd_incr_style="constant")
        return opt, sched

    opt, sched = fresh()
    sched.step(1)
    with constant_learning_rate(opt, sched, 5e-5):
        assert opt.param_groups[0]["lr"] == 5e-5
        for _ in range(4):  # training steps inside the stage advance the schedule
            sched.step(1)
            assert opt.param_groups[0]["lr"] == pytest.approx(5e-5)
    ref_opt, ref_sched = fresh()
    ref_sched.step(1)
    assert sched.num_steps == ref_sched.num_steps == 1
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] > 0
    assert opt.param_groups[0]["max_lr"] == 2e-3 and "min_lr" not in opt.param_groups[0]
    sched.step(3)
    ref_sched.step(3)
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
