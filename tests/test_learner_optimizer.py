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
