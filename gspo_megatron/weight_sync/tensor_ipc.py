"""Tensor-handle weight transport (colocated SGLang servers): ``/update_weights_from_tensor``.

Per bucket, the bucket is flattened into one buffer on the learner's device and its tensors are
sent as views of it, pickled the way SGLang's ``MultiprocessingSerializer.deserialize`` reads
them (sglang 0.5.23 ``srt/utils/common.py``: a ``ForkingPickler`` stream, base64, opened by a
``SafeUnpickler`` whose allow-list holds torch's multiprocessing rebuild functions). Torch's
reductions turn a CUDA tensor into an IPC handle of its *storage*, so a server opens the bucket's
memory once, not once per tensor. Details that follow SGLang:

- one blob per server TP rank: each rank deserialises only its own (tp_worker.deserialize_own_rank;
  another rank's copy would break the producer's IPC reference counting);
- the device is sent as its UUID, not its index (srt/utils/patch_torch.py maps a UUID to the
  server's own index, which differs from the learner's under other CUDA_VISIBLE_DEVICES);
- the learner keeps the bucket alive until every server answered (the call is synchronous).

Profile (``weight_sync/<key>_s``): ``pack`` (the bucket made one buffer), ``serialize`` (its
handles pickled; on CPU the buffer is moved into shared memory here), ``reply`` (until every
server answered: it opened the handle and loaded the weights).

This module does not import sglang (the learner's environment does not need it). On CPU the same
pickling shares the bucket through POSIX shared memory (torch's ``file_system`` strategy), which
the reference server opens: the colocated protocol runs end to end in the CPU tests.
"""

from __future__ import annotations

import base64
import io
import logging
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing
import torch.multiprocessing.reductions as reductions

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import SGLangServerClient
from gspo_megatron.weight_sync.buckets import Bucket
from gspo_megatron.weight_sync.sync import BucketTransport, timed

log = logging.getLogger(__name__)

_DEVICE_ARG = 6
"""Index of the device in the rebuild args of a CUDA tensor (patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX)."""


def _reduce_tensor(tensor: torch.Tensor):
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])
    return rebuild, args


class _HandlePickler(ForkingPickler):
    """ForkingPickler with torch's tensor reduction, devices named by UUID."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.Tensor] = _reduce_tensor
        self.dispatch_table[torch.nn.Parameter] = _reduce_tensor


def serialize_named_tensors(items: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor), ...]`` as one base64 string of tensor handles (no data copied)."""
    if any(not t.is_cuda for _, t in items) and \
            torch.multiprocessing.get_sharing_strategy() != "file_system":
        # file descriptors can only be passed to processes sharing our authkey; named shared
        # memory can be opened by any process on the host (the reference server)
        torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    _HandlePickler(buf).dump([(str(n), t) for n, t in items])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def bucket_views(bucket: Bucket) -> Tuple[torch.Tensor, List[Tuple[str, torch.Tensor]]]:
    """One contiguous buffer holding the bucket, and each tensor as a view of it."""
    flat = bucket.flatten()
    views, offset = [], 0
    for name, t in bucket.items:
        n = t.numel() * t.element_size()
        views.append((name, flat[offset:offset + n].view(t.dtype).view(t.shape)))
        offset += n
    return flat, views


class CudaIpcTransport(BucketTransport):
    """``/update_weights_from_tensor`` with tensor handles, bucket by bucket, to every member."""

    checks_server_model = True

    def __init__(self, engine, bucket_bytes: int, tp_size: int = 1,
                 serialize: Optional[Callable[[Sequence[Tuple[str, torch.Tensor]]], str]] = None,
                 timeout_s: float = 600.0, clients: Sequence = ()) -> None:
        super().__init__(engine, bucket_bytes)
        if tp_size < 1:
            raise ValueError(f"server TP size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self._serialize = serialize or serialize_named_tensors
        self._clients: List = list(clients)
        """Objects with ``update_weights_from_tensor(body)``; :meth:`connect` makes them from
        the members' addresses (given here, they serve tools that drive :meth:`send_bucket`)."""

    def connect(self, members: List[str]) -> None:
        self._clients = [SGLangServerClient(a, self.timeout_s, self.timeout_s) for a in members]

    def send_bucket(self, bucket: Bucket, weight_version: Optional[str] = None) -> None:
        with timed(self.profile, "pack"):
            flat, views = bucket_views(bucket)
        with timed(self.profile, "serialize"):
            blobs = [self._serialize(views) for _ in range(self.tp_size)]
        body = api.update_tensor_payload(blobs, weight_version=weight_version)
        with timed(self.profile, "reply"), \
                ThreadPoolExecutor(max_workers=max(1, len(self._clients))) as pool:
            for fut in [pool.submit(c.update_weights_from_tensor, body) for c in self._clients]:
                fut.result()
        del flat  # the servers copied the bucket: its memory may go
