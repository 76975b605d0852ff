"""Learner -> rollout engine weight sync: size-bounded buckets and one module per transport.

The only package that knows both sides: it takes the learner's ``(hf_name, tensor)`` stream
(gathered from Megatron elsewhere) and moves it into a rollout engine — in-process /
CUDA IPC (``in_process``), a broadcast group (``distributed_broadcast``) or safetensors on a
shared disk (``disk``). ``build_transport`` picks one from ``rollout.weight_sync``.
"""

from gspo_megatron.weight_sync.buckets import Bucket, iter_buckets
from gspo_megatron.weight_sync.factory import build_transport, resolve_transport

__all__ = ["Bucket", "iter_buckets", "build_transport", "resolve_transport"]
