"""Open the tensor handles of ``/update_weights_from_tensor`` the way SGLang 0.5.23 does, no looser.

SGLang decodes each blob with base64 then ``SafeUnpickler`` (``srt/utils/common.py``), which
resolves only the globals of an allow-list and raises ``RuntimeError("Blocked unsafe global
(module.name) during pickle deserialization")`` for any other. This unpickler allows a *subset*
of that list (``tests/test_rollout_sglang_conformance.py`` checks the subset against the list
extracted from the wheel): the Python containers, torch dtypes / sizes / devices, storages, and
torch's multiprocessing rebuild functions for CPU (shared memory) and CUDA (IPC) tensors. A CUDA
handle naming its device by UUID (as SGLang's patched reductions do) is mapped to this process's
device index, as ``srt/utils/patch_torch.py`` does.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any, FrozenSet, Tuple

import torch
import torch.multiprocessing.reductions as reductions

_DTYPES = ("bfloat16", "bool", "float", "float16", "float32", "float64", "half", "int16", "int32",
           "int64", "int8", "long", "uint8", "double", "int", "short")
ALLOWED_GLOBALS: FrozenSet[Tuple[str, str]] = frozenset({
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "str"), ("builtins", "int"),
    ("builtins", "dict"), ("builtins", "bytes"), ("collections", "OrderedDict"),
    ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"), ("torch", "Size"), ("torch", "device"),
    ("torch", "dtype"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch", "UntypedStorage"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("multiprocessing.resource_sharer", "DupFd"),
    *(("torch", d) for d in _DTYPES)})


def _device_from_uuid(device: Any) -> int:
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    raise RuntimeError(f"Invalid device_uuid={device}")


def _rebuild_cuda_tensor(*args):
    args = (*args[:6], _device_from_uuid(args[6]), *args[7:])
    return reductions.rebuild_cuda_tensor(*args)


class HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        return super().find_class(module, name)


def load_named_tensors(blob: str):
    """``[(name, tensor), ...]`` from one base64 blob of ``serialized_named_tensors``."""
    try:
        data = base64.b64decode(blob, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"serialized_named_tensors entry is not base64: {exc}") from exc
    items = HandleUnpickler(io.BytesIO(data)).load()
    if not isinstance(items, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in items):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return items
