"""Peak bytes of live tensor storages on CPU, the way a GPU allocator's peak would count them.

Neither ``tracemalloc`` (it does not see torch's allocator) nor RSS (it counts only touched
pages, keeps freed heap pages, and includes every library's memory) measures what the planner
estimates: the bytes of tensors alive at once. :class:`LiveTensorBytes` is a
``TorchDispatchMode``: every aten op that runs while it is active passes through it, and every
storage an op returns (factories, outputs, autograd's saved tensors and gradients -- all are op
outputs) is recorded with a weak reference and its size. A storage counts from the op that
creates it until it is freed; views share their base's storage and count once.

The peak is exact without scanning on every op: the running sum never undercounts (freed
storages leave it only when pruned), so a new peak is only possible when the sum exceeds the
old peak, and only then are dead storages pruned and the sum recomputed.

Limits: memory a kernel allocates and frees inside one op (its workspace) is not seen, nor
non-tensor buffers (gloo's). Tensors created before the mode was entered are not counted: enter
it before building the model.

    with LiveTensorBytes() as probe:
        model = build(); train_step(model)
    print(probe.peak_bytes)
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_RESIZE_OPS = {torch.ops.aten.resize_.default, torch.ops.aten.set_.source_Storage,
               torch.ops.aten.set_.source_Storage_storage_offset,
               torch.ops.aten.set_.source_Tensor}


class LiveTensorBytes(TorchDispatchMode):
    """Tracks the current and peak bytes of tensor storages created while active."""

    def __init__(self) -> None:
        super().__init__()
        self._live: Dict[int, Tuple[StorageWeakRef, int]] = {}
        self._sum = 0  # >= live bytes: may still include freed storages
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _RESIZE_OPS and isinstance(args[0], torch.Tensor):
            self._track(args[0], refresh=True)
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        return out

    def _track(self, tensor: torch.Tensor, refresh: bool = False) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        known = self._live.get(key)
        if known is not None and not known[0].expired() and not refresh:
            return
        if known is not None:  # freed and its address reused, or resized in place
            self._sum -= known[1]
        nbytes = storage.nbytes()
        self._live[key] = (StorageWeakRef(storage), nbytes)
        self._sum += nbytes
        if self._sum > self.peak_bytes:
            self._prune()
            self.peak_bytes = max(self.peak_bytes, self._sum)

    def _prune(self) -> None:
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        self._sum = sum(n for _, n in self._live.values())

    @property
    def live_bytes(self) -> int:
        """Bytes of storages alive now."""
        self._prune()
        return self._sum

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes = self.live_bytes
