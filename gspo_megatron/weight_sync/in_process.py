"""In-process weight transports (colocated mode): the learner and the engine share a process.

- :class:`InProcessTransport`: hands each bucket's tensors to an engine object that has
  ``load_weights(named_tensors)`` (the embedded engine); no copies besides the final
  parameter copy, so values arrive bit-identical.
- :class:`CudaIpcTransport`: colocated SGLang servers on the same GPUs. Each bucket is sent to
  ``/update_weights_from_tensor`` as CUDA IPC handles (SGLang's ``MultiprocessingSerializer``,
  base64, one copy per server TP rank); only metadata crosses HTTP. GPU only: the serializer is
  imported lazily from sglang, or injected (tests check the request it produces).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from gspo_megatron.rollout.types import NamedTensors, WeightSyncStats, WeightTransport
from gspo_megatron.weight_sync.buckets import iter_buckets


class InProcessTransport(WeightTransport):
    """Bucketed hand-over to ``engine.load_weights`` in this process."""

    def __init__(self, engine, bucket_bytes: int) -> None:
        if not hasattr(engine, "load_weights"):
            raise TypeError(f"{type(engine).__name__} cannot load weights in-process")
        self.engine = engine
        self.bucket_bytes = bucket_bytes

    def send(self, named_tensors: NamedTensors, weight_version: Optional[str] = None) -> WeightSyncStats:
        stats = WeightSyncStats()
        t0 = time.perf_counter()
        for bucket in iter_buckets(named_tensors, self.bucket_bytes):
            self.engine.load_weights(bucket.items)
            stats.num_buckets += 1
            stats.num_tensors += len(bucket.items)
            stats.num_bytes += bucket.num_bytes
        stats.seconds = time.perf_counter() - t0
        return stats


def _sglang_serializer() -> Callable[[object], str]:
    from sglang.srt.utils import MultiprocessingSerializer  # GPU environments only

    return lambda obj: MultiprocessingSerializer.serialize(obj, output_str=True)


class CudaIpcTransport(WeightTransport):
    """``/update_weights_from_tensor`` with CUDA IPC handles, bucket by bucket."""

    def __init__(self, clients: Sequence, bucket_bytes: int, tp_size: int = 1,
                 serialize: Optional[Callable[[object], str]] = None) -> None:
        self.clients = list(clients)
        self.bucket_bytes = bucket_bytes
        self.tp_size = tp_size
        self._serialize = serialize

    def payload(self, items, flush_cache: bool, weight_version: Optional[str]) -> dict:
        serialize = self._serialize or _sglang_serializer()
        blob = serialize(list(items))
        body = {"serialized_named_tensors": [blob] * self.tp_size, "load_format": None,
                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return body

    def send(self, named_tensors: NamedTensors, weight_version: Optional[str] = None) -> WeightSyncStats:
        stats = WeightSyncStats()
        t0 = time.perf_counter()
        buckets = iter_buckets(named_tensors, self.bucket_bytes)
        bucket = next(buckets, None)
        while bucket is not None:
            nxt = next(buckets, None)
            body = self.payload(bucket.items, flush_cache=nxt is None,
                                weight_version=weight_version if nxt is None else None)
            for client in self.clients:
                client.update_weights_from_tensor(body)
            stats.num_buckets += 1
            stats.num_tensors += len(bucket.items)
            stats.num_bytes += bucket.num_bytes
            bucket = nxt
        stats.seconds = time.perf_counter() - t0
        return stats

