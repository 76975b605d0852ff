"""SGLang's ``flattened_bucket`` wire layout: many tensors as one contiguous uint8 tensor.

Tensor i occupies bytes ``[offset_i, offset_i + numel_i * itemsize_i)`` in list order, with no
padding (SGLang's receiver rejects an offset that is not a multiple of the dtype's size, so
senders keep one dtype per bucket). The receiver is told ``names``, ``dtypes`` (torch attribute
names such as ``"bfloat16"``) and ``shapes`` over HTTP and gets the bytes over the group.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (what SGLang resolves with ``getattr(torch, ...)``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the raw bytes of ``tensors`` -> uint8 [sum of byte sizes]."""
    if not tensors:
        raise ValueError("cannot flatten an empty bucket")
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def byte_size(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def unflatten(flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[str],
              shapes: Sequence[Sequence[int]]) -> List[Tuple[str, torch.Tensor]]:
    """Views into ``flat`` (uint8) for each described tensor; checks sizes and alignment."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"bucket metadata lengths differ: {len(names)} names, {len(dtypes)} "
                         f"dtypes, {len(shapes)} shapes")
    out, offset = [], 0
    for name, dname, shape in zip(names, dtypes, shapes):
        dtype = parse_dtype(dname)
        size = byte_size(dtype, shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            raise ValueError(f"tensor {name!r}: byte offset {offset} not aligned to {dname}")
        if offset + size > flat.numel():
            raise ValueError(f"tensor {name!r} overruns the flat bucket ({flat.numel()} bytes)")
        out.append((name, flat[offset:offset + size].view(dtype).reshape(list(shape))))
        offset += size
    if offset != flat.numel():
        raise ValueError(f"flat bucket has {flat.numel()} bytes, metadata describes {offset}")
    return out


def empty_flat(dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
               device: str = "cpu") -> torch.Tensor:
    """A receive buffer for the described tensors."""
    total = sum(byte_size(parse_dtype(d), s) for d, s in zip(dtypes, shapes))
    return torch.empty(total, dtype=torch.uint8, device=device)
