"""The Megatron learner on a tiny Qwen3-MoE, fp32, gloo.

One single-process reference run, then one two-process run that walks through the layouts
TP=2+SP, PP=2, EP=2, CP=2 and DP=2 (re-initialising Megatron's parallel state between them) and
checks, per layout, against the reference: per-token log-probs, the GSPO loss, the grad norm and
every weight after one optimizer step; then it resumes from a full training checkpoint saved
under a *different* layout in the portable optimizer form (reference -> TP2 / EP2 / CP2, TP2 -> PP2)
or in the fast form under another data-parallel size (reference -> DP2; the fast form under
another TP is refused), and checks the next step's loss and the weights after it. A 4-process run does the same for CP=2 combined with
TP=2+SP, PP=2 and EP=2, and TP=2 x EP=2 resumes from the fast form converted by ``gspo-reshard
--portable-optimizer``. The reference also checks that dynamic micro-batching by tokens gives the
gradients of one large micro-batch, and the non-finite guard. The forward-only
``LogprobLearner`` gives the Learner's log-probs exactly at TP2 x EP2, and refuses to train.
What a micro-batch hands the loss (``PolicyLossInputs``, token lags included) is checked alone.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from gspo_megatron.config.schema import GSPOConfig, ModelConfig, ParallelConfig
from tests.multiproc import run_on_ranks

LAYOUTS = {"tp2_sp": dict(tp=2, sp=True), "pp2": dict(pp=2), "ep2": dict(ep=2),
           "cp2": dict(cp=2), "dp2": dict()}
# "ref" and the layouts resumed elsewhere save the portable optimizer form; "ref_fast" is the
# fast form (dp_reshardable), which loads under its own layout up to the data-parallel size:
# dp2 resumes it with DP 1 -> 2, tp2_sp is refused it; "ref_converted" is "ref_fast" rewritten
# in the portable form by gspo-reshard --portable-optimizer.
RESUME_FROM = {"tp2_sp": "ref", "pp2": "tp2_sp", "ep2": "ref", "cp2": "ref", "dp2": "ref_fast"}
# Context parallelism combined with the other layouts, on 4 processes (and TP2 x EP2).
CP_COMBOS = {"cp2_tp2_sp": dict(cp=2, tp=2, sp=True), "cp2_pp2": dict(cp=2, pp=2),
             "cp2_ep2": dict(cp=2, ep=2), "tp2_ep2_sp": dict(tp=2, ep=2, sp=True)}
CP_COMBOS_RESUME_FROM = {"cp2_tp2_sp": "ref", "cp2_pp2": "cp2_tp2_sp", "cp2_ep2": "ref",
                         "tp2_ep2_sp": "ref_converted"}
LP_ATOL, LOSS_RTOL, WEIGHT_ATOL = 2e-5, 1e-4, 2e-6
# Every layout, TP2 included: replicated experts reduce over the expert-DP group
# (model/provider.py: mark_expert_params), so their optimizer state is exact on every rank.
RESUMED_WEIGHTS_EXACT = set(LAYOUTS) | set(CP_COMBOS)


def tiny_cfg(**parallel) -> GSPOConfig:
    cfg = GSPOConfig()
    cfg.model = ModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64,
                            num_attention_heads=4, num_query_groups=2, head_dim=8, vocab_size=50,
                            make_vocab_size_divisible_by=8, max_position_embeddings=64,
                            num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                            transformer_impl="local", params_dtype="fp32")
    cfg.parallel = ParallelConfig(**parallel)
    cfg.optimizer.lr = 1e-3
    cfg.optimizer.adam_eps = 1e-6
    cfg.optimizer.warmup_steps = 1
    cfg.optimizer.max_consecutive_nonfinite = 2
    cfg.batch.max_tokens_per_micro_batch = 24
    cfg.rollout.temperature = 0.9
    cfg.algo.clip_eps_low, cfg.algo.clip_eps_high = 0.2, 0.27  # keep step 2 mostly unclipped
    return cfg


def make_batch(seed: int, old=None):
    from gspo_megatron.learner.batch import SequenceBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 12, 9, 15, 5, 11]
    tokens = [torch.randint(0, 50, (n,), generator=gen) for n in lengths]
    adv = [1.0, -1.0, 0.5, -0.5, 2.0, -1.0] if seed == 0 else [1.0, 0.5, 2.0, -0.5, 1.5, 0.25]
    batch = SequenceBatch(token_ids=tokens, prompt_lens=[3, 4, 3, 5, 2, 3], advantages=adv)
    if old is not None:  # pi_old slightly off the current policy: ratios != 1, some clipped
        batch.old_logprobs = [o + 2e-4 * torch.randn(o.shape, generator=gen) for o in old]
    return batch


def _params(learner):
    return [(n, p) for chunk in learner.model for n, p in chunk.module.named_parameters()]


def _max_weight_diff(learner, cfg, directory) -> float:
    """Largest |w - w_ref| over this rank's shards, w_ref loaded from ``directory``."""
    from gspo_megatron.learner.checkpointing import load_model_weights
    from gspo_megatron.model.provider import build_gpt_model

    vpp = cfg.parallel.vpp
    fresh = [build_gpt_model(cfg.model, cfg.parallel, vp_stage=i if vpp else None)
             for i in range(vpp or 1)]
    load_model_weights(fresh, directory)
    ref = dict(n_p for chunk in fresh for n_p in chunk.named_parameters())
    return max(float((p.detach() - ref[n].detach()).abs().max()) for n, p in _params(learner))


def _gspo():
    from gspo_megatron.algorithms.losses import get_policy_loss

    return get_policy_loss("gspo")


def nan_loss(inputs, algo):
    from gspo_megatron.algorithms.types import LossOutput

    return LossOutput(loss=inputs.logprobs.sum() * float("nan"))


def _reference(rank: int, root: str) -> dict:
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner, NonFiniteTrainingError

    cfg = tiny_cfg()
    learner = Learner(cfg, init_distributed(cfg.parallel, seed=3), total_steps=10)
    learner.save_weights(f"{root}/init")
    lp = learner.compute_logprobs(make_batch(0)).logprobs
    lp2 = learner.compute_logprobs(make_batch(1)).logprobs  # pi_old of step 2: the initial policy
    batch1, batch2 = make_batch(0, old=lp), make_batch(1, old=lp2)

    # Dynamic batching: several token-budget micro-batches == one large micro-batch.
    grads = {}
    for budget in (24, 1000):
        cfg.batch.max_tokens_per_micro_batch = budget
        learner.forward_backward(batch1, _gspo())
        grads[budget] = [p.main_grad.clone() for _, p in _params(learner)]
    cfg.batch.max_tokens_per_micro_batch = 24
    num_micro = len(learner.plan(batch1).micro_batches)
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(grads[24], grads[1000]))
    grad_scale = max(float(g.abs().max()) for g in grads[1000])

    m1 = learner.train_step(batch1, _gspo())
    learner.save_checkpoint(f"{root}/ref", extra={"cursor": 7}, form="portable")
    learner.save_checkpoint(f"{root}/ref_fast", extra={"cursor": 7})
    m2 = learner.train_step(batch2, _gspo())
    learner.save_weights(f"{root}/ref_step2")

    # Guard: NaN losses skip the update; the second in a row stops with a checkpoint.
    before = [p.detach().clone() for _, p in _params(learner)]
    cfg.checkpoint.dir = f"{root}/guard"
    skipped = learner.train_step(batch2, nan_loss)
    unchanged = all(torch.equal(a, p) for a, (_, p) in zip(before, _params(learner)))
    try:
        learner.train_step(batch2, nan_loss)
        stopped = ""
    except NonFiniteTrainingError as exc:
        stopped = str(exc)
    return {"lp": lp, "lp2": lp2, "m1": m1, "m2": m2, "num_micro": num_micro, "grad_diff": grad_diff,
            "grad_scale": grad_scale, "skipped": skipped, "unchanged": unchanged,
            "stopped": stopped, "guard_ckpt": os.path.isdir(f"{root}/guard/last_good")}


def _layouts(rank: int, root: str, ref: dict, layouts=None, resume_from=None) -> dict:
    from megatron.core import parallel_state

    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.checkpoint_files import CheckpointError
    from gspo_megatron.learner.learner import Learner

    layouts, resume_from = layouts or LAYOUTS, resume_from or RESUME_FROM
    saved_by = set(resume_from.values()) & set(layouts)  # layouts whose checkpoint is resumed
    out = {}
    for name, layout in layouts.items():
        cfg = tiny_cfg(**layout)
        learner = Learner(cfg, init_distributed(cfg.parallel, seed=3), total_steps=10)
        learner.load_weights(f"{root}/init")
        lp = learner.compute_logprobs(make_batch(0)).logprobs
        lp_diff = max(float((a - b).abs().max()) for a, b in zip(lp, ref["lp"]))
        m1 = learner.train_step(make_batch(0, old=ref["lp"]), _gspo())
        w1_diff = _max_weight_diff(learner, cfg, f"{root}/ref")
        if name in saved_by:
            learner.save_checkpoint(f"{root}/{name}", extra={"cursor": 7}, form="portable")
        refused = ""
        if name == "tp2_sp":  # the fast form of another layout: refused, naming the way out
            try:
                learner.load_checkpoint(f"{root}/ref_fast")
            except CheckpointError as exc:
                refused = str(exc)
        extra = learner.load_checkpoint(f"{root}/{resume_from[name]}")
        w_load_diff = _max_weight_diff(learner, cfg, f"{root}/ref")
        m2 = learner.train_step(make_batch(1, old=ref["lp2"]), _gspo())
        w2_diff = _max_weight_diff(learner, cfg, f"{root}/ref_step2")
        out[name] = {"lp_diff": lp_diff, "m1": m1, "w1_diff": w1_diff, "m2": m2,
                     "w2_diff": w2_diff, "w_load_diff": w_load_diff, "extra": extra,
                     "step": learner.step, "refused": refused}
        del learner
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("learner"))
    return root, run_on_ranks(_reference, world_size=1, timeout_s=600, root=root)[0]


@pytest.mark.slow
def test_dynamic_batching_matches_one_large_micro_batch(reference):
    _, ref = reference
    assert ref["num_micro"] >= 3
    assert ref["grad_scale"] > 1e-3
    assert ref["grad_diff"] < 1e-6 * max(1.0, ref["grad_scale"]), ref["grad_diff"]


@pytest.mark.slow
def test_nonfinite_loss_skips_then_stops_with_checkpoint(reference):
    _, ref = reference
    assert ref["skipped"]["skipped"] == 1.0 and ref["skipped"]["num_nonfinite_skipped"] == 1.0
    assert ref["unchanged"], "a skipped step must not change the weights"
    assert "2 consecutive steps" in ref["stopped"] and "last_good" in ref["stopped"]
    assert ref["guard_ckpt"]


@pytest.mark.slow
def test_parallel_layouts_match_single_process(reference):
    root, ref = reference
    results = run_on_ranks(_layouts, world_size=2, timeout_s=900, root=root, ref=ref)
    assert sorted(name for r in results for name in r) == sorted(list(LAYOUTS) * 2)
    assert [got["refused"] != "" for r in results for name, got in r.items() if name == "tp2_sp"] \
        == [True, True]
    _check_against_reference(results, ref)


def _make_portable(rank: int, root: str) -> dict:
    """gspo-reshard --portable-optimizer on a copy of the fast-form ``ref_fast`` (its layout:
    one process), with the run's config written as the trainer writes it."""
    import json
    import shutil

    from gspo_megatron.cli.reshard import main
    from gspo_megatron.config.load import save_config
    from omegaconf import OmegaConf

    shutil.copytree(f"{root}/ref_fast", f"{root}/ref_converted")
    config = save_config(OmegaConf.structured(tiny_cfg()), f"{root}/config.yaml")
    code = main(["--portable-optimizer", "--ckpt", f"{root}/ref_converted", "--config", str(config)])
    meta = json.loads(open(f"{root}/ref_converted/gspo_meta.json").read())
    return {"code": code, "form": meta["optimizer_form"], "step": meta["step"]}


@pytest.mark.slow
def test_context_parallel_with_tp_pp_ep_matches_single_process(reference):
    root, ref = reference
    converted = run_on_ranks(_make_portable, world_size=1, timeout_s=300, root=root)[0]
    assert converted == {"code": 0, "form": "portable", "step": 1}
    results = run_on_ranks(_layouts, world_size=4, timeout_s=900, root=root, ref=ref,
                           layouts=CP_COMBOS, resume_from=CP_COMBOS_RESUME_FROM)
    assert sorted(name for r in results for name in r) == sorted(list(CP_COMBOS) * 4)
    _check_against_reference(results, ref)


def _check_against_reference(results: list, ref: dict) -> None:
    refusals = [got["refused"] for r in results for name, got in r.items() if name == "tp2_sp"]
    for refused in refusals:
        assert "ref_fast: its optimizer state is in the fast form" in refused, refused
        assert "parallel.tp=1 -> 2" in refused and "--portable-optimizer" in refused, refused
    assert math.isfinite(ref["m1"]["loss"]) and ref["m1"]["loss"] != 0.0
    assert ref["m1"]["ratio_max"] != 1.0
    assert abs(ref["m1"]["loss"]) > 0.1 and abs(ref["m2"]["loss"]) > 0.1
    summary = {name: {k: got[k] for k in ("lp_diff", "w1_diff", "w_load_diff", "w2_diff")}
               for rank_result in results for name, got in rank_result.items()}
    for rank_result in results:
        for name, got in rank_result.items():
            where = f"layout {name}"
            assert got["lp_diff"] < LP_ATOL, (where, got["lp_diff"])
            for step in ("m1", "m2"):
                assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=LOSS_RTOL,
                                                          abs=1e-6), where
                assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"],
                                                               rel=LOSS_RTOL), where
            assert got["w1_diff"] < WEIGHT_ATOL, (where, got["w1_diff"])
            assert got["w_load_diff"] < WEIGHT_ATOL, (where, summary)
            if name in RESUMED_WEIGHTS_EXACT:
                assert got["w2_diff"] < WEIGHT_ATOL, (where, summary)
            assert got["extra"] == {"cursor": 7} and got["step"] == 2, where


# ---- the forward-only learner -------------------------------------------------------------

def _learner_and_logprob_learner(rank: int):
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner, LogprobLearner

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
    results = run_on_ranks(_learner_and_logprob_learner, world_size=2, timeout_s=300)
    for gaps, lengths in results:
        assert lengths == [len(t) - p for t, p in zip(make_batch(0).token_ids,
                                                      make_batch(0).prompt_lens)]
        assert max(gaps) == 0.0, gaps


def test_policy_inputs_carry_the_per_token_fields_token_lags_included():
    """What the learner hands the loss for one micro-batch: each extra of the batch under its
    PolicyLossInputs name, the lags as int64, and the loss reports the clip fraction by lag."""
    from types import SimpleNamespace

    from gspo_megatron.algorithms.losses import get_policy_loss
    from gspo_megatron.algorithms.metrics import metrics_to_floats
    from gspo_megatron.config.schema import AlgorithmConfig, TISConfig
    from gspo_megatron.learner.batch import SequenceBatch, plan_step
    from gspo_megatron.learner.learner import Learner

    batch = SequenceBatch(token_ids=[[1, 2, 3, 4], [5, 6, 7]], prompt_lens=[1, 2],
                          advantages=[1.0, -1.0],
                          old_logprobs=[torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-4.0])],
                          rollout_logprobs=[torch.tensor([-1.5, -2.0, -3.0]), torch.tensor([-4.0])],
                          token_lags=[[2, 1, 0], [0]])
    plan = plan_step(batch, 0, 1, max_tokens=16)
    (mb,) = plan.micro_batches
    lp = mb.extras["old_logprobs"].clone().requires_grad_()
    inputs = Learner._policy_inputs(SimpleNamespace(cp_group=None), mb, plan, lp, None)
    assert inputs.token_lag.dtype == torch.int64
    assert torch.equal(inputs.token_lag, mb.extras["token_lags"])
    assert torch.equal(inputs.rollout_logprobs, mb.extras["rollout_logprobs"])
    assert sorted(inputs.token_lag.tolist()) == [0, 0, 1, 2]
    off = AlgorithmConfig(tis=TISConfig(mode="off"))
    metrics = metrics_to_floats(get_policy_loss("gspo")(inputs, off).metrics)
    assert metrics["clip_frac_token_lag2"] == 0.0 and "clip_frac_token_lag3" not in metrics
