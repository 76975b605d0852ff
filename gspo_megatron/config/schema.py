"""Typed configuration tree of a gspo-megatron run.

Every component owns one small dataclass here and receives only its own sub-config. The tree is
an OmegaConf structured config: YAML files in ``configs/`` and command-line dot-list overrides are
merged onto it, so an unknown key or a value of the wrong type is rejected at load time (see
``config/load.py``); cross-field rules live in ``config/validate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class FP8Config:
    """FP8 training through Transformer Engine (GPU only)."""

    enabled: bool = False
    """Run the linear layers in FP8; needs ``model.transformer_impl=transformer_engine``."""
    format: str = "hybrid"
    """``hybrid`` (E4M3 forward, E5M2 backward) or ``e4m3``."""
    recipe: str = "delayed"
    """Scaling recipe: ``delayed``, ``tensorwise``, ``mxfp8`` or ``blockwise``."""
    num_layers_at_start_in_bf16: int = 1
    """Leading transformer layers kept in BF16 (they are the most sensitive)."""
    num_layers_at_end_in_bf16: int = 1
    """Trailing transformer layers kept in BF16."""


@dataclass
class ModelConfig:
    """Architecture of a Qwen3 (dense) or Qwen3-MoE model, in Hugging Face terms."""

    arch: str = "qwen3_moe"
    """``qwen3`` (dense) or ``qwen3_moe``."""
    hf_path: Optional[str] = None
    """Hugging Face checkpoint directory; when set, its config.json overrides the sizes below."""
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    """Dense MLP width (dense layers only)."""
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """Key/value heads (GQA)."""
    head_dim: int = 16
    vocab_size: int = 64
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times TP; padding is cut on export."""
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    qk_layernorm: bool = True
    tie_word_embeddings: bool = False
    num_experts: int = 4
    """Routed experts per MoE layer; must be 0 for ``arch=qwen3`` (dense)."""
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 64
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities (Qwen3-MoE does)."""
    moe_aux_loss_coeff: float = 0.0
    moe_router_dtype: str = "fp32"
    moe_grouped_gemm: bool = False
    """Grouped-GEMM experts (GPU); sequential experts otherwise."""
    moe_token_dispatcher: str = "allgather"
    """``allgather`` (works on CPU) or ``alltoall`` (GPU, the fast one with EP)."""
    transformer_impl: str = "auto"
    """``auto`` (Transformer Engine on GPU, local modules on CPU), ``transformer_engine`` or ``local``."""
    params_dtype: str = "auto"
    """``auto`` (bf16 on GPU, fp32 on CPU), ``bf16`` or ``fp32``."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``selective`` or ``full``."""
    fp8: FP8Config = field(default_factory=FP8Config)


@dataclass
class ParallelConfig:
    """Megatron-Core parallel layout. Data parallelism is what remains of the world size."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved schedule); None disables it."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven pipeline: transformer layers on the first stage (Megatron-Core's option of the same
    name); the other stages split the rest evenly. Needed when pp does not divide
    model.num_layers (Qwen3-235B-A22B: 94 layers). None: even split."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline: transformer layers on the last stage (it also holds the output layer and
    the log-prob pass, so it usually gets fewer). None: even split."""
    ep: int = 1
    """Expert-parallel size."""
    etp: int = 1
    """Expert tensor-parallel size."""
    cp: int = 1
    """Context-parallel size: each sequence is split into 2*cp load-balanced chunks."""
    cp_comm_type: Optional[str] = None
    """Transformer Engine's context-parallel communication: p2p (ring; default), all_gather, a2a
    or a2a+p2p. The local (CPU) attention always all-gathers keys/values."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1; required for MoE with tp > 1)."""
    world_size: Optional[int] = None
    """Learner processes; None means 'read it from the launcher' (validated again at start)."""


@dataclass
class OptimizerConfig:
    """Adam with warm-up and decay; Megatron's distributed optimizer shards its state."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    lr_decay_style: str = "constant"
    """``constant``, ``linear`` or ``cosine``."""
    use_distributed_optimizer: bool = True
    precision_aware: bool = False
    """Megatron-Core's ``use_precision_aware_optimizer``: Adam state in lower precision
    (``moments_dtype``) and the fp32 main weights kept as 16-bit remainders next to the bf16
    weights. Transformer Engine's FusedAdam does it (GPU only); needs use_distributed_optimizer."""
    moments_dtype: str = "fp32"
    """dtype of Adam's exp_avg and exp_avg_sq: ``fp32`` or ``bf16`` (bf16 needs precision_aware
    and halves the optimizer state; Megatron's ``exp_avg_dtype`` / ``exp_avg_sq_dtype``)."""
    cpu_offload: bool = False
    """Megatron-Core's ``optimizer_cpu_offload``: fp32 main weights and Adam state live in host
    memory and the update runs there (``HybridDeviceOptimizer``, GPU runs only), with the
    host<->device copies overlapped. Frees 12 bytes per parameter / DP of GPU memory."""
    offload_fraction: float = 1.0
    """Share of the optimizer state offloaded when ``cpu_offload`` (``optimizer_offload_fraction``)."""
    max_consecutive_nonfinite: int = 3
    """Updates skipped for a non-finite loss or grad norm in a row before the run stops."""
    freeze: List[str] = field(default_factory=list)
    """Parameter groups kept at their loaded values (``config/freeze.py``: ``embedding``,
    ``output_layer``, ``attention``, ``norms``, ``router``, ``experts``, ``mlp``). They get no
    fp32 gradient buffer, main weights or Adam moments (16 of the 18 bytes per parameter of bf16
    training with fp32 Adam, ``docs/learner.md``) and stay in checkpoints and weight syncs. An
    unknown name, half of a tied embedding, or every parameter of a pipeline stage is refused."""


@dataclass
class BatchConfig:
    """How a rollout batch becomes optimizer steps."""

    num_prompts_per_step: int = 8
    """Prompts sampled per RL step; each gets ``rollout.n_samples_per_prompt`` responses."""
    num_mini_batches: int = 4
    """Optimizer steps per rollout batch (the paper splits each rollout batch into 4)."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget of one packed micro-batch on one data-parallel rank (dynamic batching)."""


@dataclass
class DynamicSamplingConfig:
    """DAPO-style dynamic sampling: groups whose rewards are all equal carry no signal."""

    enabled: bool = False
    max_rounds: int = 3
    """Extra generation rounds allowed to refill dropped groups. Under ``rollout.max_staleness
    >= 2`` there are no rounds: the generator drops such groups as they finish (counted in
    ``async/dropped_zero_variance_groups``) and keeps admitting prompts."""


@dataclass
class TISConfig:
    """The importance correction against the rollout engine's log-probs, per token or per
    sequence, with ``r = pi_old / pi_rollout`` (``algorithms/correction.py``). On-policy it
    corrects the engine / learner mismatch; with stale rollouts (``rollout.max_staleness >= 2``)
    ``pi_old`` is the proximal policy and ``r`` the decoupled objective's behaviour weight
    (``docs/algorithms.md``, "Stale rollouts" and "Mismatch corrections")."""

    mode: str = "auto"
    """``truncate``: weight ``min(r, C)``; ``mask``: weight ``r`` inside ``[1/C, C]``, 0 outside
    (the token or sequence is dropped); ``off``: no weight (under staleness the uncorrected
    ablation, asked for by name); ``auto``: ``truncate`` under ``rollout.max_staleness >= 2``,
    ``off`` otherwise (resolved when the config is loaded: ``resolve_correction``)."""
    level: str = "auto"
    """``token`` or ``sequence`` (the length-normalised ``r_i = exp(mean_t(old_t - rollout_t))``,
    on the scale of GSPO's ``s_i``); ``auto``: ``sequence`` for ``gspo`` / ``gspo_token``,
    ``token`` for ``grpo``."""
    cap: float = 2.0
    """C: the truncation cap (>= 1), or the mask's band ``[1/C, C]`` (> 1)."""


@dataclass
class DiagnosticsConfig:
    """What the update does beyond the loss value (GSPO paper, section 5): per-length clipping
    and sequence log-ratios (logged by every loss) and MoE expert volatility (the trainer)."""

    length_bucket_edges: List[int] = field(default_factory=lambda: [256, 1024, 4096])
    """Upper edges (response tokens, increasing) of the response-length buckets; responses
    longer than the last edge form one more bucket. Metrics ``train/len_<bucket>/...``."""
    log_ratio_bin_edges: List[float] = field(
        default_factory=lambda: [-1e-2, -1e-3, -3e-4, 0.0, 4e-4, 1e-3, 1e-2])
    """Edges (increasing) of the histogram of sequence log-ratios ``mean_t(log pi - log pi_old)``
    per length bucket; ``len(edges) + 1`` bins, the outer two open-ended. The defaults straddle
    GSPO's clip range (log(1 - 3e-4), log(1 + 4e-4))."""
    expert_volatility_num_seqs: int = 32
    """MoE only: sequences of each rollout batch (evenly spaced) whose top-k experts are
    compared before and after the step's updates (two forward passes over them; metrics
    ``routing/*``). 0 turns it off; more than the batch means the whole batch."""


@dataclass
class AlgorithmConfig:
    """Policy-gradient objective; ``loss`` picks a registered loss, nothing else branches on it."""

    loss: str = "gspo"
    """``gspo``, ``gspo_token`` or ``grpo``."""
    clip_eps_low: float = 3e-4
    """Lower clip range (paper: 3e-4 for GSPO, 0.2 for GRPO)."""
    clip_eps_high: float = 4e-4
    """Upper clip range (paper: 4e-4 for GSPO, 0.27 for GRPO)."""
    advantage: str = "group_norm"
    """``group_norm`` ((r - mean) / (std + eps), paper Eq. 6) or ``group_mean`` (Dr. GRPO)."""
    advantage_eps: float = 1e-6
    grpo_aggregation: str = "token_mean"
    """GRPO only: ``token_mean`` or ``seq_mean_token_mean``."""
    kl_coef: float = 0.0
    """k3 KL penalty to the reference policy; 0 disables it (the paper omits KL)."""
    entropy_coef: float = 0.0
    old_logprob_source: str = "learner"
    """``learner`` (recompute) or ``rollout`` (the engine's log-probs, paper section 5.4)."""
    tis: TISConfig = field(default_factory=TISConfig)
    """Truncated IS against the engine; needs ``old_logprob_source=learner`` (with the engine's
    log-probs as pi_old every weight would be 1)."""
    routing_replay: str = "off"
    """MoE routing replay (Megatron-Core's ``RouterReplay``), one of :data:`ROUTING_REPLAY_MODES`:

    - ``off``: every pass routes for itself (GSPO does not need replay);
    - ``learner`` (R2, the paper's Routing Replay, section 5.3): the learner's old-log-prob
      pass records the experts of every token per mini-batch and each training pass of the same
      rollout batch replays them; needs ``old_logprob_source=learner``;
    - ``rollout`` (R3): the rollout engine returns the experts it routed every token to, and the
      learner's old-log-prob and training passes replay them, which also removes the train /
      inference routing mismatch. Costs ``2 * top_k`` bytes per token per MoE layer in the
      trainer (int16) and SGLang's ``--enable-return-routed-experts`` capture on the servers.

    ``true`` / ``false`` (configs written before R3) read as ``learner`` / ``off``."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)


EMBEDDED_DTYPES = ("fp32", "bf16")
"""``rollout.embedded_dtype`` values (torch.float32, torch.bfloat16)."""
ROUTING_REPLAY_MODES = ("off", "learner", "rollout")
_ROUTING_REPLAY_ALIASES = {"false": "off", "true": "learner"}


def rollout_staleness(rollout) -> int:
    """``rollout.max_staleness`` with the old ``overlap_one_step`` alias applied (true: 1)."""
    k = int(rollout.max_staleness)
    return 1 if rollout.overlap_one_step and k == 0 else k


CORRECTION_MODES = ("off", "truncate", "mask")
CORRECTION_LEVELS = ("token", "sequence")


def correction_of(cfg) -> Tuple[str, str]:
    """``(mode, level)`` of ``algo.tis`` for this run, ``auto`` replaced by what it means (see
    :class:`TISConfig`); any other value as given, for validation to refuse."""
    tis = cfg.algo.tis
    mode, level = tis.mode, tis.level
    if str(mode).lower() == "false":  # YAML reads a bare ``off`` as the boolean false
        mode = "off"
    if mode == "auto":  # (the rollout source at k >= 2 is refused by validation on its own)
        stale = rollout_staleness(cfg.rollout) >= 2
        mode = "truncate" if stale and cfg.algo.old_logprob_source == "learner" else "off"
    if level == "auto":
        level = "token" if cfg.algo.loss == "grpo" else "sequence"
    return mode, level


def resolve_correction(cfg) -> None:
    """Write :func:`correction_of` into ``cfg.algo.tis``, in place, so that the losses, the
    saved ``config.yaml`` and the log all name what runs."""
    cfg.algo.tis.mode, cfg.algo.tis.level = correction_of(cfg)


def routing_replay_mode(algo) -> str:
    """``algo.routing_replay`` as one of :data:`ROUTING_REPLAY_MODES` (old booleans mapped);
    any other value is returned as given, for validation to refuse."""
    value = str(algo.routing_replay).strip().lower()
    return _ROUTING_REPLAY_ALIASES.get(value, value)


@dataclass
class SGLangConfig:
    """SGLang server fleet used when ``rollout.engine=sglang``."""

    server_addresses: List[str] = field(default_factory=list)
    """``host:port`` of running servers; empty means launch ``num_servers`` of them."""
    num_servers: int = 1
    """Servers of the fleet; with ``launch.num_nodes`` set they must fill the rollout nodes."""
    port: int = 30000
    """First port; server i listens on ``port + i`` on its node."""
    tp: int = 1
    """GPUs of a server's tensor-parallel group; the one source of the servers' ``--tp-size`` and
    of the weight-update group's size."""
    dp: int = 1
    """Data-parallel replicas inside one server (``tp * dp`` GPUs per server)."""
    ep: int = 1
    """Expert parallelism inside a server's TP group (must divide ``tp``)."""
    mem_fraction_static: float = 0.7
    request_timeout_s: float = 600.0
    max_retries: int = 3
    health_timeout_s: float = 900.0
    """How long a server may take to answer ``/health``: the job's first start, and each restart
    (a restarted server still unhealthy after it is stopped and counted as a failed restart)."""
    restarts_per_hour: int = 3
    """Slurm job only (slurm/fleet.sh): a server whose step dies or hangs while the learner
    runs is restarted on its node (same port and keys) and rejoins at the next weight sync, at
    most this many times within any hour per server; one more death ends the job naming the
    server and its log. 0: a server's death ends the job."""
    hang_timeout_s: float = 300.0
    """Slurm job only: a server whose ``/health_generate`` has not answered 200 for this long
    (while it had been healthy) is hung: killed and restarted like a dead one."""
    max_concurrency_per_server: int = 64
    """Requests in flight per server."""
    routing: str = "least_loaded"
    """Which server a sample goes to: ``least_loaded`` (fewest of our requests in flight) or
    ``prompt_affinity`` (a prompt's samples stay on one server while its load allows, so the
    shared prompt is prefilled once; ``rollout/sglang/server_pool.py``). docs/rollout.md
    measures both against sglang-router."""
    deterministic_inference: bool = False
    """Start SGLang with --enable-deterministic-inference so that sampling_seed is honoured."""
    device: str = "cuda"
    """``cuda`` (the cluster) or ``cpu``: SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``,
    ``--device cpu --attention-backend torch_native --disable-cuda-graph --sleep-on-idle``), the
    real server on a machine without a GPU (docs/rollout.md); disaggregated mode only."""
    python: Optional[str] = None
    """Interpreter of the SGLang servers the trainer or the Slurm launch plan starts (a
    virtualenv with sglang, e.g. ``.venv-sglang/bin/python`` from ``make sglang-venv``); None:
    the trainer's own (``GSPO_PYTHON`` in a Slurm job: the image's one interpreter)."""
    dtype: Optional[str] = None
    """``--dtype`` of launched servers. None: the checkpoint's own (``config.json``), because
    SGLang's ``auto`` serves a float32 checkpoint in float16 (``srt/configs/model_config.py``;
    on the tiny model its log-probs then differ from the learner's by ~1e-4 instead of ~1e-7).
    ``auto`` leaves the choice to SGLang."""
    key_file: Optional[str] = None
    """JSON file of the servers' bearer keys (``rollout/sglang/server_keys.py``, mode 0600); None:
    ``<run_dir>/secrets/rollout_server_keys.json``. Servers the trainer (or the Slurm launch
    plan) starts get fresh keys made there and require them; for servers given in
    ``server_addresses`` the keys are read from it when it exists (else none are sent)."""
    max_total_tokens: Optional[int] = None
    """``--max-total-tokens`` of each server (KV-cache size in tokens); None: SGLang sizes it
    from ``mem_fraction_static`` (on CPU: of the host's memory, so set it there)."""


@dataclass
class WeightSyncConfig:
    """How new weights travel from the learner to the rollout engine after each update."""

    transport: str = "auto"
    """``auto``, ``nccl`` (broadcast group, disaggregated), ``tensor`` (in-process / CUDA IPC) or ``disk``."""
    bucket_bytes: int = 512 * 1024 * 1024
    """Upper bound on the bytes of one streamed bucket."""
    disk_dir: Optional[str] = None
    """Shared directory for the ``disk`` transport."""
    master_address: Optional[str] = None
    """Rendezvous host of the broadcast group (learner rank 0); None: rank 0's own address on the
    route to the first rollout server (distributed/host_address.py)."""
    master_port: Optional[int] = None
    """Rendezvous port of the broadcast group; None picks a free one."""
    verify: bool = False
    """After every sync, each rollout server generates a few tokens from a fixed prompt and the
    learner recomputes their log-probs; a mean gap above ``verify_tolerance`` stops the run
    naming the server (``trainer/sync_check.py``). Server engines only; one short generation
    per server and one forward pass per sync."""
    verify_tolerance: float = 1.0e-2
    """Mean per-token log-prob gap allowed by ``verify`` (fp32 on CPU: ~5e-7; bf16 learners and
    servers differ by more: measure a first run's ``weight_sync/probe_abs_logp``)."""


@dataclass
class RolloutConfig:
    """Generation: engine, sampling parameters and placement."""

    engine: str = "embedded"
    """``embedded`` (in-process transformers, CPU default), ``sglang`` or ``reference`` (HTTP stand-in)."""
    mode: str = "colocated"
    """``colocated`` (engine shares the learner's devices) or ``disaggregated``."""
    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: List[str] = field(default_factory=list)
    embedded_max_batch_size: int = 256
    """Rows per forward pass of the embedded engine (the tiny CPU run: 256 measured ~2.5x
    faster than 64; per-pass overhead dominates a tiny model)."""
    max_staleness: int = 0
    """k: a token generated by the weights of RL step v may train at steps v .. v + k.
    ``0``: on-policy (generate, then train). ``1``: one-step off-policy, step k+1 generated
    while step k updates (trainer/schedule/stepwise.py; the embedded engine then runs in its own
    process, SGLang needs ``mode=disaggregated``). ``>= 2``: continuous generation on SGLang
    servers across weight updates, partial rollouts kept, the decoupled objective
    (trainer/schedule/k_stale.py, docs/algorithms.md)."""
    overlap_one_step: bool = False
    """The old name of ``max_staleness: 1`` (kept as an alias; true with another
    ``max_staleness`` than 0 or 1 is refused)."""
    async_groups_in_flight: int = 0
    """``max_staleness >= 2``: prompt groups the generator keeps on the servers at once. 0: as
    many as keep the client's concurrency cap busy, ``ceil(sglang.max_concurrency_per_server x
    servers / n_samples_per_prompt)``, the requests an on-policy batch has in flight (each
    request is a client thread in the trainer's process). Admission is also bounded by the
    staleness: (k + 1) batches of groups at most between syncs."""
    embedded_dtype: str = "fp32"
    """``fp32`` or ``bf16``: the embedded engine's weights and arithmetic (log-probs are taken in
    fp32 either way). ``bf16`` beside the fp32 CPU learner gives the train / inference mismatch
    of a bf16 SGLang fleet, routing flips included, which R3 (``algo.routing_replay=rollout``)
    and TIS address; fp32 matches the learner to ~1e-6 nats per token."""
    embedded_num_threads: int = 1
    """Torch threads of the embedded engine's process (``overlap_one_step`` only); how the main
    learner rank's own threads are shared with it is ``overlap_thread_split``."""
    overlap_thread_split: str = "auto"
    """``overlap_one_step`` with the embedded engine: ``share`` (the learner gives up
    ``embedded_num_threads`` of its threads, at least one stays), ``full`` (it keeps all of them;
    the machine is oversubscribed while the engine generates) or ``auto`` (measure both over the
    first steps and keep the faster; trainer/schedule/one_step_threads.py)."""
    overlap_probe_steps: int = 2
    """Overlapped steps per probe phase (each split, then generation and update one after the
    other); after them a WARNING says when the overlap is slower than not overlapping. 0: no
    probe and no check (``auto`` then means ``share``)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)


@dataclass
class DataConfig:
    """Prompt datasets (JSONL or Parquet)."""

    train_path: Optional[str] = None
    eval_path: Optional[str] = None
    prompt_key: str = "prompt"
    """Column with a prompt string or a list of chat messages."""
    answer_key: str = "answer"
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra variables of the tokenizer's chat template, e.g. ``{enable_thinking: false}`` for
    Qwen3's non-thinking mode (the template then ends the prompt with an empty think block)."""
    max_prompt_tokens: int = 512
    """Longer prompts are skipped and counted."""
    shuffle: bool = True
    max_bad_row_fraction: float = 0.01
    """The run stops when more than this fraction of rows is malformed."""
    retire_solved_prompts: bool = False
    """Query-set refresh: drop prompts that every sample solves or none does."""


@dataclass
class RewardConfig:
    """Reward functions: registered names or ``module:function``."""

    name: str = "math_verify"
    timeout_s: float = 10.0
    num_workers: int = 2


@dataclass
class CheckpointConfig:
    """Megatron distributed checkpoints of the learner and the trainer state."""

    dir: Optional[str] = None
    """Defaults to ``<logging.run_dir>/checkpoints``."""
    save_every_steps: int = 0
    """0 saves only at the end (and on a preemption signal)."""
    save_final: bool = True
    """Save a training checkpoint after the last step. false: the run ends with its HF export
    only (a preemption signal still saves). For a host without room for the save: the
    distributed optimizer's layout-independent save gathers fp32 main weights and Adam moments
    into new host tensors, 12 bytes per trained parameter (``gspo-plan --host`` counts it)."""
    load_dir: Optional[str] = None
    """Initial weights (a converted HF checkpoint); None means random init or ``model.hf_path``."""
    resume: str = "auto"
    """``auto`` resumes when ``dir`` holds a checkpoint; ``always`` or ``never``."""
    keep_last: int = 2
    async_save: bool = True
    """Periodic saves write their files while the next step's rollout is generated (the
    learner only waits then) and are completed before its update; the step is held only for
    the planning. Final and preemption saves are written at once. false: every save holds the
    step until it is complete."""


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: str = "offline"
    """``offline`` unless ``online`` is asked for and a key is present."""
    project: str = "gspo-megatron"
    entity: Optional[str] = None
    name: Optional[str] = None
    group: Optional[str] = None
    """Runs of one study share it (``gspo-grid submit`` sets the grid's name), so wandb compares
    them side by side."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    """All outputs of a run: resolved config, metrics.jsonl, plots, checkpoints, logs."""
    plot: bool = True
    """Write ``metrics.png`` (``trainer/plot.py``) at the end of the run."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainerConfig:
    """The RL loop."""

    num_steps: int = 10
    """RL steps; 0 runs only the cold start and exports it (the paper reproduction's shared SFT)."""
    seed: int = 1234
    eval_every_steps: int = 0
    """0 evaluates only before and after training."""
    num_sft_steps: int = 0
    """Cold-start supervised steps on reference answers before RL (the paper cold-starts)."""
    sft_lr: float = 3e-3
    """Constant learning rate of the cold-start steps (RL uses ``optimizer.lr``)."""
    sft_batch_size: int = 64
    """Prompts (with their reference answers) per cold-start step."""
    sft_stop_loss: Optional[float] = None
    """End the cold start early once the SFT loss, averaged over the last 20 steps, is below
    this (None: always ``num_sft_steps``). Where the loss drops suddenly at a seed- and
    machine-dependent step, a loss target starts RL from comparable policies everywhere."""
    reset_optimizer_after_sft: bool = True
    """Start RL with fresh Adam moments: the SFT-era second moments otherwise damp RL updates
    for ~1/(1-beta2) steps."""


@dataclass
class LaunchConfig:
    """The allocation the Slurm scripts launch a run on (slurm/gspo_30b.sh, slurm/tiny_cpu.sh).

    Read by the launch plan (``gspo_megatron/launch``) and by validation, which refuses a rollout
    fleet or learner world whose devices do not add up to it. The scripts set ``num_nodes`` from
    the job; a run started without them leaves it None and nothing here is checked.
    """

    num_nodes: Optional[int] = None
    """Nodes of the job; None: not launched through slurm/ (no allocation check)."""
    devices_per_node: int = 8
    """GPUs per node, one learner rank each (CPU profile: learner processes per node)."""
    num_learner_nodes: Optional[int] = None
    """``rollout.mode=disaggregated``: the first N nodes learn, the rest serve. Colocated: every
    node does both (leave None or set it to ``num_nodes``)."""
    warning_lead_s: int = 600
    """Seconds before the job's end that Slurm warns it: the job script's
    ``--signal=B:USR1@N`` (600 in ``slurm/gspo_30b.sh``). Config loading warns when the
    planner's step plus save time does not fit in it less the requeue's 60 s
    (``planner/checkpoint_io.py``). > 0."""


@dataclass
class PlanConfig:
    """What the memory planner assumes about the GPUs (``gspo-plan``, and the fit check that
    config loading runs; ``docs/planner.md``)."""

    gpu_memory_gb: Optional[float] = None
    """Memory of one GPU in GB (80 for an H100 80GB). Config loading refuses a learner or
    rollout layout predicted not to fit it, naming the biggest terms and the planner's best
    layout; None skips the check (CPU runs)."""
    reserved_gb: float = 4.0
    """Per GPU, memory held outside tensors: CUDA context, NCCL buffers, fragmentation."""
    check_fit: bool = True
    """false skips the fit check gspo-train and the launch plan run after loading the config
    (the explicit override: plan.check_fit=false)."""
    mfu: float = 0.3
    """Model FLOP utilisation assumed for the learner's time estimate (and for the servers'
    re-prefill of requests a sync aborts, ``rollout.max_staleness >= 2``). In (0, 1]."""
    mean_response_frac: float = 0.5
    """Assumed mean response length as a share of ``rollout.max_new_tokens``, for the time
    estimates only (tokens generated and trained per step); a run logs the real one as
    ``rollout/response_len_mean``. In (0, 1]."""
    truncated_frac: float = 0.05
    """Assumed share of responses that run to ``rollout.max_new_tokens`` (a run logs it as
    ``rollout/truncated_frac``), for the rollout's tail in the time estimates: the longest
    response of every batch is taken to reach the cap, and this share of a server's last wave
    of requests is what it still decodes while that response finishes
    (``planner/timing.py``). In [0, ``mean_response_frac``]: responses at the cap alone make
    the mean at least this share."""
    checkpoint_write_gbps: float = 2.0
    """Write bandwidth of the checkpoint file system, GB/s per node. The time of a save before
    the run measured one: a preempted run plans its last step with it (``trainer/deadline.py``).
    > 0."""


@dataclass
class GSPOConfig:
    """Root of the configuration tree."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
