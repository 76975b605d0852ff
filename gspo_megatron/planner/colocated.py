"""Memory of one GPU shared by a learner rank and a colocated SGLang server, phase by phase, in
the order the trainer runs them (``trainer/build.py``, ``trainer/loop.py``):

1. **start**: the servers start on empty GPUs and size their static pool then:
   ``mem_fraction_static`` of the memory free before loading (``rollout_memory.py``), weights
   plus KV cache. They are released (``/release_memory_occupation``, every tag) as soon as they
   are healthy, before the learner is built.
2. **learner**: build, the log-prob passes and the updates run with the servers released, so the
   learner's peak has the GPU to itself.
3. **weight sync**: only the servers' weights come back (``/resume_memory_occupation {tags:
   [weights]}``) while the learner's resident state (weights, fp32 grad buffer, optimizer state
   on the GPU, FP8 copies) stays, plus one gathered bucket in flight.
4. **generation**: the KV cache comes back too; the learner's resident state is still there (it
   is not offloaded), so resident + the static pool must fit.

Each phase must fit ``plan.gpu_memory_gb - plan.reserved_gb``; a phase that does not names its
terms and the setting that fixes it (``fit_check.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from gspo_megatron.planner.hardware import Hardware
from gspo_megatron.planner.learner_memory import LearnerEstimate
from gspo_megatron.planner.rollout_memory import RolloutEstimate


@dataclass(frozen=True)
class Phase:
    """One phase of a colocated step on one GPU."""

    name: str
    terms: Tuple[Tuple[str, float], ...]

    @property
    def total_bytes(self) -> float:
        return sum(b for _, b in self.terms)


def colocated_phases(learner: LearnerEstimate, rollout: RolloutEstimate, hw: Hardware,
                     bucket_bytes: float) -> List[Phase]:
    """The four phases of the module docstring, in order."""
    static_pool = rollout.weights_bytes + max(rollout.kv_cache_bytes, 0.0)
    resident = ("learner resident (weights, grads, optimizer)", learner.resident_bytes)
    return [
        Phase("start: servers hold their static pool", (("SGLang static pool", static_pool),)),
        Phase("learner: build, log-probs, updates (servers released)",
              ((f"learner peak ({learner.peak_moment})", learner.peak_bytes),)),
        Phase("weight sync (server weights resumed)",
              (resident, ("SGLang weights", rollout.weights_bytes),
               ("one bucket in flight (rollout.weight_sync.bucket_bytes)", float(bucket_bytes)))),
        Phase("generation (KV cache resumed)", (resident, ("SGLang static pool", static_pool))),
    ]


def max_mem_fraction_static(learner: LearnerEstimate, hw: Hardware) -> float:
    """The largest ``mem_fraction_static`` whose static pool fits beside the learner's resident
    state at generation time (may be <= 0: the resident state alone does not fit)."""
    before_load = hw.gpu_memory_bytes - hw.reserved_bytes
    return (hw.usable_bytes - learner.resident_bytes) / before_load
