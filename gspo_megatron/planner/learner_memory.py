"""Per-GPU memory of a learner rank, term by term, for the most loaded pipeline stage.

The peak is the largest of three moments of a step:

* **training** (usually the largest): weights + fp32 grad buffer + this rank's optimizer share +
  FP8 weight copies, plus the activations of every micro-batch the stage holds in flight, plus
  either the log-prob pass on the logits (last stage, end of the forward) or one layer's backward
  working set, plus Megatron's persistent attention / all-gather buffer (local path);
* **optimizer step**: the static state plus Adam's per-parameter temporaries (the largest shard);
* **building** the DDP buffers under the distributed optimizer: every weight is copied into one
  contiguous buffer before its old storage is freed (``param_and_grad_buffer.py``), so weights
  briefly exist twice next to the grad buffer.

``docs/planner.md`` compares the result with peak memory measured on CPU and with Megatron's
``theoretical_memory_usage.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from gspo_megatron.planner.activations import (MicroBatchShape, attention_buffer_bytes,
                                               final_norm_bytes, in_flight_micro_batches,
                                               layer_activations, logits_bytes, rope_bytes)
from gspo_megatron.planner.model_shape import Layout, ModelShape, ParamCounts
from gspo_megatron.planner.precision import Precision

GB = 1e9


@dataclass(frozen=True)
class Workload:
    """What one optimizer step asks of the learner."""

    micro_batch: MicroBatchShape
    num_micro_batches: int
    """Micro-batches per optimizer step on one DP rank (bounds the pipeline's in-flight count)."""
    recompute: str = "none"
    """``none``, ``selective`` or ``full`` (``model.recompute``)."""
    kernel: str = "te"
    """``te`` (Transformer Engine, GPU) or ``local`` (Megatron's local spec, CPU)."""


@dataclass(frozen=True)
class Term:
    """One named memory term, in bytes."""

    name: str
    bytes: float


@dataclass
class LearnerEstimate:
    """The peak of one rank of the most loaded stage."""

    stage: int
    terms: List[Term] = field(default_factory=list)
    """Terms of the training moment, in report order."""
    peak_bytes: float = 0.0
    peak_moment: str = "training"
    host_bytes: float = 0.0
    """Optimizer state this rank keeps in host memory (CPU offload)."""
    resident_bytes: float = 0.0
    """What stays on the GPU between steps: weights, fp32 grad buffer, the optimizer state on the
    GPU and FP8 copies (a colocated server's KV cache has to fit beside it)."""
    trainable_params: float = 0.0
    """Parameters of this rank with gradients and optimizer state (``optimizer.freeze`` aside)."""
    moments: Dict[str, float] = field(default_factory=dict)
    """Every moment's total (``training``, ``optimizer step``, ``building buffers``); the peak
    is the largest (``planner/host_memory.py`` re-weighs them for a CPU process)."""

    @property
    def training_bytes(self) -> float:
        """Sum of the training moment's terms."""
        return sum(t.bytes for t in self.terms)

    def biggest(self, n: int = 3) -> List[Term]:
        """The ``n`` largest terms (for error messages)."""
        return sorted(self.terms, key=lambda t: -t.bytes)[:n]


def _fp8_layers(shape: ModelShape, layout: Layout, stage: int, precision: Precision) -> int:
    """FP8 layers on a stage: all but the leading/trailing BF16 ones of the whole model."""
    if not precision.fp8_weight_bytes:
        return 0
    counts = layout.stage_layers(shape.num_layers)
    start = sum(counts[:stage])
    half = precision.fp8_bf16_layers // 2
    bf16 = set(range(half)) | set(range(shape.num_layers - (precision.fp8_bf16_layers - half),
                                        shape.num_layers))
    return sum(1 for i in range(start, start + counts[stage]) if i not in bf16)


def _stage_estimate(shape: ModelShape, layout: Layout, precision: Precision, work: Workload,
                    stage: int) -> LearnerEstimate:
    pc = ParamCounts.for_stage(shape, layout, stage, precision.frozen)
    mb = work.micro_batch
    act = precision.act_bytes
    if precision.distributed_optimizer:  # frozen parameters have no state at all
        sharded = pc.trainable_dense / layout.dense_shard_group + \
            pc.trainable_expert / layout.expert_dp
    else:
        sharded = pc.trainable
    optimizer_total = sharded * precision.optimizer_bytes
    on_gpu = optimizer_total * (1 - precision.offload_fraction)
    fp8 = 0.0
    if pc.layers:
        fp8 = pc.linear / pc.layers * _fp8_layers(shape, layout, stage, precision) * \
            precision.fp8_weight_bytes
    layer = layer_activations(shape, layout, mb, work.kernel, work.recompute, act)
    in_flight = in_flight_micro_batches(layout, stage, work.num_micro_batches)
    saved = layer.saved_bytes * pc.layers * in_flight
    if work.kernel == "local":
        saved += rope_bytes(shape, mb) * pc.layers * in_flight
    last = stage == layout.pp - 1
    transient = layer.working_bytes if pc.layers else 0.0
    terms = [Term("weights", pc.total * precision.param_bytes),
             Term("grad buffer (fp32)", pc.trainable * precision.grad_bytes),
             Term("optimizer state", on_gpu)]
    if fp8:
        terms.append(Term("FP8 weight copies", fp8))
    terms.append(Term(f"activations ({work.recompute} recompute, {in_flight:g} in flight)", saved))
    if last:
        terms.append(Term("final norm + output input", final_norm_bytes(shape, layout, mb, act)))
        logits = logits_bytes(shape, layout, mb, act) + \
            _output_weight_grad_bytes(shape, layout, precision, work.kernel)
        if logits >= transient:
            terms.append(Term("logits / log-prob pass", logits))
            transient = 0.0
    if transient:
        terms.append(Term("one layer's backward", transient))
    buffer = attention_buffer_bytes(shape, layout, mb, work.kernel, act)
    if buffer:
        terms.append(Term("attention / all-gather buffer", buffer))
    est = LearnerEstimate(stage=stage, terms=terms,
                          host_bytes=optimizer_total * precision.offload_fraction,
                          trainable_params=pc.trainable)
    static = sum(t.bytes for t in terms[:3]) + fp8
    est.resident_bytes = static
    est.moments = _moments(shape, layout, precision, pc, static, est.training_bytes)
    est.peak_moment = max(est.moments, key=est.moments.get)
    est.peak_bytes = est.moments[est.peak_moment]
    return est


def _output_weight_grad_bytes(shape: ModelShape, layout: Layout, precision: Precision,
                              kernel: str) -> float:
    """Megatron's CPU path has no fused weight-gradient accumulation: the output layer's
    ``[V/tp, h]`` gradient is made in the weights' dtype, then added into the fp32 main_grad
    through an fp32 copy when the weights are 16-bit (measured at Qwen3's vocabulary in bf16:
    1.7 GiB, docs/real_geometry.md). None when the output layer is frozen or on the TE path."""
    if kernel != "local" or "output_layer" in precision.frozen:
        return 0.0
    act = precision.act_bytes
    return shape.padded_vocab(layout.tp) / layout.tp * shape.hidden_size * (
        act + (4 if act != 4 else 0))


def _moments(shape: ModelShape, layout: Layout, precision: Precision, pc: ParamCounts,
             static: float, training: float) -> Dict[str, float]:
    """Training, the optimizer step (Adam's temporaries on the largest shard) and building the
    DDP buffers (each trained weight copied into its contiguous buffer before the old storage
    is freed)."""
    embedding_trained = not {"embedding", "output_layer"} <= set(precision.frozen)
    largest_shard = max(shape.padded_vocab(layout.tp) * shape.hidden_size / layout.tp
                        if embedding_trained else 0, pc.trainable / max(pc.layers, 1)) / (
        layout.dense_shard_group if precision.distributed_optimizer else 1)
    return {"training": training,
            "optimizer step": static + 2 * 4 * largest_shard * (1 - precision.offload_fraction),
            "building buffers": ((pc.total + pc.trainable) * precision.param_bytes + pc.trainable
                                 * precision.grad_bytes) if precision.distributed_optimizer else 0}


def estimate_learner(shape: ModelShape, layout: Layout, precision: Precision,
                     work: Workload) -> LearnerEstimate:
    """The estimate of the stage with the largest peak (ties: the earliest stage).

    Only the first, second and last stages can be the largest: middle stages hold the same
    layers and no more micro-batches in flight than the second one."""
    candidates = sorted({0, min(1, layout.pp - 1), layout.pp - 1})
    stages = [_stage_estimate(shape, layout, precision, work, s) for s in candidates]
    return max(stages, key=lambda e: e.peak_bytes)


def estimate_stages(shape: ModelShape, layout: Layout, precision: Precision,
                    work: Workload) -> List[LearnerEstimate]:
    """One estimate per pipeline stage (for per-rank comparisons)."""
    return [_stage_estimate(shape, layout, precision, work, s) for s in range(layout.pp)]
