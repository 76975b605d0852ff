"""Cross-field rules of the configuration tree, in one place.

Type and key checks come from the structured schema; this module checks what only makes sense
across fields: a parallel layout that Megatron-Core would reject (or, worse, silently run
wrongly), batch settings that cannot fit, and algorithm settings outside their meaning. All
problems are collected and reported together, each naming its key. ``tests/test_configs`` runs
this on every file in ``configs/``.
"""

from __future__ import annotations

from typing import List, Optional

from gspo_megatron.config.errors import ConfigError  # noqa: F401  (re-exported)
from gspo_megatron.config.allocation import allocation_problems, fleet_problems
from gspo_megatron.config.freeze import freeze_problems
from gspo_megatron.config.sequence_padding import FP8_RECIPES, pad_multiple_for, round_up
from gspo_megatron.config.schema import (CORRECTION_LEVELS, CORRECTION_MODES, EMBEDDED_DTYPES,
                                         ROUTING_REPLAY_MODES, correction_of, rollout_staleness,
                                         routing_replay_mode)

SGLANG_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
"""``--dtype`` choices of sglang 0.5.23 (``srt/arg_groups/fields/model.py``)."""

CHOICES = {
    "model.arch": ("qwen3", "qwen3_moe"),
    "model.transformer_impl": ("auto", "transformer_engine", "local"),
    "model.params_dtype": ("auto", "bf16", "fp32"),
    "model.recompute": ("none", "selective", "full"),
    "model.moe_token_dispatcher": ("allgather", "alltoall"),
    "model.moe_router_dtype": ("fp32", "fp64", "none"),
    "model.fp8.format": ("hybrid", "e4m3"),
    "model.fp8.recipe": FP8_RECIPES,
    "optimizer.lr_decay_style": ("constant", "linear", "cosine"),
    "optimizer.moments_dtype": ("fp32", "bf16"),
    "algo.loss": ("gspo", "gspo_token", "grpo"),
    "algo.advantage": ("group_norm", "group_mean"),
    "algo.grpo_aggregation": ("token_mean", "seq_mean_token_mean"),
    "algo.old_logprob_source": ("learner", "rollout"),
    "algo.tis.level": ("auto", *CORRECTION_LEVELS),
    "rollout.engine": ("embedded", "sglang", "reference"),
    "rollout.mode": ("colocated", "disaggregated"),
    "rollout.sglang.device": ("cuda", "cpu"),
    "rollout.sglang.routing": ("least_loaded", "prompt_affinity"),  # server_pool.ROUTINGS
    "rollout.weight_sync.transport": ("auto", "nccl", "tensor", "disk"),
    "checkpoint.resume": ("auto", "always", "never"),
    "logging.wandb.mode": ("offline", "online", "disabled"),
}


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _check_context_parallel(cfg, check) -> None:
    """Context parallelism: the communication type TE is asked for, and what it needs of the heads
    (the padding to ``2 * cp`` chunks is :func:`_check_sequence_padding`)."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return
    comm = p.cp_comm_type  # None: TE's default, p2p
    check(comm in (None,) + CP_COMM_TYPES, "parallel.cp_comm_type",
          f"'{comm}' is not one of {', '.join(CP_COMM_TYPES)}")
    if comm in ("a2a", "a2a+p2p"):
        check(m.num_attention_heads % (p.tp * p.cp) == 0, "parallel.cp_comm_type",
              f"'{comm}' scatters attention heads over CP: tp*cp = {p.tp}*{p.cp} must divide "
              f"model.num_attention_heads={m.num_attention_heads}")


def _check_sequence_padding(cfg, check) -> None:
    """The longest sequence, padded as the learner pads it (TP/SP, CP, FP8), fits a micro-batch."""
    p = cfg.parallel
    multiple = pad_multiple_for(p, cfg.model)
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    padded = round_up(longest, multiple)
    why = "" if multiple == 1 else (
        f", padded to a multiple of {multiple} for tp={p.tp} sp={p.sp} cp={p.cp} "
        f"fp8={cfg.model.fp8.recipe if cfg.model.fp8.enabled else 'off'} ({padded} tokens; "
        "config/sequence_padding.py)")
    check(cfg.batch.max_tokens_per_micro_batch >= padded, "batch.max_tokens_per_micro_batch",
          f"{cfg.batch.max_tokens_per_micro_batch} cannot hold one sequence of up to "
          f"data.max_prompt_tokens + rollout.max_new_tokens = {longest} tokens{why}")


def _check_fp8(cfg, check) -> None:
    """FP8 runs only in Transformer Engine's layer spec, named explicitly: ``auto`` builds the
    local spec on a machine without a GPU, and the FP8 padding of packed micro-batches
    (config/sequence_padding.py) is TE's rule."""
    fp8 = cfg.model.fp8
    if not fp8.enabled:
        return
    check(cfg.model.transformer_impl == "transformer_engine", "model.fp8.enabled",
          f"FP8 needs model.transformer_impl=transformer_engine (Transformer Engine's layer spec, "
          f"GPU), got '{cfg.model.transformer_impl}'")
    check(fp8.recipe != "delayed" or (fp8.num_layers_at_start_in_bf16 == 0
                                      and fp8.num_layers_at_end_in_bf16 == 0),
          "model.fp8.recipe", "the 'delayed' recipe cannot keep first/last layers in BF16 "
          "(Megatron refuses it); set num_layers_at_start/end_in_bf16=0 or use 'tensorwise'")


def _check_fleet_and_allocation(cfg, check) -> None:
    """Rollout servers SGLang and the update group accept, filling the job's nodes exactly."""
    for key, message in fleet_problems(cfg.rollout) + allocation_problems(cfg):
        check(False, key, message)


# (key, lowest allowed value, whether the lowest value itself is allowed): counts, sizes, rates.
# A negative step count or a zero token budget would otherwise be accepted and fail (or do
# nothing) much later.
LOWER_BOUNDS = (
    ("trainer.num_steps", 0, True), ("trainer.num_sft_steps", 0, True),
    ("trainer.sft_batch_size", 1, True), ("trainer.eval_every_steps", 0, True),
    ("trainer.sft_lr", 0.0, False),
    ("checkpoint.save_every_steps", 0, True), ("checkpoint.keep_last", 1, True),
    ("launch.warning_lead_s", 0, False),
    ("rollout.max_new_tokens", 1, True), ("rollout.n_samples_per_prompt", 1, True),
    ("rollout.sglang.num_servers", 1, True), ("rollout.sglang.max_retries", 0, True),
    ("rollout.sglang.request_timeout_s", 0.0, False), ("rollout.sglang.health_timeout_s", 0.0, False),
    ("rollout.sglang.restarts_per_hour", 0, True), ("rollout.sglang.hang_timeout_s", 0.0, False),
    ("rollout.sglang.max_concurrency_per_server", 1, True),
    ("data.max_prompt_tokens", 1, True), ("data.max_bad_row_fraction", 0.0, True),
    ("reward.timeout_s", 0.0, False), ("reward.num_workers", 1, True),
    ("optimizer.min_lr", 0.0, True), ("optimizer.warmup_steps", 0, True),
    ("optimizer.weight_decay", 0.0, True), ("optimizer.adam_eps", 0.0, False),
    ("optimizer.clip_grad", 0.0, True), ("optimizer.adam_beta1", 0.0, True),
    ("optimizer.adam_beta2", 0.0, True), ("batch.max_tokens_per_micro_batch", 1, True),
    ("algo.dynamic_sampling.max_rounds", 0, True), ("algo.advantage_eps", 0.0, True),
    ("model.num_layers", 1, True), ("model.hidden_size", 1, True),
    ("model.num_attention_heads", 1, True), ("model.num_query_groups", 1, True),
    ("model.head_dim", 1, True), ("model.vocab_size", 1, True),
    ("model.max_position_embeddings", 1, True), ("model.num_experts", 0, True),
)


def _check_ranges(cfg, check) -> None:
    """Counts, sizes and rates within their meaning (each bound in ``LOWER_BOUNDS``)."""
    for key, low, inclusive in LOWER_BOUNDS:
        value = _get(cfg, key)
        ok = value >= low if inclusive else value > low
        check(ok, key, f"{value} must be {'>=' if inclusive else '>'} {low}")
    for key in ("optimizer.adam_beta1", "optimizer.adam_beta2"):
        check(_get(cfg, key) < 1.0, key, f"{_get(cfg, key)} must be < 1")
    check(cfg.data.max_bad_row_fraction <= 1.0, "data.max_bad_row_fraction",
          f"{cfg.data.max_bad_row_fraction} must be <= 1")
    if cfg.optimizer.lr > 0:  # lr itself is checked with the optimizer
        check(cfg.optimizer.min_lr <= cfg.optimizer.lr, "optimizer.min_lr",
              f"{cfg.optimizer.min_lr} must be <= optimizer.lr={cfg.optimizer.lr}")
    _check_plan_assumptions(cfg.plan, check)


def _check_plan_assumptions(p, check) -> None:
    """The planner's time assumptions are shares: MFU and the mean response in (0, 1], the
    truncated share in [0, mean] (responses at the cap alone make the mean that large)."""
    for key in ("mfu", "mean_response_frac"):
        value = getattr(p, key)
        check(0.0 < value <= 1.0, f"plan.{key}", f"{value} must be in (0, 1]")
    check(0.0 <= p.truncated_frac <= min(p.mean_response_frac, 1.0), "plan.truncated_frac",
          f"{p.truncated_frac} must be in [0, plan.mean_response_frac={p.mean_response_frac}]")
    check(p.checkpoint_write_gbps > 0, "plan.checkpoint_write_gbps",
          f"{p.checkpoint_write_gbps} must be > 0 (GB/s)")


def _check_pipeline_split(cfg, check) -> None:
    """Layers per pipeline stage, even or uneven, exactly as Megatron-Core would build them."""
    from gspo_megatron.config.pipeline_split import (PipelineSplitError, stage_layer_counts,
                                                    suggest_uneven_split)

    m, p = cfg.model, cfg.parallel
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    uneven = first is not None or last is not None
    if p.vpp is not None:  # interleaved: even stages only (uneven + VPP is not tested here)
        check(p.pp > 1, "parallel.vpp", "virtual pipeline stages need parallel.pp > 1")
        check(not uneven, "parallel.vpp",
              "virtual pipeline stages with uneven first/last stages are not supported here; "
              "unset parallel.num_layers_in_first/last_pipeline_stage or parallel.vpp")
        check(p.vpp >= 1 and m.num_layers % (p.pp * p.vpp) == 0, "parallel.vpp",
              f"pp*vpp={p.pp}*{p.vpp} must divide model.num_layers={m.num_layers}")
        return
    try:
        stage_layer_counts(m.num_layers, p.pp, first, last)
    except PipelineSplitError as exc:
        key = ("parallel.num_layers_in_first_pipeline_stage" if uneven else "parallel.pp")
        hint = ""
        if not uneven and p.pp > 1:
            try:
                split = suggest_uneven_split(m.num_layers, p.pp)
            except PipelineSplitError:
                split = None
            if split:
                hint = (f"; for an uneven split set parallel.num_layers_in_first_pipeline_stage="
                        f"{split[0]} parallel.num_layers_in_last_pipeline_stage={split[1]}")
        check(False, key, f"{exc}{hint}")


def _check_optimizer_memory_options(cfg, check) -> None:
    """Megatron-Core 0.16.1's rules for its optimizer memory options (optimizer_config.py)."""
    o, m = cfg.optimizer, cfg.model
    if o.precision_aware or o.cpu_offload:
        key = "optimizer.precision_aware" if o.precision_aware else "optimizer.cpu_offload"
        check(o.use_distributed_optimizer or not o.precision_aware, key,
              "the precision-aware optimizer needs optimizer.use_distributed_optimizer=true")
        check(m.transformer_impl != "local", key,
              "needs GPUs (Transformer Engine's FusedAdam / CUDA streams); "
              "model.transformer_impl=local is the CPU path")
    check(o.moments_dtype == "fp32" or (o.precision_aware and not o.cpu_offload),
          "optimizer.moments_dtype", f"'{o.moments_dtype}' needs optimizer.precision_aware=true "
          "and no optimizer.cpu_offload (the offloaded CPU Adam keeps fp32 state)")
    check(0.0 < o.offload_fraction <= 1.0, "optimizer.offload_fraction",
          f"{o.offload_fraction} must be in (0, 1]")


def _check_paper_experiments(cfg, check) -> None:
    """Routing replay, TIS and the diagnostics: combinations that would not do what they say."""
    a, m = cfg.algo, cfg.model
    # auto: off at k <= 1; at k >= 2 _check_async refuses the rollout source itself
    mode = correction_of(cfg)[0]
    check(a.tis.mode == "auto" or mode == "off" or a.old_logprob_source == "learner",
          "algo.tis.mode", f"'{mode}' weighs by r = pi_old / pi_rollout, which needs pi_old from "
          "the learner; with algo.old_logprob_source=rollout pi_old *is* the engine's, every r "
          "would be 1 (the ratio already divides by the engine's log-probs): set "
          "algo.old_logprob_source=learner or algo.tis.mode=off")
    replay = routing_replay_mode(a)
    check(replay in ROUTING_REPLAY_MODES, "algo.routing_replay",
          f"{a.routing_replay!r} is not one of {', '.join(ROUTING_REPLAY_MODES)} (learner: R2, "
          "the learner's old-policy routing; rollout: R3, the engine's routing)")
    if replay in ("learner", "rollout"):
        check(m.arch == "qwen3_moe" and m.num_experts > 0, "algo.routing_replay",
              "routing replay needs an MoE model")
        check(replay == "rollout" or a.old_logprob_source == "learner", "algo.routing_replay",
              "the routing to replay is recorded by the learner's old-log-prob pass: set "
              "algo.old_logprob_source=learner (or algo.routing_replay=rollout to replay the "
              "engine's routing)")
        check(m.recompute != "full" or cfg.parallel.pp == 1, "algo.routing_replay",
              "with model.recompute=full the backward re-runs the router; replaying the right "
              "micro-batch's experts there needs parallel.pp=1")
    d = a.diagnostics
    edges = list(d.length_bucket_edges)
    check(all(e >= 1 for e in edges) and edges == sorted(set(edges)),
          "algo.diagnostics.length_bucket_edges", f"{edges} must be increasing integers >= 1")
    bins = list(d.log_ratio_bin_edges)
    check(bins == sorted(set(bins)), "algo.diagnostics.log_ratio_bin_edges",
          f"{bins} must be increasing")
    check(d.expert_volatility_num_seqs >= 0, "algo.diagnostics.expert_volatility_num_seqs",
          "must be >= 0 (0 turns it off)")
    stop = cfg.trainer.sft_stop_loss
    check(stop is None or stop > 0, "trainer.sft_stop_loss", f"{stop} must be > 0 (or null)")


def _check_overlap(cfg, check) -> None:
    """Off-policy rollouts (``rollout.max_staleness``, alias ``overlap_one_step``) and the
    engine's process."""
    r = cfg.rollout
    check(r.embedded_num_threads >= 1, "rollout.embedded_num_threads", "must be >= 1")
    check(r.overlap_thread_split in ("auto", "share", "full"), "rollout.overlap_thread_split",
          f"{r.overlap_thread_split!r} must be 'auto', 'share' or 'full'")
    check(r.overlap_probe_steps >= 0, "rollout.overlap_probe_steps", "must be >= 0 (0: no probe)")
    check(r.max_staleness >= 0, "rollout.max_staleness",
          f"{r.max_staleness} must be >= 0 (0: on-policy, 1: one step off-policy, k: tokens of "
          "RL step v train at steps v .. v + k)")
    check(r.async_groups_in_flight >= 0, "rollout.async_groups_in_flight",
          f"{r.async_groups_in_flight} must be >= 0 (0: the client's concurrency cap in groups)")
    check(not r.overlap_one_step or r.max_staleness in (0, 1), "rollout.overlap_one_step",
          f"is the old name of rollout.max_staleness=1, but rollout.max_staleness={r.max_staleness}"
          " is set too; drop rollout.overlap_one_step")
    k = rollout_staleness(r)
    if k == 0:
        return
    name = "rollout.overlap_one_step" if k == 1 and r.overlap_one_step else "rollout.max_staleness"
    check(r.engine == "embedded" or r.mode == "disaggregated", name,
          "colocated SGLang servers share the learner's GPUs and cannot generate while it "
          "trains; set rollout.mode=disaggregated")
    check(r.engine != "embedded" or r.weight_sync.transport in ("auto", "tensor"),
          "rollout.weight_sync.transport", "the embedded engine's process takes weights through "
          f"shared memory ('auto' or 'tensor') when {name}={r.max_staleness or 'true'}")
    check(routing_replay_mode(cfg.algo) != "learner", "algo.routing_replay",
          f"with {name} > 0 the learner would record its routing (R2) under weights that did "
          "not generate the samples, and an in-flight rollout's recording would not survive a "
          "checkpoint; replay the engine's routing, which travels with the samples (rollout), "
          "or train on-policy")
    if k >= 2:
        _check_async(cfg, check)


def _check_async(cfg, check) -> None:
    """``rollout.max_staleness >= 2``: continuous generation across weight updates."""
    r, a = cfg.rollout, cfg.algo
    check(r.engine in ("sglang", "reference"), "rollout.max_staleness",
          f"{r.max_staleness} needs servers that pause and resume requests across a weight "
          f"update (rollout.engine=sglang or reference); rollout.engine={r.engine} generates a "
          "batch at a time and cannot; use rollout.max_staleness <= 1 with it")
    check(not r.stop, "rollout.stop",
          f"{list(r.stop)}: stop strings cannot carry over a partial rollout (SGLang matches them "
          "only within one request's output, and a request cut by a weight sync goes on as a "
          "new one); under rollout.max_staleness >= 2 stop on token ids (the tokenizer's eos)")
    check(a.old_logprob_source == "learner", "algo.old_logprob_source",
          "'rollout' under rollout.max_staleness >= 2 would make pi_old the engine's mixture of "
          "stale weight versions, so the clip would hold the update near a point the learner no "
          "longer is; use 'learner' (the proximal policy, recomputed under the weights before "
          "each update, with algo.tis as the behaviour weight; docs/algorithms.md)")


def validate_config(cfg, world_size: Optional[int] = None) -> None:
    """Raise ConfigError listing every inconsistency found; return None when all is well.

    ``world_size``, when given, is the number of processes actually launched."""
    errors: List[str] = []

    def check(ok: bool, key: str, msg: str) -> None:
        if not ok:
            errors.append(f"{key}: {msg}")

    _check_choices_and_sizes(cfg, check)
    _check_ranges(cfg, check)
    if errors:  # the checks below divide by the sizes and branch on the choices
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    _check_model_layout(cfg, check)
    errors.extend(world_size_errors(cfg.parallel, world_size))
    _check_data_parallel_feed(cfg, world_size, check)
    _check_batching(cfg, check)
    _check_algorithm(cfg, check)
    _check_rollout(cfg, check)
    _check_context_parallel(cfg, check)
    _check_sequence_padding(cfg, check)
    _check_fp8(cfg, check)
    _check_fleet_and_allocation(cfg, check)
    _check_optimizer(cfg, check)
    _check_optimizer_memory_options(cfg, check)
    _check_paper_experiments(cfg, check)
    _check_overlap(cfg, check)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def _check_choices_and_sizes(cfg, check) -> None:
    """Every enumerated key holds one of its choices; every parallel size is >= 1."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        check(value in allowed, key, f"'{value}' is not one of {', '.join(allowed)}")
    for key in ("tp", "pp", "ep", "etp", "cp"):
        check(getattr(cfg.parallel, key) >= 1, f"parallel.{key}", "must be >= 1")
    check(correction_of(cfg)[0] in CORRECTION_MODES, "algo.tis.mode",  # a bare off reads false
          f"'{cfg.algo.tis.mode}' is not one of auto, {', '.join(CORRECTION_MODES)}")


def _check_model_layout(cfg, check) -> None:
    """Model shapes against the TP / PP / VPP / SP / EP layout."""
    m, p = cfg.model, cfg.parallel
    check(m.num_attention_heads % p.tp == 0, "parallel.tp",
          f"tp={p.tp} must divide model.num_attention_heads={m.num_attention_heads}")
    check(m.num_query_groups % p.tp == 0, "parallel.tp",
          f"tp={p.tp} must divide model.num_query_groups={m.num_query_groups}")
    check(m.num_attention_heads % m.num_query_groups == 0, "model.num_query_groups",
          f"{m.num_query_groups} must divide model.num_attention_heads={m.num_attention_heads}")
    _check_pipeline_split(cfg, check)
    check(not p.sp or p.tp > 1, "parallel.sp", "sequence parallelism needs parallel.tp > 1")

    is_moe = m.arch == "qwen3_moe"
    check(is_moe == (m.num_experts > 0), "model.num_experts",
          f"arch={m.arch} needs num_experts {'> 0' if is_moe else '= 0'}, got {m.num_experts}")
    if is_moe and m.num_experts > 0:
        check(m.num_experts % p.ep == 0, "parallel.ep",
              f"ep={p.ep} must divide model.num_experts={m.num_experts}")
        check(1 <= m.moe_router_topk <= m.num_experts, "model.moe_router_topk",
              f"{m.moe_router_topk} must be in [1, num_experts={m.num_experts}]")
        check(p.tp == 1 or p.sp, "parallel.sp",
              f"MoE with tp={p.tp} requires sequence parallelism (set parallel.sp=true)")
    else:
        check(p.ep == 1 and p.etp == 1, "parallel.ep",
              "expert parallelism (ep/etp > 1) needs an MoE model")


def world_size_errors(parallel, world_size: Optional[int] = None) -> List[str]:
    """The parallel layout against the number of processes, one message per problem.

    ``world_size`` is the number launched (None: check against ``parallel.world_size``, when the
    config sets it). The one place these rules live: ``validate_config`` reports them with the
    rest, ``distributed.runtime.init_distributed`` refuses to start a layout that breaks them.
    """
    p, errors = parallel, []
    if world_size is not None and p.world_size is not None and world_size != p.world_size:
        errors.append(f"parallel.world_size: config says {p.world_size} but {world_size} "
                      "processes were launched")
    world = world_size if world_size is not None else p.world_size
    if world is None:
        return errors
    dense_group = p.tp * p.pp * p.cp
    if world % dense_group:
        errors.append(f"parallel.world_size: world size {world} is not divisible by tp*pp*cp = "
                      f"{p.tp}*{p.pp}*{p.cp} = {dense_group}")
    expert_group = p.etp * p.ep * p.pp
    if world % expert_group:
        errors.append(f"parallel.ep: world size {world} is not divisible by etp*ep*pp = "
                      f"{p.etp}*{p.ep}*{p.pp} = {expert_group}")
    return errors


def _check_data_parallel_feed(cfg, world_size: Optional[int], check) -> None:
    """Every data-parallel rank needs at least one sequence of each mini-batch."""
    p = cfg.parallel
    world = world_size if world_size is not None else p.world_size
    if world is None or world % (p.tp * p.pp * p.cp):
        return
    dp = world // (p.tp * p.pp * p.cp)
    num_samples = cfg.batch.num_prompts_per_step * cfg.rollout.n_samples_per_prompt
    per_mini = num_samples // max(cfg.batch.num_mini_batches, 1)
    check(per_mini >= dp, "batch.num_mini_batches",
          f"a mini-batch of {per_mini} sequences cannot feed {dp} data-parallel ranks")


def _check_batching(cfg, check) -> None:
    """Rollout batch and mini-batches; the longest sequence against the model's positions."""
    m, b, r = cfg.model, cfg.batch, cfg.rollout
    check(b.num_prompts_per_step >= 1, "batch.num_prompts_per_step", "must be >= 1")
    check(b.num_mini_batches >= 1, "batch.num_mini_batches", "must be >= 1")
    num_samples = b.num_prompts_per_step * r.n_samples_per_prompt
    check(num_samples % max(b.num_mini_batches, 1) == 0, "batch.num_mini_batches",
          f"{b.num_mini_batches} must divide the rollout batch of "
          f"{b.num_prompts_per_step}*{r.n_samples_per_prompt} = {num_samples} sequences")
    longest = cfg.data.max_prompt_tokens + r.max_new_tokens
    check(longest <= m.max_position_embeddings, "rollout.max_new_tokens",
          f"prompt+response of {longest} tokens exceeds model.max_position_embeddings="
          f"{m.max_position_embeddings}")
    check(r.n_samples_per_prompt >= 2 or cfg.algo.advantage == "group_mean",
          "rollout.n_samples_per_prompt", "group-normalised advantages need >= 2 samples per prompt")


def _check_algorithm(cfg, check) -> None:
    """Clip range, KL and TIS settings within their meaning."""
    a = cfg.algo
    check(0.0 <= a.clip_eps_low < 1.0, "algo.clip_eps_low", f"{a.clip_eps_low} must be in [0, 1)")
    check(a.clip_eps_high >= 0.0, "algo.clip_eps_high", f"{a.clip_eps_high} must be >= 0")
    check(a.kl_coef >= 0.0, "algo.kl_coef", "must be >= 0")
    if correction_of(cfg)[0] == "mask":
        check(a.tis.cap > 1.0, "algo.tis.cap", f"{a.tis.cap} must be > 1 with algo.tis.mode=mask "
              "(the band [1/C, C] would keep only r = 1 exactly: every token or sequence dropped)")
    else:
        check(a.tis.cap >= 1.0, "algo.tis.cap", f"{a.tis.cap} must be >= 1 (truncation at "
              "min(r, C) below 1 would shrink every weight, even r = 1)")


def _check_rollout(cfg, check) -> None:
    """Sampling parameters, the embedded engine's batch, and the weight-sync transport."""
    r = cfg.rollout
    check(r.temperature > 0.0, "rollout.temperature", "must be > 0 (log-probs of greedy decoding are not a policy)")
    check(0.0 < r.top_p <= 1.0, "rollout.top_p", "must be in (0, 1]")
    check(r.embedded_max_batch_size >= 1, "rollout.embedded_max_batch_size", "must be >= 1")
    check(r.embedded_dtype in EMBEDDED_DTYPES, "rollout.embedded_dtype",
          f"{r.embedded_dtype!r} is not one of {', '.join(EMBEDDED_DTYPES)}")
    ws = r.weight_sync
    check(ws.bucket_bytes > 0, "rollout.weight_sync.bucket_bytes", "must be > 0")
    check(ws.transport != "disk" or bool(ws.disk_dir), "rollout.weight_sync.disk_dir",
          "transport=disk needs a shared directory")
    check(r.engine != "embedded" or ws.transport in ("auto", "tensor", "disk"),
          "rollout.weight_sync.transport", f"'{ws.transport}' needs server engines; the embedded "
          "engine takes 'tensor' or 'disk'")
    handles = ws.transport == "tensor" or (ws.transport == "auto" and r.mode == "colocated")
    nodes = cfg.launch.num_nodes
    # CudaIpcTransport sends handles of learner rank 0's GPUs (CPU: its shared memory) to every
    # server; a server on another node cannot open them (SGLang: "Invalid device_uuid",
    # srt/utils/patch_torch.py). Issue 29 item 3.
    check(not (r.engine in ("sglang", "reference") and handles and nodes is not None and nodes > 1),
          "rollout.weight_sync.transport", f"'{ws.transport}' sends tensor handles from learner "
          f"rank 0's node, which servers on the other {(nodes or 1) - 1} node(s) cannot open; "
          "set rollout.weight_sync.transport=nccl (a broadcast group reaches every node) or run "
          "on one node")
    s = r.sglang
    if r.engine == "sglang" and s.device == "cpu":
        # sglang 0.5.23's /release_memory_occupation synchronises CUDA: on the CPU engine it kills
        # the server (tried on the real server, docs/rollout.md), and there is no GPU to share.
        check(r.mode == "disaggregated", "rollout.mode", "SGLang's CPU engine "
              "(rollout.sglang.device=cpu) cannot release its memory (colocated mode is a GPU "
              "feature); set rollout.mode=disaggregated")
        check(s.tp == 1 and s.dp == 1 and s.ep == 1, "rollout.sglang.tp",
              "SGLang's CPU engine is run here with one process per server (tp = dp = ep = 1)")
        # srt/arg_groups/overrides.py: _deterministic_attention_backend refuses torch_native
        check(not s.deterministic_inference, "rollout.sglang.deterministic_inference",
              "SGLang 0.5.23 supports deterministic inference only with GPU attention backends "
              "(not the CPU engine's torch_native); sampling seeds are not honoured on CPU")
    check(s.dtype is None or s.dtype in SGLANG_DTYPES, "rollout.sglang.dtype",
          f"{s.dtype!r} is not one of {', '.join(SGLANG_DTYPES)} (or null: the checkpoint's own)")
    check(s.max_total_tokens is None or s.max_total_tokens >= 1, "rollout.sglang.max_total_tokens",
          "must be >= 1 (or null)")


def _check_optimizer(cfg, check) -> None:
    """Learning rate, the guard against non-finite steps, and the frozen parameter groups (the
    model section's shapes; the learner checks them again against ``model.hf_path``'s)."""
    check(cfg.optimizer.lr > 0, "optimizer.lr", "must be > 0")
    check(cfg.optimizer.max_consecutive_nonfinite >= 1, "optimizer.max_consecutive_nonfinite",
          "must be >= 1")
    from gspo_megatron.config.pipeline_split import PipelineSplitError, stage_layer_counts

    p = cfg.parallel
    try:
        stages = stage_layer_counts(cfg.model.num_layers, p.pp,
                                    p.num_layers_in_first_pipeline_stage,
                                    p.num_layers_in_last_pipeline_stage)
    except PipelineSplitError:  # reported by _check_pipeline_split
        stages = [cfg.model.num_layers]
    for problem in freeze_problems(cfg.model, cfg.optimizer.freeze, stages):
        key, msg = problem.split(": ", 1)
        check(False, key, msg)
