"""Peak owned memory of a CPU run's processes on one host: ``gspo-plan CONFIG --host``.

A run without GPUs (``model.transformer_impl=local``, SGLang's CPU engine) keeps everything in
host memory, and what a machine has to hold is each process's *owned* memory (RssAnon +
RssShmem: heap, tensors, shared memory; not the libraries' file pages), the quantity
``benchmarks/owned_memory.py`` measures. Per process kind:

* **learner rank** = the process itself (Python, torch, Megatron-Core, the tokenizer and data:
  :data:`LEARNER_PROCESS_BYTES`) + the planner's tensor estimate (``learner_memory.py``, the same
  terms as on a GPU) at the largest of three moments:

  - *training*: the estimate's training moment;
  - *building buffers*: DDP copying every trained weight into its contiguous buffer;
  - *weight sync*: the resident state (weights, grad buffer, optimizer state) plus one flat
    bucket of ``rollout.weight_sync.bucket_bytes`` that the broadcast transport sends
    (``weight_sync/buckets.py: Bucket.flatten``), capped at the bf16 model;
  - *checkpoint save* (when the run saves one: ``checkpoint.save_every_steps`` or
    ``save_final``): the resident state plus the one tensor the save has in hand
    (``planner/checkpoint_io.py``: the fast form writes each rank's own optimizer shard, views
    of its buffers; before issue 49 Megatron-Core gathered the layout-independent form, 12
    bytes of every trained parameter of the stage, into new host tensors).

  Not the GPU estimate's *optimizer step*: on CPU the learner steps torch's fused Adam
  (``learner/optimizer.py: _fuse_cpu_adam``), which updates each tensor in place without
  multi-tensor temporaries.
* **SGLang CPU server** = its three processes (launcher / tokenizer manager, scheduler,
  detokenizer: :data:`SERVER_PROCESS_BYTES`) + bf16 weights + the KV pool
  (``rollout.sglang.max_total_tokens`` tokens, else ``mem_fraction_static`` of host memory less
  the weights, as SGLang sizes it) + one received weight-update bucket.

The two process constants were measured on a model whose tensors are small, not on the 30B run
they are then compared with: ``tests/test_real_geometry_train.py``'s run (2 GSPO steps of this
config on the structural geometry, 256-wide, real vocabulary and tokenizer; 2026-12-06) peaked at
0.955 GiB for the learner process, of which the planner's tensors are 0.41 GiB, and at 3.46 GiB
for the server, of which weights and one update bucket are 0.30 GiB. ``docs/real_geometry.md``,
"GSPO training at the real widths", compares the prediction with the 30B run's peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from gspo_megatron.planner.checkpoint_io import plan_checkpoint
from gspo_megatron.planner.learner_memory import LearnerEstimate, Term
from gspo_megatron.planner.model_shape import Layout, ModelShape
from gspo_megatron.planner.precision import Precision
from gspo_megatron.planner.rollout_memory import kv_bytes_per_token, rollout_server_weights

GiB = 2 ** 30

LEARNER_PROCESS_BYTES = int(0.55 * GiB)
"""Owned memory of a gspo-train learner process before its model: interpreter, torch,
Megatron-Core, transformers' tokenizer, the dataset, threads (measured: see module doc)."""
SERVER_PROCESS_BYTES = int(3.16 * GiB)
"""Owned memory of one SGLang 0.5.23 CPU server's three processes besides weights and KV pool
(measured: see module doc)."""


@dataclass
class HostProcess:
    """One kind of process: its terms at its peak moment."""

    name: str
    count: int
    """Processes of this kind on the host."""
    moment: str
    terms: List[Term] = field(default_factory=list)

    @property
    def peak_bytes(self) -> float:
        """One process's peak."""
        return sum(t.bytes for t in self.terms)


@dataclass
class HostPlan:
    """The learner ranks and servers of a CPU run on one host."""

    learner: HostProcess
    server: Optional[HostProcess]
    host_memory_bytes: float

    @property
    def total_bytes(self) -> float:
        """Every process at its own peak at once (an upper bound: on-policy runs alternate)."""
        parts = [self.learner] + ([self.server] if self.server else [])
        return sum(p.peak_bytes * p.count for p in parts)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.host_memory_bytes


def learner_process(est: LearnerEstimate, world_size: int, model_bf16_bytes: float,
                    bucket_bytes: int, save_extra_bytes: Optional[float] = None) -> HostProcess:
    """One learner rank's owned-memory peak on a CPU host (see the module doc);
    ``save_extra_bytes``: what a save holds beyond the resident state (None: no saves)."""
    moments = {"training": est.moments.get("training", est.training_bytes),
               "building buffers": est.moments.get("building buffers", 0.0),
               "weight sync": est.resident_bytes + min(bucket_bytes, model_bf16_bytes)}
    if save_extra_bytes is not None:
        moments["checkpoint save"] = est.resident_bytes + save_extra_bytes
    moment = max(moments, key=moments.get)
    if moment == "training":
        tensors = list(est.terms)
    else:
        tensors = [Term(f"tensors ({moment})", moments[moment])]
    return HostProcess("learner rank", world_size, moment,
                       [Term("process (Python, torch, Megatron-Core, tokenizer)",
                             LEARNER_PROCESS_BYTES), *tensors])


def server_process(shape: ModelShape, num_servers: int, max_total_tokens: Optional[int],
                   mem_fraction_static: float, host_memory_bytes: float,
                   bucket_bytes: int) -> HostProcess:
    """One SGLang CPU server's owned-memory peak (TP 1: the CPU engine's one rank)."""
    weights = rollout_server_weights(shape, 1)
    per_token = kv_bytes_per_token(shape, 1)
    if max_total_tokens is not None:
        kv = max_total_tokens * per_token
    else:
        kv = max(0.0, mem_fraction_static * host_memory_bytes - weights)
    return HostProcess("SGLang CPU server", num_servers, "weight update",
                       [Term("processes (launcher, scheduler, detokenizer)", SERVER_PROCESS_BYTES),
                        Term("weights (bf16)", weights), Term("KV pool", kv),
                        Term("received update bucket", min(bucket_bytes, weights))])


def estimate_host(cfg, shape: ModelShape, learner: LearnerEstimate, world_size: int,
                  host_memory_bytes: float) -> HostPlan:
    """The host plan of a CPU run (``cfg``: plain GSPOConfig; ``learner``: the config's
    estimate with ``kernel=local``)."""
    r = cfg.rollout
    bucket = r.weight_sync.bucket_bytes
    model_bf16 = 2 * shape.total_params()
    server = None
    if r.engine == "sglang" and not r.sglang.server_addresses:
        server = server_process(shape, r.sglang.num_servers, r.sglang.max_total_tokens,
                                r.sglang.mem_fraction_static, host_memory_bytes, bucket)
    save_extra = None
    if cfg.checkpoint.save_final or cfg.checkpoint.save_every_steps > 0:
        layout = Layout.from_parallel_config(cfg.parallel, world_size)
        save_extra = plan_checkpoint(shape, layout, Precision.from_config(cfg, on_gpu=False), 1,
                                     cfg.plan.checkpoint_write_gbps, cfg.checkpoint.keep_last,
                                     on_gpu=False).rank_save_extra_bytes
    return HostPlan(learner_process(learner, world_size, model_bf16, bucket, save_extra), server,
                    host_memory_bytes)


def host_memory_total() -> float:
    """This machine's memory (``/proc/meminfo`` MemTotal) in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024.0
    raise OSError("/proc/meminfo has no MemTotal")
