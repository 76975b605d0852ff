"""In-process weight transport: the learner and an embedded engine share a process.

Each bucket's tensors go to ``engine.load_weights`` (copied into the parameters of the same HF
name); no other copy is made, so values arrive bit-identical. Colocated SGLang servers are fed
through CUDA IPC instead (:mod:`weight_sync.tensor_ipc`).
"""

from __future__ import annotations

from gspo_megatron.weight_sync.buckets import Bucket
from gspo_megatron.weight_sync.sync import BucketTransport


class InProcessTransport(BucketTransport):
    """Bucketed hand-over to ``engine.load_weights`` in this process."""

    def __init__(self, engine, bucket_bytes: int) -> None:
        if not hasattr(engine, "load_weights"):
            raise TypeError(f"{type(engine).__name__} cannot load weights in-process")
        super().__init__(engine, bucket_bytes)

    def send_bucket(self, bucket: Bucket, weight_version=None) -> None:
        self.engine.load_weights(bucket.items)
