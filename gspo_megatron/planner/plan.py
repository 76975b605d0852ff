"""One plan: a config's learner layout, rollout fleet and batch turned into memory and times.

    plan = plan_config(cfg, hardware_from_config(cfg))
    plan.fits, plan.learner.peak_bytes, plan.rollout.max_sequences, plan.times.learner_s

The model's sizes come from ``model.hf_path``'s config.json when that file exists (as the
learner reads them), else from the ``model`` section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import List, Optional, Tuple

from gspo_megatron.planner.activations import MicroBatchShape
from gspo_megatron.planner.colocated import Phase, colocated_phases
from gspo_megatron.planner.hardware import GB, Hardware
from gspo_megatron.planner.learner_memory import LearnerEstimate, Workload, estimate_learner
from gspo_megatron.planner.model_shape import Layout, ModelShape
from gspo_megatron.planner.precision import Precision
from gspo_megatron.planner.rollout_memory import RolloutEstimate, estimate_rollout
from gspo_megatron.config.schema import rollout_staleness
from gspo_megatron.planner.timing import (STALENESS_LEVELS, ResponseLengths, StepTimes,
                                          estimate_times, step_seconds)


@dataclass
class Plan:
    """Learner and rollout estimates of one layout on one kind of hardware."""

    layout: Layout
    recompute: str
    max_tokens_per_micro_batch: int
    learner: LearnerEstimate
    rollout: RolloutEstimate
    times: StepTimes
    hardware: Hardware
    num_servers: int
    server_tp: int
    precision: Precision
    extra_overrides: List[str] = field(default_factory=list)
    """Non-layout overrides this plan needs (optimizer options)."""
    colocated: List[Phase] = field(default_factory=list)
    """``rollout.mode=colocated`` with SGLang: each phase of a GPU shared by learner and server
    (``colocated.py``); empty otherwise."""
    staleness_levels: Tuple[int, ...] = STALENESS_LEVELS
    """The ``rollout.max_staleness`` values the config's engine and mode allow, of those
    ``gspo-plan`` tabulates."""
    configured_staleness: int = 0
    """The config's own ``rollout.max_staleness`` (``overlap_one_step`` read as 1)."""
    lengths: Optional[ResponseLengths] = None
    """The response lengths its times assume (:func:`response_lengths`)."""

    @property
    def learner_fits(self) -> bool:
        """The learner peak fits the usable memory."""
        return self.learner.peak_bytes <= self.hardware.usable_bytes

    @property
    def colocated_fits(self) -> bool:
        """Every colocated phase fits the usable memory (true when not colocated)."""
        return all(p.total_bytes <= self.hardware.usable_bytes for p in self.colocated)

    @property
    def fits(self) -> bool:
        """Learner fits, a server holds at least one sequence, and (colocated) every phase fits."""
        return self.learner_fits and self.rollout.fits and self.colocated_fits

    @property
    def learner_margin_bytes(self) -> float:
        """Usable memory left at the learner peak (negative: does not fit)."""
        return self.hardware.usable_bytes - self.learner.peak_bytes

    @property
    def step_s(self) -> float:
        """Rough RL-step time at the config's own ``rollout.max_staleness``
        (:func:`~gspo_megatron.planner.timing.step_seconds`; on-policy: generation with its
        tail, then the update, then the weight sync)."""
        return step_seconds(self.times, self.configured_staleness)

    def overrides(self) -> List[str]:
        """Config overrides selecting this plan (``launch.num_learner_nodes`` for the Slurm
        scripts' allocation check when the learners fill whole nodes)."""
        g = self.hardware.gpus_per_node
        nodes = ([f"launch.num_learner_nodes={self.layout.world_size // g}"]
                 if self.layout.world_size % g == 0 else [])
        return self.layout.overrides() + nodes + [
            f"model.recompute={self.recompute}",
            f"batch.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}",
            f"rollout.sglang.num_servers={self.num_servers}",
            f"rollout.sglang.tp={self.server_tp}"] + self.extra_overrides


def plain_config(cfg):
    """The config as plain dataclasses: OmegaConf attribute access is ~50x slower, and the
    search reads the config thousands of times."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg


def model_shape(cfg) -> ModelShape:
    """Sizes from ``model.hf_path``/config.json when it exists, else from ``model``."""
    m = cfg.model
    if m.hf_path and (Path(m.hf_path) / "config.json").is_file():
        from gspo_megatron.model.hf_config import as_model_config, model_config_from_hf, \
            read_hf_config

        source = str(Path(m.hf_path) / "config.json")
        m = model_config_from_hf(read_hf_config(m.hf_path), base=as_model_config(m),
                                 source=source)
    return ModelShape.from_model_config(m)


def hardware_from_config(cfg, gpu_memory_bytes: Optional[float] = None,
                         gpus_per_node: Optional[int] = None) -> Hardware:
    """``plan.*`` and ``launch.devices_per_node``, unless given (gspo-plan's flags)."""
    p = cfg.plan
    memory = gpu_memory_bytes if gpu_memory_bytes is not None else \
        (p.gpu_memory_gb or 80.0) * GB
    return Hardware(gpu_memory_bytes=memory,
                    gpus_per_node=gpus_per_node or cfg.launch.devices_per_node,
                    reserved_bytes=p.reserved_gb * GB)


def kernel(cfg) -> str:
    """``local`` for Megatron's local spec (CPU), else Transformer Engine."""
    return "local" if cfg.model.transformer_impl == "local" else "te"


def min_world_size(p) -> int:
    """Smallest learner world a layout needs (when the config does not fix one)."""
    dense, expert = p.tp * p.pp * p.cp, p.ep * p.etp * p.pp
    return dense * expert // math.gcd(dense, expert)


def workload(cfg, layout: Layout, shape: ModelShape, max_tokens: int,
             recompute: str) -> Workload:
    """The worst micro-batch the config allows: full of full-length sequences."""
    seq_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    num_seqs = cfg.batch.num_prompts_per_step * cfg.rollout.n_samples_per_prompt
    # A micro-batch holds at most a DP rank's share of the rollout batch (the old-log-prob pass
    # plans the whole batch; a training micro-batch holds one mini-batch's share or less).
    tokens = min(max_tokens, math.ceil(num_seqs / max(layout.dp, 1)) * seq_len)
    if kernel(cfg) == "local":  # rows layout: whole rows of the longest sequence
        tokens = max(1, tokens // seq_len) * seq_len
    response = tokens * cfg.rollout.max_new_tokens / seq_len
    per_rank = math.ceil(num_seqs / max(cfg.batch.num_mini_batches, 1) / max(layout.dp, 1))
    num_micro = max(1, math.ceil(per_rank * seq_len / max_tokens))
    mb = MicroBatchShape(tokens=tokens, seq_len=seq_len, response_tokens=int(response))
    return Workload(mb, num_micro, recompute=recompute, kernel=kernel(cfg))


def response_lengths(cfg) -> ResponseLengths:
    """The response lengths the times assume (``plan.mean_response_frac``,
    ``plan.truncated_frac``), the longest at ``rollout.max_new_tokens``."""
    cap = cfg.rollout.max_new_tokens
    return ResponseLengths(prompt_tokens=cfg.data.max_prompt_tokens,
                           mean_tokens=cap * cfg.plan.mean_response_frac, max_tokens=cap,
                           truncated_frac=cfg.plan.truncated_frac)


def staleness_levels(cfg) -> Tuple[int, ...]:
    """Of :data:`STALENESS_LEVELS`, those config validation allows with the config's engine
    and mode: colocated servers share the learner's GPUs (on-policy only), the embedded engine
    cannot pause requests across an update (k <= 1)."""
    if cfg.rollout.mode == "colocated" and cfg.rollout.engine != "embedded":
        return (0,)
    if cfg.rollout.engine == "embedded":
        return tuple(k for k in STALENESS_LEVELS if k <= 1)
    return STALENESS_LEVELS


def plan_layout(cfg, hw: Hardware, layout: Layout, *, recompute: Optional[str] = None,
                max_tokens: Optional[int] = None, num_servers: Optional[int] = None,
                server_tp: Optional[int] = None, precision: Optional[Precision] = None,
                extra_overrides: Optional[List[str]] = None, shape: Optional[ModelShape] = None,
                learner: Optional[LearnerEstimate] = None,
                rollout: Optional[RolloutEstimate] = None) -> Plan:
    """A plan for ``layout``; every other choice defaults to the config's. ``learner`` /
    ``rollout``: estimates already computed for exactly these choices (the search reuses them)."""
    shape = shape or model_shape(cfg)
    recompute = recompute or cfg.model.recompute
    max_tokens = max_tokens or cfg.batch.max_tokens_per_micro_batch
    precision = precision or Precision.from_config(cfg, on_gpu=kernel(cfg) == "te")
    sg = cfg.rollout.sglang
    num_servers = num_servers or sg.num_servers
    server_tp = server_tp or sg.tp
    work = workload(cfg, layout, shape, max_tokens, recompute)
    learner = learner or estimate_learner(shape, layout, precision, work)
    seq_len = work.micro_batch.seq_len
    rollout = rollout or estimate_rollout(shape, server_tp, sg.mem_fraction_static, seq_len, hw)
    num_seqs = cfg.batch.num_prompts_per_step * cfg.rollout.n_samples_per_prompt
    lengths = response_lengths(cfg)
    trained = num_seqs * (lengths.prompt_tokens + lengths.mean_tokens)
    times = estimate_times(shape, hw=hw, learner_gpus=layout.world_size, mfu=cfg.plan.mfu,
                           recompute=recompute, tokens_per_step=trained, num_seqs=num_seqs,
                           lengths=lengths, logprob_pass=cfg.algo.old_logprob_source == "learner",
                           num_servers=num_servers, server_tp=server_tp, rollout=rollout,
                           max_concurrency=sg.max_concurrency_per_server)
    if layout.pp > 1:  # 1F1B bubble: (pp - 1) idle slots per num_micro_batches
        m = work.num_micro_batches
        times = replace(times, learner_s=times.learner_s * (m + layout.pp - 1) / m)
    colocated = (colocated_phases(learner, rollout, hw, cfg.rollout.weight_sync.bucket_bytes)
                 if cfg.rollout.mode == "colocated" and cfg.rollout.engine == "sglang" else [])
    return Plan(layout=layout, recompute=recompute, max_tokens_per_micro_batch=max_tokens,
                learner=learner, rollout=rollout, times=times, hardware=hw,
                num_servers=num_servers, server_tp=server_tp, precision=precision,
                extra_overrides=list(extra_overrides or []), colocated=colocated,
                staleness_levels=staleness_levels(cfg),
                configured_staleness=rollout_staleness(cfg.rollout), lengths=lengths)


def plan_config(cfg, hw: Hardware, world_size: Optional[int] = None) -> Plan:
    """The plan of the config as written (``world_size``: launched learner processes)."""
    cfg = plain_config(cfg)
    p = cfg.parallel
    world = world_size or p.world_size or min_world_size(p)
    return plan_layout(cfg, hw, Layout.from_parallel_config(p, world))
