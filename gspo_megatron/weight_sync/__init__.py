"""Learner -> rollout engine weight sync: the one bucket loop, and one module per transport.

The only package that knows both sides: it takes the learner's HF-named buckets
(checkpoint/gather.py) and moves them into a rollout engine, inside the engine's update protocol
(``sync.run_update``: pause, abort, begin, buckets, end, flush, continue). Transports: in-process
(``in_process``), tensor handles for colocated servers (``tensor_ipc``), a broadcast group per
pipeline stage (``distributed_broadcast``), safetensors on a shared disk (``disk``).
``build_transport`` picks one from ``rollout.weight_sync``; ``learner_sync.LearnerWeightSync``
runs an update from every rank of a Megatron learner.
"""

from gspo_megatron.weight_sync.buckets import Bucket, iter_buckets
from gspo_megatron.weight_sync.factory import build_transport, resolve_transport, transport_dst
from gspo_megatron.weight_sync.sync import BucketTransport, run_update

__all__ = ["Bucket", "BucketTransport", "build_transport", "iter_buckets", "resolve_transport",
           "run_update", "transport_dst"]
