"""Virtual pipeline (interleaved 1F1B) against a single process, on a 4-layer tiny Qwen3-MoE.

PP=2 with two virtual stages per rank puts layers 0 and 2 on rank 0 and layers 1 and 3 on rank
1, and runs Megatron's interleaved schedule. Per-token log-probs, the GSPO loss, the grad norm
and every weight after one optimizer step must match the single-process run (fp32, gloo), and a
checkpoint saved under PP=2/VPP=2 must resume in one process with the same next step.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_on_ranks
from tests.test_learner_learner import _gspo, make_batch, tiny_cfg

LP_ATOL, LOSS_RTOL, WEIGHT_ATOL = 2e-5, 1e-4, 2e-6


def four_layer_cfg(**parallel):
    cfg = tiny_cfg(**parallel)
    cfg.model.num_layers = 4
    return cfg


def _max_weight_diff(learner, cfg, directory) -> float:
    """Largest |w - w_ref| over this rank's chunks, chunk by chunk (names repeat across chunks)."""
    from gspo_megatron.learner.checkpointing import load_model_weights
    from gspo_megatron.model.provider import build_gpt_model

    vpp = cfg.parallel.vpp
    fresh = [build_gpt_model(cfg.model, cfg.parallel, vp_stage=i if vpp else None)
             for i in range(vpp or 1)]
    load_model_weights(fresh, directory)
    worst = 0.0
    for chunk, ref_chunk in zip(learner.model, fresh):
        ref = dict(ref_chunk.named_parameters())
        for name, p in chunk.module.named_parameters():
            worst = max(worst, float((p.detach() - ref[name].detach()).abs().max()))
    return worst


def _single(rank: int, root: str) -> dict:
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner

    cfg = four_layer_cfg()
    learner = Learner(cfg, init_distributed(cfg.parallel, seed=5), total_steps=10)
    learner.save_weights(f"{root}/init")
    lp = learner.compute_logprobs(make_batch(0)).logprobs
    m1 = learner.train_step(make_batch(0, old=lp), _gspo())
    learner.save_weights(f"{root}/single_step1")
    m2 = learner.train_step(make_batch(1, old=lp), _gspo())
    learner.save_weights(f"{root}/single_step2")
    return {"lp": lp, "m1": m1, "m2": m2}


def _interleaved(rank: int, root: str, ref: dict) -> dict:
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner

    cfg = four_layer_cfg(pp=2, vpp=2)
    learner = Learner(cfg, init_distributed(cfg.parallel, seed=5), total_steps=10)
    learner.load_weights(f"{root}/init")
    lp = learner.compute_logprobs(make_batch(0)).logprobs
    plan = learner.plan(make_batch(0, old=ref["lp"]))
    m1 = learner.train_step(make_batch(0, old=ref["lp"]), _gspo())
    w1 = _max_weight_diff(learner, cfg, f"{root}/single_step1")
    learner.save_checkpoint(f"{root}/vpp_step1", form="portable")  # resumed by one process
    return {"lp_diff": max(float((a - b).abs().max()) for a, b in zip(lp, ref["lp"])),
            "m1": m1, "w1_diff": w1, "num_chunks": len(learner.model),
            "num_micro": len(plan.micro_batches)}


def _resume_single(rank: int, root: str, ref: dict) -> dict:
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner

    cfg = four_layer_cfg()
    learner = Learner(cfg, init_distributed(cfg.parallel, seed=5), total_steps=10)
    learner.load_checkpoint(f"{root}/vpp_step1")
    m2 = learner.train_step(make_batch(1, old=ref["lp"]), _gspo())
    return {"m2": m2, "w2_diff": _max_weight_diff(learner, cfg, f"{root}/single_step2"),
            "step": learner.step}


@pytest.mark.slow
def test_interleaved_pipeline_matches_single_process_and_resumes(tmp_path):
    root = str(tmp_path)
    ref = run_on_ranks(_single, world_size=1, timeout_s=600, root=root)[0]
    results = run_on_ranks(_interleaved, world_size=2, timeout_s=600, root=root, ref=ref)
    assert abs(ref["m1"]["loss"]) > 0.05 and ref["m1"]["grad_norm"] > 0.0
    for got in results:
        assert got["num_chunks"] == 2 and got["num_micro"] % 2 == 0
        assert got["lp_diff"] < LP_ATOL, got["lp_diff"]
        assert got["m1"]["loss"] == pytest.approx(ref["m1"]["loss"], rel=LOSS_RTOL, abs=1e-6)
        assert got["m1"]["grad_norm"] == pytest.approx(ref["m1"]["grad_norm"], rel=LOSS_RTOL)
        assert got["w1_diff"] < WEIGHT_ATOL, got["w1_diff"]
    resumed = run_on_ranks(_resume_single, world_size=1, timeout_s=600, root=root, ref=ref)[0]
    assert resumed["step"] == 2
    assert resumed["m2"]["loss"] == pytest.approx(ref["m2"]["loss"], rel=LOSS_RTOL, abs=1e-6)
    assert resumed["w2_diff"] < WEIGHT_ATOL, resumed["w2_diff"]
