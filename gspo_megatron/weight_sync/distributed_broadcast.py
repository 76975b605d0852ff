"""Broadcast-group transport: learner rank 0 -> every rollout server (disaggregated mode).

What SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed`` implement:
the learner (group rank 0) and each server TP rank (ranks ``1..``) join one process group (NCCL
on GPU, gloo on CPU). Per bucket, the learner posts the bucket's names / dtypes / shapes to
every server (``load_format="flattened_bucket"``) and, while those requests wait, broadcasts
the bucket as one flat uint8 tensor; the servers load it by HF name. Cache flush and the new
``weight_version`` ride on the last bucket only.

    t = BroadcastTransport(engine.clients, "10.0.0.1", 29600, bucket_bytes=512 << 20)
    t.connect(); t.send(hf_named_tensors, weight_version="step-3"); t.close()

A server that dies during a broadcast stalls the collective until ``timeout_s``; the run then
fails loudly (restart the fleet) rather than leave servers on mixed weights.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence

import torch

from gspo_megatron.rollout import sglang_api as api
from gspo_megatron.rollout.types import NamedTensors, WeightSyncStats, WeightTransport
from gspo_megatron.rollout.update_group import (broadcast_from_learner, create_update_group,
                                                destroy_update_group)
from gspo_megatron.weight_sync.buckets import iter_buckets

log = logging.getLogger(__name__)


class BroadcastTransport(WeightTransport):
    """One broadcast group spanning this process (rank 0) and all servers' TP ranks."""

    def __init__(self, clients: Sequence, master_address: str, master_port: int,
                 bucket_bytes: int, backend: Optional[str] = None,
                 server_tp_sizes: Optional[Sequence[int]] = None,
                 group_name: str = api.DEFAULT_GROUP_NAME, timeout_s: float = 600.0) -> None:
        self.clients = list(clients)
        self.master_address = master_address
        self.master_port = int(master_port)
        self.bucket_bytes = bucket_bytes
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if self.backend == "nccl" else torch.device("cpu")
        self.server_tp_sizes = list(server_tp_sizes or [1] * len(self.clients))
        if len(self.server_tp_sizes) != len(self.clients):
            raise ValueError("server_tp_sizes needs one entry per server")
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.group = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)),
                                        thread_name_prefix="weight-sync")

    @property
    def world_size(self) -> int:
        return 1 + sum(self.server_tp_sizes)

    def _on_all_servers(self, call, payloads: List[dict]):
        return [self._pool.submit(call(c), p) for c, p in zip(self.clients, payloads)]

    def connect(self) -> None:
        """Create the group on both sides (the servers' requests return once all joined)."""
        offsets = [1 + sum(self.server_tp_sizes[:i]) for i in range(len(self.clients))]
        payloads = [api.init_group_payload(self.master_address, self.master_port, off,
                                           self.world_size, self.group_name, self.backend)
                    for off in offsets]
        futures = self._on_all_servers(lambda c: c.init_weights_update_group, payloads)
        self.group = create_update_group(self.master_address, self.master_port, 0, self.world_size,
                                         self.group_name, self.backend, self.timeout_s)
        for f in futures:
            f.result(timeout=self.timeout_s)
        log.info("weight broadcast group %s ready: %d servers, world %d (%s)", self.group_name,
                 len(self.clients), self.world_size, self.backend)

    def send(self, named_tensors: NamedTensors, weight_version: Optional[str] = None) -> WeightSyncStats:
        if self.group is None:
            self.connect()
        stats = WeightSyncStats()
        t0 = time.perf_counter()
        buckets = iter_buckets(named_tensors, self.bucket_bytes)
        bucket = next(buckets, None)
        while bucket is not None:
            nxt = next(buckets, None)
            last = nxt is None
            body = api.update_distributed_payload(bucket.names, bucket.dtype_names, bucket.shapes,
                                                  self.group_name, flush_cache=last,
                                                  weight_version=weight_version if last else None)
            flat = bucket.flatten().to(self.device)
            futures = self._on_all_servers(lambda c: c.update_weights_from_distributed,
                                           [body] * len(self.clients))
            broadcast_from_learner(flat, self.group)
            for f in futures:
                f.result(timeout=self.timeout_s)
            stats.num_buckets += 1
            stats.num_tensors += len(bucket.items)
            stats.num_bytes += bucket.num_bytes
            bucket = nxt
        stats.seconds = time.perf_counter() - t0
        return stats

    def close(self) -> None:
        if self.group is not None:
            for c in self.clients:
                try:
                    c.destroy_weights_update_group(self.group_name)
                except Exception as exc:  # a dead server must not block shutdown
                    log.warning("destroying group on %s failed: %s", c.address, exc)
            destroy_update_group(self.group)
            self.group = None
        self._pool.shutdown(wait=False)
