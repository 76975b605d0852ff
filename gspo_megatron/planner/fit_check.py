"""The fit check entry points run after loading a config: refuse a layout predicted not to fit
the declared GPUs (``load_fitting_config`` = ``config.load_config`` + :func:`check_fit`; used by
``gspo-train`` and the Slurm launch plan, so a job that cannot fit never reaches the queue).

Runs when ``plan.gpu_memory_gb`` is set and ``plan.check_fit`` is true (``plan.check_fit=false``
is the explicit override). The learner's per-GPU peak must fit ``gpu_memory_gb - reserved_gb``;
with SGLang rollouts, the server's KV cache at ``mem_fraction_static`` must hold at least one
sequence of ``data.max_prompt_tokens + rollout.max_new_tokens`` tokens; colocated, every phase of
the shared GPU must fit (``colocated.py``). The error names the biggest terms and the planner's
best layout on the same learner GPUs, as overrides. It also logs, without refusing, what the
run would meet at a save or a preemption: a step and its save longer than the Slurm warning's
lead (``launch.warning_lead_s``), ``checkpoint.keep_last`` + 1 checkpoints beyond the free space.
"""

from __future__ import annotations

import logging
import math
from typing import List, Optional

from gspo_megatron.config.load import load_config
from gspo_megatron.config.validate import ConfigError
from gspo_megatron.planner.colocated import max_mem_fraction_static
from gspo_megatron.planner.hardware import GB
from gspo_megatron.planner.plan import Plan, hardware_from_config, plain_config, plan_config

log = logging.getLogger(__name__)


def fit_problems(plan: Plan, cfg) -> List[str]:
    """Human-readable reasons the plan does not fit (empty when it fits)."""
    problems = []
    hw = plan.hardware
    if not plan.learner_fits:
        est = plan.learner
        terms = ", ".join(f"{t.name} {t.bytes / GB:.1f} GB" for t in est.biggest(3))
        problems.append(
            f"learner: predicted peak {est.peak_bytes / GB:.1f} GB per GPU (pipeline stage "
            f"{est.stage}, {est.peak_moment}) exceeds {hw.usable_bytes / GB:.1f} GB "
            f"(plan.gpu_memory_gb={cfg.plan.gpu_memory_gb:g} minus plan.reserved_gb="
            f"{cfg.plan.reserved_gb:g}); biggest terms: {terms}")
    for phase in plan.colocated:
        if phase.total_bytes <= hw.usable_bytes:
            continue
        terms = " + ".join(f"{name} {b / GB:.1f} GB" for name, b in phase.terms)
        if phase.name.startswith("generation"):
            fix = (f"lower rollout.sglang.mem_fraction_static to at most "
                   f"{math.floor(100 * max_mem_fraction_static(plan.learner, hw)) / 100:.2f}, or "
                   "shard the learner's state over more GPUs (more EP / TP / PP, or "
                   "optimizer.cpu_offload=true)")
        elif phase.name.startswith("weight sync"):
            fix = "lower rollout.weight_sync.bucket_bytes, or shard the learner's state over more GPUs"
        else:
            fix = "see the learner's terms above"
        problems.append(f"rollout.mode=colocated, phase '{phase.name}': {terms} = "
                        f"{phase.total_bytes / GB:.1f} GB exceeds {hw.usable_bytes / GB:.1f} GB; {fix}")
    if cfg.rollout.engine == "sglang" and not plan.rollout.fits:
        r, sg = plan.rollout, cfg.rollout.sglang
        problems.append(
            f"rollout.sglang.tp: {r.weights_bytes / GB:.1f} GB of weights per GPU at tp={sg.tp} "
            f"leave {max(r.kv_cache_bytes, 0) / GB:.1f} GB of KV cache at mem_fraction_static="
            f"{sg.mem_fraction_static:g}: not one sequence of {r.seq_len} tokens fits")
    return problems


def suggestion(cfg, plan: Plan) -> Optional[Plan]:
    """The planner's best fitting plan on the same number of learner nodes, if any."""
    from gspo_megatron.planner.search import search

    g = plan.hardware.gpus_per_node
    learner_nodes = max(1, math.ceil(plan.layout.world_size / g))
    rollout_gpus = cfg.rollout.sglang.num_servers * cfg.rollout.sglang.tp
    rollout_nodes = max(1, math.ceil(rollout_gpus / g))
    best = search(cfg, plan.hardware, learner_nodes + rollout_nodes, top=1,
                  search_optimizer=True, learner_nodes=[learner_nodes])
    return best[0] if best and best[0].fits else None


def checkpoint_warnings(plan: Plan, cfg) -> List[str]:
    """What a run on this plan would meet at a save or a preemption: a warned step and its
    save longer than ``launch.warning_lead_s`` allows, ``checkpoint.keep_last`` + 1
    checkpoints larger than the free space (``planner/checkpoint_io.py``)."""
    from gspo_megatron.planner.checkpoint_io import checkpoint_report

    ckpt, budget, free, where = checkpoint_report(plan, cfg)
    out = [budget.problem()] if budget.problem() else []
    at_save = plan.learner.resident_bytes + ckpt.rank_save_extra_gpu_bytes
    if at_save > plan.hardware.usable_bytes:
        out.append(f"a checkpoint save holds ~{at_save / GB:.1f} GB per GPU (the resident state "
                   f"and the precision-aware optimizer's state unscaled to fp32, "
                   f"{ckpt.rank_save_extra_gpu_bytes / GB:.1f} GB), more than "
                   f"{plan.hardware.usable_bytes / GB:.1f} GB: shard the optimizer over more GPUs")
    if free is not None and ckpt.keep_bytes > free:
        out.append(f"checkpoint.keep_last={cfg.checkpoint.keep_last}: {cfg.checkpoint.keep_last} "
                   f"+ 1 checkpoints of ~{ckpt.checkpoint_bytes / GB:.0f} GB need "
                   f"{ckpt.keep_bytes / GB:.0f} GB, {free / GB:.0f} GB are free at {where}")
    return out


def check_fit(cfg, world_size: Optional[int] = None) -> None:
    """Raise :class:`ConfigError` when the layout is predicted not to fit (see module doc);
    log what it would meet at a save or a preemption (:func:`checkpoint_warnings`)."""
    if cfg.plan.gpu_memory_gb is None or not cfg.plan.check_fit:
        return
    cfg = plain_config(cfg)
    plan = plan_config(cfg, hardware_from_config(cfg), world_size)
    for warning in checkpoint_warnings(plan, cfg):
        log.warning("%s", warning)
    problems = fit_problems(plan, cfg)
    if not problems:
        return
    best = suggestion(cfg, plan)
    hint = (f"the planner suggests: {' '.join(best.overrides())}" if best else
            "no layout of these learner GPUs fits; see gspo-plan CONFIG --nodes N")
    raise ConfigError("plan: layout predicted not to fit the GPUs:\n  " + "\n  ".join(problems)
                      + f"\n  {hint}\n  (gspo-plan CONFIG shows every term; "
                      "plan.check_fit=false skips this check)")


def load_fitting_config(path, overrides=(), *, world_size: Optional[int] = None):
    """``config.load_config`` followed by :func:`check_fit` (same arguments)."""
    cfg = load_config(path, overrides, world_size=world_size)
    check_fit(cfg, world_size=world_size)
    return cfg
