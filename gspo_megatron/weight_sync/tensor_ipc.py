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

On CPU the bytes are copied at most once on this side: the learner's gather receives buckets
into named shared memory (:meth:`CudaIpcTransport.gather_buffers`), and a bucket that is not one
run of it (tensors un-fused on the way, or fed by ``engine.update_weights``) is packed into a
shared staging buffer reused bucket after bucket; before, each bucket was packed into private
memory and moved into new shared memory when pickled (two copies, and fresh pages for both).

Profile (``weight_sync/<key>_s``): ``pack`` (the bucket made one buffer), ``serialize`` (its
handles pickled), ``reply`` (until every server answered: it opened the handle and loaded the
weights).

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

from gspo_megatron.checkpoint.gather import ReusedBuffers
from gspo_megatron.rollout.sglang import api, flat_bucket
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


def _use_named_shared_memory() -> None:
    # file descriptors can only be passed to processes sharing our authkey; named shared
    # memory can be opened by any process on the host (the servers)
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        torch.multiprocessing.set_sharing_strategy("file_system")


def serialize_named_tensors(items: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor), ...]`` as one base64 string of tensor handles (no data copied; a CPU
    tensor not in shared memory yet is moved there first, which copies it)."""
    if any(not t.is_cuda for _, t in items):
        _use_named_shared_memory()
    buf = io.BytesIO()
    _HandlePickler(buf).dump([(str(n), t) for n, t in items])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def shared_buffer(role: str, num_bytes: int, device) -> torch.Tensor:
    """A uint8 buffer in named shared memory (a ``checkpoint.gather.Alloc``): a bucket received
    or packed into it is sent by handle without another copy. Devices other than the CPU get a
    plain buffer (CUDA memory is shared by IPC handles as it is)."""
    if torch.device(device).type != "cpu":
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)
    _use_named_shared_memory()
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(num_bytes))


def _views_of(flat: torch.Tensor, items) -> List[Tuple[str, torch.Tensor]]:
    views, offset = [], 0
    for name, t in items:
        n = t.numel() * t.element_size()
        views.append((name, flat[offset:offset + n].view(t.dtype).view(t.shape)))
        offset += n
    return views


def bucket_views(bucket: Bucket, out: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, List[Tuple[str, torch.Tensor]]]:
    """One contiguous buffer holding the bucket (new, or ``out``), and each tensor as a view
    of it."""
    flat = flat_bucket.flatten([t for _, t in bucket.items], out=out)
    return flat, _views_of(flat, bucket.items)


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
        self._staging = ReusedBuffers(shared_buffer)
        """Shared memory a bucket that is not one already is packed into, bucket after bucket."""
        self._clients: List = list(clients)
        """Objects with ``update_weights_from_tensor(body)``; :meth:`connect` makes them from
        the members' addresses (given here, they serve tools that drive :meth:`send_bucket`)."""

    def connect(self, members: List[str]) -> None:
        self._clients = [SGLangServerClient(a, self.timeout_s, self.timeout_s) for a in members]

    def gather_buffers(self) -> ReusedBuffers:
        """On CPU the learner's gather receives into shared memory: those buckets go by handle
        as they lie (the servers copy them out before they answer)."""
        return ReusedBuffers(shared_buffer)

    def _bucket_views(self, bucket: Bucket):
        """The buffer the servers open and the bucket's tensors as views of it: the bucket
        itself when it is one run of shared memory already, else a copy into this update's
        shared staging buffer (on CPU) or into a new buffer (CUDA: as many as in flight)."""
        run = flat_bucket.contiguous_bytes([t for _, t in bucket.items])
        if run is not None and not run.is_cuda and run.is_shared():
            return run, list(bucket.items)
        if bucket.items[0][1].is_cuda:
            return bucket_views(bucket)
        return bucket_views(bucket, out=self._staging("staging", bucket.num_bytes, "cpu"))

    def send_bucket(self, bucket: Bucket, weight_version: Optional[str] = None) -> None:
        with timed(self.profile, "pack"):
            flat, views = self._bucket_views(bucket)
        with timed(self.profile, "serialize"):
            blobs = [self._serialize(views) for _ in range(self.tp_size)]
        body = api.update_tensor_payload(blobs, weight_version=weight_version)
        with timed(self.profile, "reply"), \
                ThreadPoolExecutor(max_workers=max(1, len(self._clients))) as pool:
            for fut in [pool.submit(c.update_weights_from_tensor, body) for c in self._clients]:
                fut.result()
        del flat  # the servers copied the bucket: its memory may go (or take the next one)

    def finish(self, weight_version: Optional[str]) -> None:
        self._staging.release()  # held for one update only
