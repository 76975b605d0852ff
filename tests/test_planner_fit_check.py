"""The fit check entry points run after loading a config (gspo-train, the launch plan): a layout predicted not to fit the declared GPUs is refused
with the biggest terms and a suggestion that itself loads and fits; the explicit override and
an undeclared GPU memory skip it; a rollout server whose KV cache holds no sequence is refused."""

from __future__ import annotations

import pytest

from gspo_megatron.config import ConfigError, load_config
from gspo_megatron.planner.fit_check import load_fitting_config
from tests.test_config import REPO

CONFIG = REPO / "configs" / "qwen3_30b_a3b_gspo.yaml"
# The production layout before the planner: selective recompute, fp32 Adam state.
OLD = ["model.recompute=selective", "optimizer.precision_aware=false",
       "optimizer.moments_dtype=fp32"]


def test_production_configs_fit():
    for name in ("qwen3_30b_a3b_gspo.yaml", "qwen3_30b_a3b_grpo.yaml", "qwen3_235b_a22b_gspo.yaml"):
        cfg = load_fitting_config(REPO / "configs" / name)
        assert cfg.plan.gpu_memory_gb is not None, name


def test_layout_that_does_not_fit_is_refused_with_terms_and_a_suggestion():
    with pytest.raises(ConfigError) as info:
        load_fitting_config(CONFIG, OLD)
    msg = str(info.value)
    assert "learner: predicted peak" in msg and "plan.gpu_memory_gb=80" in msg
    assert "activations (selective recompute" in msg and "optimizer state" in msg
    assert "plan.check_fit=false" in msg
    suggestion = msg.split("the planner suggests: ")[1].splitlines()[0].split()
    # The suggestion is a set of overrides that loads, validates and fits.
    cfg = load_fitting_config(CONFIG, OLD + suggestion)
    assert cfg.parallel.world_size == 16  # same learner GPUs


def test_explicit_override_and_undeclared_memory_skip_the_check():
    load_fitting_config(CONFIG, OLD + ["plan.check_fit=false"])
    load_fitting_config(CONFIG, OLD + ["plan.gpu_memory_gb=null"])
    load_config(CONFIG, OLD)  # plain loading validates but does not plan


def test_bigger_gpus_fit_the_old_layout():
    load_fitting_config(CONFIG, OLD + ["plan.gpu_memory_gb=141"])


def test_rollout_server_without_room_for_a_sequence_is_refused():
    # 61 GB of bf16 weights on one GPU, half of 76 GB for weights + KV cache.
    with pytest.raises(ConfigError, match=r"rollout.sglang.tp: 61.1 GB of weights per GPU at "
                                          r"tp=1 .* not one sequence of 9216 tokens"):
        load_fitting_config(CONFIG, ["rollout.sglang.tp=1", "rollout.sglang.mem_fraction_static=0.5"])


def test_colocated_generation_phase_names_the_largest_mem_fraction_that_fits():
    """Colocated, the learner's resident state stays on the GPU while the servers' static pool
    comes back for generation (planner/colocated.py): at the config's 0.8 it does not fit; the
    message names the largest mem_fraction_static that does, and that value loads."""
    with pytest.raises(ConfigError) as info:
        load_fitting_config(CONFIG, ["rollout.mode=colocated"])
    msg = str(info.value)
    assert ("rollout.mode=colocated, phase 'generation (KV cache resumed)': learner resident "
            "(weights, grads, optimizer) 45.7 GB + SGLang static pool 60.8 GB = 106.5 GB exceeds "
            "76.0 GB; lower rollout.sglang.mem_fraction_static to at most 0.39") in msg
    cfg = load_fitting_config(CONFIG, ["rollout.mode=colocated", "rollout.sglang.mem_fraction_static=0.39"])
    assert cfg.rollout.mode == "colocated"
    suggestion = msg.split("the planner suggests: ")[1].splitlines()[0].split()
    load_fitting_config(CONFIG, ["rollout.mode=colocated"] + suggestion)  # the suggestion fits
