"""``optimizer.freeze``: the config rules (``config/freeze.py``) and the learner that applies them
(``learner/freeze.py``) on the tiny Qwen3-MoE, fp32, one gloo process.

A learner with the embedding and output layer frozen must: give them no slot in DDP's gradient
buffers and no distributed-optimizer state (the buffers shrink by exactly their size), keep them
bit for bit through updates that change every other parameter, still write them into its
checkpoints and stream them in its weight sync, and refuse to resume a checkpoint made with
other frozen groups.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.config.errors import ConfigError
from gspo_megatron.config.freeze import FREEZE_GROUPS, freeze_problems, parameter_group
from gspo_megatron.config.schema import ModelConfig
from tests.multiproc import run_on_ranks
from tests.test_learner_learner import make_batch, tiny_cfg

MOE = ModelConfig(arch="qwen3_moe", num_layers=2, num_experts=4)
DENSE = ModelConfig(arch="qwen3", num_layers=2, num_experts=0)


@pytest.mark.parametrize("freeze, stages, model, expected", [
    (["embeding"], [2], MOE, "unknown group(s) 'embeding'"),
    (["norms", "norms"], [2], MOE, "'norms' named more than once"),
    (["router"], [2], DENSE, "model.arch=qwen3 has no router parameters"),
    (["mlp"], [2], MOE, "model.arch=qwen3_moe has no mlp parameters"),
    (["embedding"], [2], ModelConfig(tie_word_embeddings=True), "freeze both 'embedding' and "
                                                                "'output_layer', or neither"),
    (["embedding", "output_layer", "attention", "norms", "router", "experts"], [2], MOE,
     "freezes every parameter of the model"),
    (["attention", "norms", "router", "experts", "output_layer"], [1, 1], MOE,
     "freezes every parameter of pipeline stage 1"),
])
def test_refusals_name_the_key_and_the_reason(freeze, stages, model, expected):
    problems = freeze_problems(model, freeze, stages)
    assert problems and all(p.startswith("optimizer.freeze: ") for p in problems)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("freeze, stages, model", [
    ([], [2], MOE),
    (["embedding", "output_layer"], [2], MOE),
    (["embedding", "output_layer"], [2], ModelConfig(tie_word_embeddings=True)),
    (["attention", "norms", "router", "experts"], [1, 1], MOE),  # stage 0 keeps its embedding
    (["embedding", "output_layer", "attention", "norms"], [2], DENSE),  # the MLPs train
])
def test_accepted_freezes(freeze, stages, model):
    assert freeze_problems(model, freeze, stages) == []


def test_config_loading_refuses_a_bad_freeze_with_the_key():
    from gspo_megatron.config import load_config

    with pytest.raises(ConfigError, match=r"optimizer\.freeze: unknown group\(s\) 'lm_head'"):
        load_config("configs/tiny_cpu.yaml", ["optimizer.freeze=[lm_head]"])
    cfg = load_config("configs/tiny_cpu.yaml", ["optimizer.freeze=[embedding,output_layer]"])
    assert list(cfg.optimizer.freeze) == ["embedding", "output_layer"]


def test_parameter_group_of_each_kind_and_an_unknown_name():
    assert parameter_group("module.embedding.word_embeddings.weight") == "embedding"
    assert parameter_group("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == "norms"
    assert parameter_group("decoder.layers.0.self_attention.q_layernorm.weight") == "norms"
    assert parameter_group("decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight") == "experts"
    assert parameter_group("decoder.layers.0.mlp.linear_fc1.weight") == "mlp"
    with pytest.raises(ValueError, match="belongs to no optimizer.freeze group"):
        parameter_group("decoder.layers.0.mlp.shared_experts.gate_weight")


def _grad_buffer_numel(learner) -> int:
    return sum(b.grad_data.numel() for chunk in learner.model
               for b in [*chunk.buffers, *chunk.expert_parallel_buffers])


def _optimizer_params(learner) -> set:
    sub = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    return {id(p) for opt in sub for p in opt.model_param_gbuf_map}


def _run(rank: int, root: str) -> dict:
    from gspo_megatron.algorithms.losses import get_policy_loss
    from gspo_megatron.checkpoint.gather import iter_hf_buckets
    from gspo_megatron.checkpoint.learner_hf import unwrapped_chunks
    from gspo_megatron.distributed.runtime import init_distributed
    from gspo_megatron.learner.learner import Learner

    cfg = tiny_cfg()
    runtime = init_distributed(cfg.parallel, seed=3)
    full = Learner(cfg, runtime, total_steps=10)
    full_buffer = _grad_buffer_numel(full)
    full.save_weights(f"{root}/init")
    cfg.optimizer.freeze = ["embedding", "output_layer"]
    learner = Learner(cfg, runtime, total_steps=10)
    learner.load_weights(f"{root}/init")
    named = [(n, p) for chunk in unwrapped_chunks(learner) for n, p in chunk.named_parameters()]
    frozen = {n for n, p in named if parameter_group(n) in ("embedding", "output_layer")}
    before = {n: p.detach().clone() for n, p in named}
    lp = learner.compute_logprobs(make_batch(0)).logprobs
    for seed in (0, 1):
        learner.train_step(make_batch(seed, old=lp), get_policy_loss("gspo"))
    learner.save_checkpoint(f"{root}/frozen")
    synced = {name for bucket in iter_hf_buckets(unwrapped_chunks(learner), learner.model_cfg)
              for name, _ in bucket}
    reload = Learner(tiny_cfg(), runtime, total_steps=10)  # nothing frozen
    reload.load_weights(f"{root}/frozen")
    reloaded = dict(n_p for chunk in unwrapped_chunks(reload) for n_p in chunk.named_parameters())
    try:
        reload.load_checkpoint(f"{root}/frozen")
        resume_error = ""
    except ConfigError as exc:
        resume_error = str(exc)
    in_optimizer = _optimizer_params(learner)
    return {
        "frozen": sorted(frozen), "numel": {n: p.numel() for n, p in named},
        "full_buffer": full_buffer, "frozen_buffer": _grad_buffer_numel(learner),
        "frozen_requires_grad": [p.requires_grad for n, p in named if n in frozen],
        "frozen_in_optimizer": [id(p) in in_optimizer for n, p in named if n in frozen],
        "trainable_in_optimizer": all(id(p) in in_optimizer for n, p in named if n not in frozen),
        "frozen_has_main_grad": [hasattr(p, "main_grad") for n, p in named if n in frozen],
        "unchanged": sorted(n for n, p in named if torch.equal(p.detach(), before[n])),
        "reloaded_equal": all(torch.equal(reloaded[n], p.detach()) for n, p in named),
        "synced": synced, "resume_error": resume_error,
        "logged_frozen": learner.frozen.numel_by_group,
    }


def test_frozen_groups_get_no_training_state_keep_their_values_and_still_travel(tmp_path):
    r = run_on_ranks(_run, world_size=1, root=str(tmp_path))[0]
    assert r["frozen"] == ["embedding.word_embeddings.weight", "output_layer.weight"]
    frozen_numel = sum(r["numel"][n] for n in r["frozen"])
    assert r["logged_frozen"] == {"embedding": r["numel"][r["frozen"][0]],
                                  "output_layer": r["numel"][r["frozen"][1]]}
    # no grad-buffer slot: the buffers shrink by exactly the frozen parameters (Megatron's
    # padding of the expert parameters' slots is the same with or without the freeze)
    total = sum(r["numel"].values())
    assert r["full_buffer"] - r["frozen_buffer"] == frozen_numel
    assert r["frozen_buffer"] - (total - frozen_numel) == r["full_buffer"] - total < 1024
    assert r["frozen_requires_grad"] == [False, False]
    assert r["frozen_has_main_grad"] == [False, False]
    assert r["frozen_in_optimizer"] == [False, False] and r["trainable_in_optimizer"]
    # two updates changed every trainable parameter and no frozen one
    assert r["unchanged"] == r["frozen"]
    # checkpoints and the weight sync carry the frozen tensors
    assert r["reloaded_equal"]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= r["synced"]
    assert "optimizer.freeze: is [] but" in r["resume_error"]
    assert "trained with ['embedding', 'output_layer']" in r["resume_error"]


def test_every_group_is_documented_in_the_schema():
    import inspect

    from gspo_megatron.config import schema

    source = inspect.getsource(schema.OptimizerConfig)
    for group in FREEZE_GROUPS:
        assert f"``{group}``" in source, group
