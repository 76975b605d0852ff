"""A training checkpoint of a layout: its size, each rank's writes and host memory, the save's
time, and whether a preempted step and its save fit before the job ends (``gspo-plan``).

What training saves (``learner/checkpointing.py``): every weight once at its own precision, and
for every trained parameter the distributed optimizer's fp32 main weight and two moments, in
the fast form (megatron-core's ``dp_reshardable``): each rank writes its own optimizer shard,
views of its buffers with no gather, and the weights that several ranks hold are written by one
of them, spread evenly (``FullyParallelSaveStrategyWrapper``). Each rank's writes are then about
the checkpoint over the world, a node's the sum of its ranks', and the save takes the node's
bytes at ``plan.checkpoint_write_gbps``. A rank's host memory beyond its resident state is the
one tensor in hand (``learner/streaming_save.py``: copied to host, written, dropped): its
largest shard. A load reads into the same tensors, one at a time.

For comparison, the portable form (``fully_reshardable``, written only by ``gspo-reshard
--portable-optimizer``) gathers, on every rank, the whole data-parallel group's main weights
and moments (megatron-core 0.16.1 ``optimizer/distrib_optimizer.py``,
``get_parameter_state_dp_zero`` with ``return_on_all_ranks=True``), and only the groups' first
replicas write.

The preemption budget: Slurm warns ``launch.warning_lead_s`` before the end (the job script's
``--signal=B:USR1@N``); the learner must be out ``GSPO_REQUEUE_LEAD_S`` (60 s) before the end,
and a warning that lands just after a step began needs the step and a save
(``trainer/deadline.py`` plans with the same terms). Not modelled: a parallel file system's
aggregate limit below nodes x ``plan.checkpoint_write_gbps``, and its quota.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from gspo_megatron.planner.model_shape import Layout, ModelShape, ParamCounts
from gspo_megatron.planner.precision import Precision

REQUEUE_LEAD_S = 60
"""``slurm/lib.sh``'s ``GSPO_REQUEUE_LEAD_S`` default: the learner's deadline before the end."""
SAVED_OPTIMIZER_BYTES = 12
"""What a save writes per trained parameter: fp32 main weight, exp_avg and exp_avg_sq, whatever
the optimizer keeps in memory. The precision-aware optimizer (bf16 moments, 16-bit remainders)
hands them over unscaled in fp32 (megatron-core 0.16.1 ``distrib_optimizer.py``,
``_get_main_param_and_optimizer_states``: ``get_unscaled_state``): new GPU tensors, 12 bytes per
parameter of the rank's shard, held until they are written."""


@dataclass(frozen=True)
class CheckpointPlan:
    """One layout's training checkpoint (bytes and seconds)."""

    checkpoint_bytes: float
    """Weights and optimizer state of the whole model: what a save writes."""
    rank_write_bytes: float
    """One rank's share of the writes (fast form)."""
    node_write_bytes: float
    save_s: float
    """A node's writes at ``plan.checkpoint_write_gbps``: every node writes at once."""
    rank_optimizer_shard_bytes: float
    """The optimizer state this rank owns (its fp32 main weights and moments)."""
    rank_save_extra_bytes: float
    """Host memory a save holds beyond the resident state: the largest tensor in hand."""
    rank_save_extra_gpu_bytes: float
    """GPU memory a save holds beyond the resident state: 0, or the unscaled fp32 copies of a
    precision-aware optimizer's shard (:data:`SAVED_OPTIMIZER_BYTES`)."""
    rank_load_extra_bytes: float
    portable_rank_gather_bytes: float
    """What the portable form's save gathers on every rank (for comparison)."""
    keep_bytes: float
    """``checkpoint.keep_last`` + 1 checkpoints: a save happens before rotation deletes."""


def plan_checkpoint(shape: ModelShape, layout: Layout, precision: Precision, nodes: int,
                    write_gbps: float, keep_last: int, on_gpu: bool = True) -> CheckpointPlan:
    """The checkpoint of ``layout`` on ``nodes`` learner nodes (see the module docstring);
    ``on_gpu=False``: a CPU run's learner (the host-memory plan)."""
    whole = ParamCounts.for_stage(shape, Layout(), 0, precision.frozen)
    total = whole.total * precision.param_bytes + whole.trainable * SAVED_OPTIMIZER_BYTES
    world = layout.world_size
    per_rank = total / world
    per_node = per_rank * world / max(nodes, 1)
    shard_params, gathered = 0.0, 0.0
    for stage in range(layout.pp):  # the most loaded stage's rank
        counts = ParamCounts.for_stage(shape, layout, stage, precision.frozen)
        shard_params = max(shard_params, counts.trainable_dense / layout.dense_shard_group
                           + counts.trainable_expert / layout.expert_dp)
        gathered = max(gathered, counts.trainable * SAVED_OPTIMIZER_BYTES)
    largest = _largest_tensor_bytes(shape, layout, precision, shard_params, on_gpu)
    scaled = precision.optimizer_bytes < SAVED_OPTIMIZER_BYTES and precision.param_bytes == 2
    return CheckpointPlan(
        checkpoint_bytes=total, rank_write_bytes=per_rank, node_write_bytes=per_node,
        save_s=per_node / (write_gbps * 1e9),
        rank_optimizer_shard_bytes=shard_params * precision.optimizer_bytes,
        rank_save_extra_bytes=largest,
        rank_save_extra_gpu_bytes=shard_params * SAVED_OPTIMIZER_BYTES if scaled else 0.0,
        rank_load_extra_bytes=largest, portable_rank_gather_bytes=gathered,
        keep_bytes=(max(keep_last, 1) + 1) * total)


def _largest_tensor_bytes(shape: ModelShape, layout: Layout, precision: Precision,
                          shard_params: float, on_gpu: bool) -> float:
    """The largest copy a rank makes to write one tensor (``learner/streaming_save.py``): of a
    GPU tensor, its host copy; of a host tensor, a clone only when it is a view (torch.save
    would write the whole storage). On a GPU: a weight shard at its own precision (the
    vocabulary's, a layer's fused MLP input) or an fp32 piece of the distributed optimizer's
    shard. On the host: the optimizer's pieces (views of its flat buffers) and the two halves
    of a fused SwiGLU input (views of it); whole weights are written in place."""
    h = shape.hidden_size
    vocab = shape.padded_vocab(layout.tp) * h / layout.tp
    if shape.is_moe:
        fc1 = 2 * shape.moe_ffn_hidden_size * h / layout.etp
    else:
        fc1 = 2 * shape.ffn_hidden_size * h / layout.tp
    vocab_trained = not {"embedding", "output_layer"} <= set(precision.frozen)
    experts_trained = "experts" not in precision.frozen or not shape.is_moe
    trained = max(vocab if vocab_trained else 0.0, fc1 if experts_trained else 0.0)
    main = min(trained, shard_params) * 4  # a param's piece of this rank's fp32 shard
    if on_gpu:
        return max(max(vocab, fc1) * precision.param_bytes, main)
    return max(main, fc1 / 2 * precision.param_bytes)


@dataclass(frozen=True)
class BudgetCheck:
    """Whether a warned step and its save fit before the job's end."""

    lead_s: float
    step_s: float
    save_s: float

    @property
    def usable_s(self) -> float:
        return self.lead_s - REQUEUE_LEAD_S

    @property
    def fits(self) -> bool:
        return self.step_s + self.save_s <= self.usable_s

    def problem(self) -> Optional[str]:
        """A sentence when it does not fit (None when it does)."""
        if self.fits:
            return None
        return (f"launch.warning_lead_s={self.lead_s:.0f} leaves {self.usable_s:.0f}s before the "
                f"learner's deadline, but a step (~{self.step_s:.0f}s) and a save "
                f"(~{self.save_s:.0f}s) take ~{self.step_s + self.save_s:.0f}s: a warning that "
                "lands early in a step drops that step and saves the one before "
                "(trainer/deadline.py); raise --signal=B:USR1@N in the job script and "
                "launch.warning_lead_s with it, or make saves faster")


def free_bytes(path: str | Path) -> Optional[float]:
    """Free space where ``path`` is or would be created (its nearest existing parent)."""
    path = Path(path).absolute()
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return float(shutil.disk_usage(candidate).free)
            except OSError:
                return None
    return None


def checkpoint_report(plan, cfg) -> Tuple[CheckpointPlan, BudgetCheck, Optional[float], str]:
    """The checkpoint, preemption budget and free space of a config's plan
    (``planner.plan.Plan``): learner nodes from its world size, the step at the config's own
    ``rollout.max_staleness``, the checkpoint directory's file system."""
    from gspo_megatron.planner.plan import model_shape
    from gspo_megatron.planner.timing import step_seconds

    nodes = max(1, math.ceil(plan.layout.world_size / plan.hardware.gpus_per_node))
    ckpt = plan_checkpoint(model_shape(cfg), plan.layout, plan.precision, nodes,
                           cfg.plan.checkpoint_write_gbps, cfg.checkpoint.keep_last)
    budget = BudgetCheck(float(cfg.launch.warning_lead_s),
                         step_seconds(plan.times, plan.configured_staleness), ckpt.save_s)
    where = str(cfg.checkpoint.dir or Path(cfg.logging.run_dir) / "checkpoints")
    return ckpt, budget, free_bytes(where), where


def checkpoint_markdown(plan: CheckpointPlan, budget: BudgetCheck, write_gbps: float,
                        command: str, title: str) -> str:
    """The doc section (``docs/cluster.md``), between :data:`DOC_BEGIN` and :data:`DOC_END`."""
    gb = 1e9
    rows = [("checkpoint (weights + fp32 main weights and Adam moments)",
             f"{plan.checkpoint_bytes / gb:.0f} GB"),
            ("written per rank / per learner node", f"{plan.rank_write_bytes / gb:.1f} GB / "
                                                     f"{plan.node_write_bytes / gb:.0f} GB"),
            (f"save time at {write_gbps:g} GB/s per node", f"{plan.save_s:.0f} s"),
            ("a rank's own optimizer shard", f"{plan.rank_optimizer_shard_bytes / gb:.2f} GB"),
            ("host memory per rank beyond its state, save / load",
             f"{plan.rank_save_extra_bytes / gb:.2f} GB / {plan.rank_load_extra_bytes / gb:.2f} GB"),
            ("GPU memory per rank beyond its state during a save (precision-aware optimizer: "
             "its state unscaled to fp32)", f"{plan.rank_save_extra_gpu_bytes / gb:.1f} GB"),
            ("the portable form's gather per rank (before issue 49: every save)",
             f"{plan.portable_rank_gather_bytes / gb:.0f} GB"),
            ("keep_last + 1 checkpoints on disk", f"{plan.keep_bytes / gb:.0f} GB"),
            ("Slurm warning lead / learner deadline before the end",
             f"{budget.lead_s:.0f} s / {REQUEUE_LEAD_S} s"),
            ("predicted step + save", f"{budget.step_s:.0f} s + {budget.save_s:.0f} s = "
                                      f"{budget.step_s + budget.save_s:.0f} s of "
                                      f"{budget.usable_s:.0f} s: "
                                      f"{'fits' if budget.fits else 'does not fit'}")]
    table = ["| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join([DOC_BEGIN, f"{title} (`{command}`, written by it):", "", *table,
                      DOC_END])


DOC_BEGIN = "<!-- gspo-plan --checkpoint-doc: begin (written by the planner) -->"
DOC_END = "<!-- gspo-plan --checkpoint-doc: end -->"


def checkpoint_lines(plan: CheckpointPlan, budget: Optional[BudgetCheck],
                     free: Optional[float], where: str) -> List[str]:
    """The plan as text lines (``gspo-plan``)."""
    gb = 1e9
    lines = [f"checkpoint: {plan.checkpoint_bytes / gb:.1f} GB (weights + fp32 main weights and "
             f"moments); per rank {plan.rank_write_bytes / gb:.2f} GB written, per node "
             f"{plan.node_write_bytes / gb:.1f} GB; save ~{plan.save_s:.0f}s",
             f"  host memory per rank beyond its state: save {plan.rank_save_extra_bytes / gb:.2f}"
             f" GB, load {plan.rank_load_extra_bytes / gb:.2f} GB (its own optimizer shard: "
             f"{plan.rank_optimizer_shard_bytes / gb:.2f} GB; the portable form would gather "
             f"{plan.portable_rank_gather_bytes / gb:.1f} GB)"]
    if plan.rank_save_extra_gpu_bytes:
        lines.append(f"  GPU memory per rank during a save: +{plan.rank_save_extra_gpu_bytes / gb:.1f}"
                     " GB (the precision-aware optimizer's state, unscaled to fp32 to be written)")
    if budget is not None:
        verdict = "fits" if budget.fits else "DOES NOT FIT"
        lines.append(f"  preemption: warning {budget.lead_s:.0f}s ahead, learner out "
                     f"{REQUEUE_LEAD_S}s before the end: step ~{budget.step_s:.0f}s + save "
                     f"~{budget.save_s:.0f}s {verdict} in {budget.usable_s:.0f}s")
    if free is not None:
        verdict = "fits" if plan.keep_bytes <= free else "DOES NOT FIT"
        lines.append(f"  disk: keep_last + 1 checkpoints = {plan.keep_bytes / gb:.0f} GB; "
                     f"{free / gb:.0f} GB free at {where}: {verdict}")
    return lines


def as_dict(plan: CheckpointPlan, budget: BudgetCheck, free: Optional[float]) -> dict:
    """``gspo-plan --json``'s ``checkpoint`` entry."""
    return {**asdict(plan), "preemption": {**asdict(budget), "usable_s": budget.usable_s,
                                           "fits": budget.fits},
            "free_bytes": free}
