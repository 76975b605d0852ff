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


def test_cpu_adam_is_fused_and_steps_like_the_loop():
    """Megatron's torch-AdamW fallback switched to the fused CPU kernel: same update, one call."""
    from types import SimpleNamespace

    from gspo_megatron.learner.optimizer import _fuse_cpu_adam

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs = dict(lr=1e-2, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8)
    fused = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], **kwargs)
    loop = torch.optim.AdamW(twins, foreach=False, **kwargs)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=fused),
                                                  SimpleNamespace(optimizer=None)])
    assert _fuse_cpu_adam(chained) == 2
    assert all(g["fused"] and not g["foreach"] for g in fused.param_groups)
    assert _fuse_cpu_adam(chained) == 0  # idempotent
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        fused.step()
        loop.step()
    for p, q in zip(params, twins):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()
    assert fused.state[params[0]]["step"].dtype == torch.float32


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


def test_memory_options_map_onto_megatrons_optimizer_config():
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    from gspo_megatron.config.schema import OptimizerConfig
    from gspo_megatron.learner.optimizer import optimizer_config_kwargs

    plain = optimizer_config_kwargs(OptimizerConfig(), torch.bfloat16)
    assert "use_precision_aware_optimizer" not in plain and "optimizer_cpu_offload" not in plain
    aware = optimizer_config_kwargs(OptimizerConfig(precision_aware=True, moments_dtype="bf16"),
                                    torch.bfloat16)
    assert aware["use_precision_aware_optimizer"] is True
    assert aware["exp_avg_dtype"] == aware["exp_avg_sq_dtype"] == torch.bfloat16
    offload = optimizer_config_kwargs(OptimizerConfig(cpu_offload=True, offload_fraction=0.5),
                                      torch.bfloat16)
    # Megatron 0.16.1 builds this config without Transformer Engine (the precision-aware one
    # asks TE for its version in __post_init__, so it is checked as keyword arguments above).
    mcfg = MegatronOptimizerConfig(**offload)
    assert mcfg.optimizer_cpu_offload and mcfg.optimizer_offload_fraction == 0.5
    assert mcfg.overlap_cpu_optimizer_d2h_h2d and mcfg.use_distributed_optimizer
    assert mcfg.exp_avg_dtype == torch.float32


def test_memory_options_refuse_to_run_without_gpus():
    from gspo_megatron.config import ConfigError
    from gspo_megatron.config.schema import OptimizerConfig
    from gspo_megatron.learner.optimizer import build_optimizer

    with pytest.raises(ConfigError, match="optimizer.cpu_offload: needs GPUs"):
        build_optimizer(OptimizerConfig(cpu_offload=True), [], torch.float32)
