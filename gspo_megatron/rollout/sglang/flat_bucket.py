"""SGLang's ``flattened_bucket`` wire layout: many tensors as one contiguous uint8 tensor.

Tensor i occupies bytes ``[offset_i, offset_i + numel_i * itemsize_i)`` in list order, with no
padding (SGLang's receiver rejects an offset that is not a multiple of the dtype's size, so
senders keep one dtype per bucket). The receiver is told ``names``, ``dtypes`` (torch attribute
names such as ``"bfloat16"``) and ``shapes`` over HTTP and gets the bytes over the group.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (what SGLang resolves with ``getattr(torch, ...)``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def flatten(tensors: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenate the raw bytes of ``tensors`` -> a new uint8 [sum of byte sizes], or into
    ``out`` (uint8, exactly that many bytes)."""
    if not tensors:
        raise ValueError("cannot flatten an empty bucket")
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


def contiguous_bytes(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The bytes of ``tensors`` as one uint8 *view* (no copy) when they already lie back to
    back, in order, in one storage, as the learner's gather leaves most buckets (experts
    received rank after rank, an embedding whose padding rows were cut off the end); else None.
    The view aliases their memory: only for a reader that is done before they change."""
    if not tensors or any(not t.is_contiguous() or t.numel() == 0 for t in tensors):
        return None
    first = tensors[0]
    base = first.untyped_storage().data_ptr()
    start = first.storage_offset() * first.element_size()
    end = start
    for t in tensors:
        if (t.untyped_storage().data_ptr() != base or t.device != first.device
                or t.storage_offset() * t.element_size() != end):
            return None
        end += t.numel() * t.element_size()
    flat = first.detach().reshape(-1).view(torch.uint8)
    return flat.as_strided((end - start,), (1,), start)


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
