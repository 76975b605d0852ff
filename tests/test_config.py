"""Configuration: composition through `defaults`, dot-list overrides, and every validation error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gspo_megatron.config import ConfigError, load_config, save_config

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_compose_in_order_then_file_then_overrides(tmp_path):
    write(tmp_path, "a.yaml", "algo: {clip_eps_low: 0.1, clip_eps_high: 0.2}\ntrainer: {num_steps: 3}\n")
    write(tmp_path, "b.yaml", "defaults: [a.yaml]\nalgo: {clip_eps_high: 0.3}\n")
    top = write(tmp_path, "top.yaml", "defaults: [b.yaml]\ntrainer: {num_steps: 5}\n")
    cfg = load_config(top, ["algo.clip_eps_high=5e-4", "parallel.tp=1"])
    assert cfg.algo.clip_eps_low == 0.1          # from a.yaml
    assert cfg.algo.clip_eps_high == 5e-4        # b.yaml overrode a.yaml, the override won
    assert cfg.trainer.num_steps == 5            # the file beats its defaults
    assert cfg.rollout.n_samples_per_prompt == 8  # schema default untouched


def test_unknown_key_in_file_names_file_and_key(tmp_path):
    bad = write(tmp_path, "bad.yaml", "algo:\n  clip_eps_hihg: 0.3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown key 'algo\.clip_eps_hihg'"):
        load_config(bad)


def test_unknown_key_in_override_names_the_override():
    with pytest.raises(ConfigError, match=r"override 'parallel\.tpp=2': unknown key 'parallel\.tpp'"):
        load_config(None, ["parallel.tpp=2"])


def test_chat_template_kwargs_take_any_key_and_stay_typed_elsewhere(tmp_path):
    top = write(tmp_path, "top.yaml", "data: {chat_template_kwargs: {enable_thinking: false}}\n")
    assert dict(load_config(top).data.chat_template_kwargs) == {"enable_thinking": False}
    cfg = load_config(None, ["data.chat_template_kwargs.reasoning_effort=low"])
    assert dict(cfg.data.chat_template_kwargs) == {"reasoning_effort": "low"}
    with pytest.raises(ConfigError, match="unknown key 'data.chat_template_kwarg'"):
        load_config(None, ["data.chat_template_kwarg.x=1"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"bad value for 'parallel\.tp'"):
        load_config(None, ["parallel.tp=four"])


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["parallel.tp"])


def test_missing_file_and_cycle_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    write(tmp_path, "x.yaml", "defaults: [y.yaml]\n")
    y = write(tmp_path, "y.yaml", "defaults: [x.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(y)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=3"], "world size 8 is not divisible by tp\\*pp\\*cp"),
    (["parallel.ep=3", "model.num_experts=8"], "ep=3 must divide model.num_experts=8"),
    (["parallel.tp=2"], "MoE with tp=2 requires sequence parallelism"),
    (["parallel.sp=true"], "sequence parallelism needs parallel.tp > 1"),
    (["parallel.pp=4", "model.num_layers=6"], "parallel.pp: pp=4 does not divide num_layers=6"),
    (["parallel.tp=2", "parallel.sp=true", "model.num_query_groups=1", "model.num_attention_heads=4"],
     "tp=2 must divide model.num_query_groups=1"),
    (["batch.max_tokens_per_micro_batch=100", "data.max_prompt_tokens=90"],
     "cannot hold one sequence of up to"),
    (["batch.num_mini_batches=3"], "3 must divide the rollout batch"),
    (["algo.loss=ppo"], "algo.loss: 'ppo' is not one of gspo, gspo_token, grpo"),
    (["algo.clip_eps_low=1.5"], "algo.clip_eps_low: 1.5 must be in"),
    (["model.arch=qwen3", "parallel.ep=2"], "needs num_experts = 0"),
    (["parallel.vpp=2"], "virtual pipeline stages need parallel.pp > 1"),
    (["model.fp8.enabled=true", "model.transformer_impl=local"], "FP8 needs"),
    (["rollout.temperature=0"], "rollout.temperature: must be > 0"),
    (["parallel.cp=2", "data.max_prompt_tokens=513", "batch.max_tokens_per_micro_batch=578"],
     "577 tokens, padded to a multiple of 4 for tp=1 sp=False cp=2 fp8=off \\(580 tokens"),
    (["parallel.cp=3"], "world size 8 is not divisible by tp\\*pp\\*cp = 1\\*1\\*3"),
    (["model.fp8.enabled=true", "model.fp8.recipe=delayed"], "'delayed' recipe cannot keep"),
    (["rollout.weight_sync.transport=nccl"], "'nccl' needs server engines"),
    (["rollout.weight_sync.transport=disk"], "transport=disk needs a shared directory"),
    (["rollout.overlap_one_step=true", "rollout.engine=sglang", "rollout.mode=colocated"],
     "cannot generate while it trains"),
    (["rollout.overlap_one_step=true", "rollout.weight_sync.transport=disk",
      "rollout.weight_sync.disk_dir=/tmp/x"], "through shared memory"),
    (["rollout.embedded_num_threads=0"], "rollout.embedded_num_threads: must be >= 1"),
    (["rollout.overlap_thread_split=half"],
     "rollout.overlap_thread_split: 'half' must be 'auto', 'share' or 'full'"),
    (["rollout.overlap_probe_steps=-1"], "rollout.overlap_probe_steps: must be >= 0"),
    (["optimizer.lr=1e-5", "optimizer.min_lr=1e-4"], "optimizer.min_lr: 0.0001 must be <="),
    (["rollout.overlap_one_step=true", "algo.routing_replay=learner", "model.num_experts=4"],
     "rollout.overlap_one_step > 0 the learner would record its routing"),
    (["algo.routing_replay=sometimes"], "'sometimes' is not one of off, learner, rollout"),
    (["rollout.embedded_dtype=fp16"], "rollout.embedded_dtype: 'fp16' is not one of fp32, bf16"),
    (["algo.routing_replay=rollout", "model.arch=qwen3", "model.num_experts=0"],
     "routing replay needs an MoE model"),
    (["rollout.engine=sglang", "rollout.mode=disaggregated", "rollout.sglang.dp=2"],
     "asserts dp_size == 1"),
    (["parallel.world_size=8", "parallel.tp=2", "parallel.sp=true", "batch.num_prompts_per_step=1",
      "rollout.n_samples_per_prompt=4", "batch.num_mini_batches=4"],
     "cannot feed 4 data-parallel ranks"),
    (["algo.tis.mode=truncate", "algo.old_logprob_source=rollout"], "every r would be 1"),
    (["algo.tis.mode=mask", "algo.old_logprob_source=learner", "algo.tis.cap=1.0"],
     "algo.tis.cap: 1.0 must be > 1 with algo.tis.mode=mask"),
    (["algo.tis.mode=truncate", "algo.old_logprob_source=learner", "algo.tis.cap=0.9"],
     "algo.tis.cap: 0.9 must be >= 1"),
    (["algo.tis.mode=clip"], "algo.tis.mode: 'clip' is not one of auto, off, truncate, mask"),
    (["algo.tis.level=prefix"], "algo.tis.level: 'prefix' is not one of auto, token, sequence"),
    (["algo.routing_replay=true", "algo.old_logprob_source=rollout"],
     "recorded by the learner's old-log-prob pass"),
    (["algo.routing_replay=true", "model.arch=qwen3", "model.num_experts=0"],
     "routing replay needs an MoE model"),
    (["algo.routing_replay=true", "model.recompute=full", "parallel.pp=2"],
     "needs parallel.pp=1"),
    (["algo.diagnostics.length_bucket_edges=[64,16]"], "must be increasing integers"),
    (["algo.diagnostics.log_ratio_bin_edges=[0.1,0.0]"], "must be increasing"),
    (["algo.diagnostics.expert_volatility_num_seqs=-1"], "must be >= 0"),
    (["rollout.max_staleness=-1"], "rollout.max_staleness: -1 must be >= 0"),
    (["rollout.async_groups_in_flight=-2"], "rollout.async_groups_in_flight: -2 must be >= 0"),
    (["rollout.overlap_one_step=true", "rollout.max_staleness=3"],
     "rollout.overlap_one_step: is the old name of rollout.max_staleness=1"),
    (["rollout.max_staleness=2"], "rollout.max_staleness: 2 needs servers that pause"),
    (["rollout.max_staleness=2", "rollout.engine=sglang"],
     "rollout.max_staleness: colocated SGLang servers share"),
    (["rollout.max_staleness=2", "rollout.engine=sglang", "rollout.mode=disaggregated",
      "algo.old_logprob_source=rollout"], "algo.old_logprob_source: 'rollout' under"),
    (["rollout.max_staleness=2", "rollout.engine=reference", "rollout.mode=disaggregated",
      "algo.routing_replay=learner"], "algo.routing_replay: with rollout.max_staleness > 0"),
    (["rollout.max_staleness=2", "rollout.engine=reference", "rollout.mode=disaggregated",
      "rollout.stop=[END]"], "rollout.stop: \\['END'\\]: stop strings cannot carry over"),
    (["rollout.max_staleness=1", "algo.routing_replay=learner"],
     "algo.routing_replay: with rollout.max_staleness > 0"),
])
def test_inconsistent_layouts_and_settings_are_refused(overrides, message):
    base = ["model.num_experts=4", "parallel.world_size=8"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, base + overrides)


@pytest.mark.parametrize("override, message", [
    ("trainer.num_steps=-1", "trainer.num_steps: -1 must be >= 0"),
    ("trainer.num_sft_steps=-5", "trainer.num_sft_steps: -5 must be >= 0"),
    ("checkpoint.save_every_steps=-2", "checkpoint.save_every_steps: -2 must be >= 0"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last: 0 must be >= 1"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens: 0 must be >= 1"),
    ("reward.timeout_s=0", "reward.timeout_s: 0.0 must be > 0.0"),
    ("optimizer.adam_beta2=1.0", "optimizer.adam_beta2: 1.0 must be < 1"),
    ("optimizer.min_lr=1.0", "optimizer.min_lr: 1.0 must be <= optimizer.lr"),
    ("data.max_bad_row_fraction=2", "data.max_bad_row_fraction: 2.0 must be <= 1"),
    ("plan.mfu=0", "plan.mfu: 0.0 must be in (0, 1]"),
    ("plan.mean_response_frac=1.5", "plan.mean_response_frac: 1.5 must be in (0, 1]"),
    ("plan.mean_response_frac=0", "plan.mean_response_frac: 0.0 must be in (0, 1]"),
    ("plan.truncated_frac=-0.1", "plan.truncated_frac: -0.1 must be in [0, plan.mean_"),
    ("plan.truncated_frac=0.6", "plan.truncated_frac: 0.6 must be in [0, "
                                "plan.mean_response_frac=0.5]"),
])
def test_counts_and_rates_outside_their_meaning_are_refused(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["model.num_experts=4", override])


def test_routing_replay_modes_and_the_booleans_of_older_configs():
    """R3 takes pi_old from either source and survives the overlap (its routing travels with the
    samples); ``true`` / ``false`` written before R3 still mean R2 / off."""
    from gspo_megatron.config.schema import routing_replay_mode

    for overrides in (["algo.routing_replay=rollout", "algo.old_logprob_source=rollout"],
                      ["algo.routing_replay=rollout", "rollout.overlap_one_step=true"]):
        assert routing_replay_mode(load_config(REPO / "configs" / "tiny_cpu.yaml", overrides).algo) == "rollout"
    assert routing_replay_mode(load_config(REPO / "configs" / "tiny_cpu.yaml", ["algo.routing_replay=true", "algo.old_logprob_source=learner"]).algo) == "learner"
    assert routing_replay_mode(load_config(REPO / "configs" / "tiny_cpu.yaml", ["algo.routing_replay=false"]).algo) == "off"
    assert routing_replay_mode(load_config(REPO / "configs" / "tiny_cpu.yaml").algo) == "off"


def test_max_staleness_and_its_old_name():
    """``overlap_one_step: true`` reads as ``max_staleness: 1``; k >= 2 runs on servers."""
    from gspo_megatron.config.schema import rollout_staleness

    tiny = REPO / "configs" / "tiny_cpu.yaml"
    assert rollout_staleness(load_config(tiny).rollout) == 0
    assert rollout_staleness(load_config(tiny, ["rollout.overlap_one_step=true"]).rollout) == 1
    assert rollout_staleness(load_config(tiny, ["rollout.max_staleness=1"]).rollout) == 1
    both = ["rollout.overlap_one_step=true", "rollout.max_staleness=1"]
    assert rollout_staleness(load_config(tiny, both).rollout) == 1
    k4 = ["rollout.max_staleness=4", "rollout.engine=reference", "rollout.mode=disaggregated",
          "algo.old_logprob_source=learner"]
    assert rollout_staleness(load_config(tiny, k4).rollout) == 4


def test_the_importance_correction_defaults_to_what_the_run_needs():
    """Issue 51: ``algo.tis`` left at ``auto`` is the sequence-level behaviour weight under
    ``rollout.max_staleness >= 2`` (token level for grpo) and off otherwise; the loaded config
    (and so the saved ``config.yaml``) names what runs. ``off`` by name is the ablation."""
    tiny = REPO / "configs" / "tiny_cpu.yaml"
    k2 = ["rollout.max_staleness=2", "rollout.engine=reference", "rollout.mode=disaggregated",
          "algo.old_logprob_source=learner"]

    def tis(*overrides):
        t = load_config(tiny, list(overrides)).algo.tis
        return t.mode, t.level

    assert tis() == ("off", "sequence")
    assert tis("rollout.overlap_one_step=true", "algo.old_logprob_source=learner") == (
        "off", "sequence")
    assert tis(*k2) == ("truncate", "sequence")
    assert tis(*k2, "algo.loss=gspo_token") == ("truncate", "sequence")
    assert tis(*k2, "algo.loss=grpo") == ("truncate", "token")
    assert tis(*k2, "algo.tis.mode=off") == ("off", "sequence")
    assert tis(*k2, "algo.tis.mode=mask", "algo.tis.level=token") == ("mask", "token")
    assert tis("algo.tis.mode=mask", "algo.old_logprob_source=learner") == ("mask", "sequence")
    # k >= 2 with the engine's log-probs as pi_old: refused for that reason alone (auto is off)
    with pytest.raises(ConfigError) as refused:
        load_config(tiny, [*k2, "algo.old_logprob_source=rollout"])
    assert "algo.old_logprob_source: 'rollout' under" in str(refused.value)
    assert "algo.tis.mode:" not in str(refused.value)


def test_context_parallel_layouts_are_accepted():
    base = ["model.num_experts=4", "parallel.world_size=8"]
    cfg = load_config(None, base + ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"])
    assert cfg.parallel.cp == 2
    load_config(None, base + ["parallel.cp=2", "data.max_prompt_tokens=513",
                              "batch.max_tokens_per_micro_batch=580"])


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algo.kl_coef=-1", "rollout.top_p=2", "model.num_experts=4",
                           "rollout.embedded_max_batch_size=0"])
    assert "algo.kl_coef" in str(err.value) and "rollout.top_p" in str(err.value)
    assert "rollout.embedded_max_batch_size: must be >= 1" in str(err.value)


def test_launched_world_size_must_match_config():
    with pytest.raises(ConfigError, match="config says 8 but 4 processes"):
        load_config(None, ["model.num_experts=4", "parallel.world_size=8"], world_size=4)


def test_every_shipped_config_validates():
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert len(files) >= 4
    for path in files:
        load_config(path)


def test_production_config_matches_the_model_card_and_paper():
    cfg = load_config(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml")
    m = cfg.model
    assert (m.num_layers, m.num_experts, m.moe_router_topk, m.hidden_size, m.moe_ffn_hidden_size,
            m.num_attention_heads, m.num_query_groups, m.head_dim, m.vocab_size) == \
        (48, 128, 8, 2048, 768, 32, 4, 128, 151936)
    assert m.qk_layernorm and m.rope_theta == 1e6 and m.fp8.enabled
    assert (cfg.algo.loss, cfg.algo.clip_eps_low, cfg.algo.clip_eps_high) == ("gspo", 3e-4, 4e-4)
    assert cfg.batch.num_mini_batches == 4
    grpo = load_config(REPO / "configs" / "qwen3_30b_a3b_grpo.yaml")
    assert (grpo.algo.loss, grpo.algo.clip_eps_low, grpo.algo.clip_eps_high) == ("grpo", 0.2, 0.27)
    assert grpo.model == cfg.model and grpo.parallel == cfg.parallel  # only the objective differs


def test_longtail_config_fits_the_repeat_task_it_runs():
    from gspo_megatron.tiny_task.repeat_task import RepeatProblem, RepeatTaskConfig

    cfg, task = load_config(REPO / "configs" / "tiny_longtail.yaml"), RepeatTaskConfig()
    tiny = load_config(REPO / "configs" / "tiny_cpu.yaml")
    assert cfg.model == OmegaConf.merge(tiny.model, {"hf_path": cfg.model.hf_path})  # same model
    assert cfg.reward.name == "tiny_repeat"
    # the longest answer and its eos fit, so a response cut at max_new_tokens is wrong
    assert cfg.rollout.max_new_tokens == task.max_count + 1
    assert cfg.data.max_prompt_tokens >= len(RepeatProblem(9, task.max_count).prompt)
    # batches read in file order are whole stratified blocks
    assert cfg.data.shuffle is False
    assert cfg.batch.num_prompts_per_step % task.block_size == 0
    assert cfg.trainer.sft_batch_size % task.block_size == 0


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", ["trainer.num_steps=7"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    again = load_config(path)
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)


def test_sglangs_cpu_engine_is_disaggregated_only_and_dtypes_are_sglangs():
    """rollout.sglang.device=cpu: /release_memory_occupation synchronises CUDA and kills the
    real CPU server, so colocated mode is refused by its key; --dtype takes SGLang's choices."""
    base = ["rollout.engine=sglang", "rollout.sglang.device=cpu"]
    with pytest.raises(ConfigError, match=r"rollout\.mode.*colocated mode is a GPU feature"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", [*base, "rollout.mode=colocated"])
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [*base, "rollout.mode=disaggregated",
                                                "rollout.sglang.dtype=float32"])
    assert cfg.rollout.sglang.device == "cpu" and cfg.rollout.sglang.dtype == "float32"
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.dtype.*'fp32' is not one of"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", [*base, "rollout.mode=disaggregated",
                                              "rollout.sglang.dtype=fp32"])
    with pytest.raises(ConfigError, match=r"deterministic_inference.*GPU attention backends"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", [*base, "rollout.mode=disaggregated",
                                                         "rollout.sglang.deterministic_inference=true"])
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.device"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", ["rollout.sglang.device=tpu"])
