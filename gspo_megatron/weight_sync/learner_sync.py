"""Weight sync from a Megatron learner (every rank) into the rollout engine (main rank).

The trainer calls one :class:`LearnerWeightSync` per update on every rank. It gathers the
learner's parameters into HF-named buckets (checkpoint/gather.py: per pipeline stage, one
collective per bucket) and runs :func:`weight_sync.sync.run_update` with a
:class:`DistCoordinator`: rank 0 drives the engine's protocol; the senders are rank 0 (in-process,
tensor-handle and disk transports: the gather delivers every bucket there) or each pipeline
stage's first rank (the broadcast transport: each stage sends its own buckets).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from gspo_megatron.checkpoint.gather import Layout, ReusedBuffers, iter_hf_buckets
from gspo_megatron.checkpoint.learner_hf import unwrapped_chunks
from gspo_megatron.weight_sync.buckets import Bucket
from gspo_megatron.weight_sync.sync import BucketTransport, Coordinator, MemberLost, run_update

log = logging.getLogger(__name__)


class DistCoordinator(Coordinator):
    """Roles and collectives over the learner's default process group."""

    def __init__(self, dst: str, layout: Layout) -> None:
        super().__init__()
        self.is_main = dist.get_rank() == 0
        self.is_sender = self.is_main if dst == "rank0" else layout.is_leader
        self.stage, self.num_stages = (layout.stage, layout.num_stages) if dst == "stage" else (0, 1)

    def broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def sum(self, values: Sequence[float]) -> List[float]:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()


class LearnerWeightSync:
    """Collective: streams the learner's current weights into the engine, one update per call."""

    def __init__(self, learner, engine, transport: Optional[BucketTransport], dst: str,
                 bucket_bytes: int, max_attempts: int = 3) -> None:
        if dst not in ("rank0", "stage"):
            raise ValueError(f"dst must be 'rank0' or 'stage', got {dst!r}")
        self.learner = learner
        self.engine = engine
        self.transport = transport
        self.dst = dst
        self.bucket_bytes = bucket_bytes
        self.max_attempts = max_attempts
        """Sends of one update when servers die during it (:class:`MemberLost`): each new
        attempt goes to the servers left, so a few deaths at once cost a few attempts."""
        self._coord: Optional[Coordinator] = None

    def coordinator(self) -> Coordinator:
        if self._coord is None:
            multi = dist.is_initialized() and dist.get_world_size() > 1
            self._coord = (DistCoordinator(self.dst, Layout.current(self.learner.model_cfg))
                           if multi else Coordinator())
            if self.transport is not None:
                self.transport.coordinator = self._coord
            if self._coord.is_sender and self.transport is None:
                raise RuntimeError(f"rank {dist.get_rank() if multi else 0} sends weights "
                                   f"(dst={self.dst}) but has no transport")
        return self._coord

    def __call__(self, weight_version: Optional[str]) -> Dict[str, float]:
        coord = self.coordinator()
        for attempt in range(1, self.max_attempts + 1):
            try:
                stats = self._update(weight_version, coord)
                break
            except MemberLost as exc:  # raised on every rank alike
                if attempt == self.max_attempts:
                    raise
                log.warning("%s; a rollout server was lost during the update: sending it again to "
                            "the servers left (attempt %d of %d)", exc, attempt + 1, self.max_attempts)
        if not coord.is_main:
            return {}
        metrics = stats.as_metrics()
        metrics["weight_sync/attempts"] = float(attempt)
        return metrics

    def _update(self, weight_version: Optional[str], coord: Coordinator):
        # every transport is done with a bucket before it asks for the next: one set of
        # receive buffers serves the whole update (the transport may want them shared)
        buffers = (self.transport.gather_buffers() if self.transport is not None
                   else ReusedBuffers())
        try:
            buckets = (Bucket.from_items(b) for b in
                       iter_hf_buckets(unwrapped_chunks(self.learner), self.learner.model_cfg,
                                       self.bucket_bytes, self.dst, buffers))
            return run_update(self.engine, self.transport, buckets, weight_version, coord)
        finally:
            buffers.release()  # held for one update only
