"""Group a stream of ``(hf_name, tensor)`` pairs into size-bounded buckets.

Every transport sends bucket by bucket, so peak extra memory is one bucket, not one model
(gathering a 61 GB model on one host is what makes naive syncs OOM or crawl). A bucket holds
tensors of one dtype (so SGLang's ``flattened_bucket`` layout stays aligned) and at most
``bucket_bytes`` bytes; a single tensor larger than the limit travels alone in its own bucket
(flagged ``oversized``; the limit cannot be honoured without splitting a parameter, which no
receiver can load). Order is preserved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator, List, Tuple

import torch

from gspo_megatron.rollout.sglang import flat_bucket
from gspo_megatron.rollout.types import NamedTensors

log = logging.getLogger(__name__)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Bucket:
    """Tensors sent together; ``num_bytes`` is the sum of their byte sizes."""

    items: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    num_bytes: int = 0
    oversized: bool = False
    """A single tensor larger than the limit (the only way a bucket exceeds it)."""

    @property
    def names(self) -> List[str]:
        return [n for n, _ in self.items]

    @property
    def dtype_names(self) -> List[str]:
        return [flat_bucket.dtype_name(t.dtype) for _, t in self.items]

    @property
    def shapes(self) -> List[List[int]]:
        return [list(t.shape) for _, t in self.items]

    @classmethod
    def from_items(cls, items: List[Tuple[str, torch.Tensor]]) -> "Bucket":
        """A bucket of already-grouped pairs (the learner's gather buckets them itself)."""
        return cls(list(items), sum(tensor_bytes(t) for _, t in items))

    def flatten(self) -> torch.Tensor:
        """The bucket as one new uint8 tensor in SGLang's ``flattened_bucket`` layout."""
        return flat_bucket.flatten([t for _, t in self.items])

    def wire_bytes(self) -> torch.Tensor:
        """The same bytes for a reader that is done before the bucket changes (a broadcast):
        a view of the tensors' own memory when they lie back to back already (the learner's
        gather leaves most buckets so), else a copy (:meth:`flatten`)."""
        view = flat_bucket.contiguous_bytes([t for _, t in self.items])
        return self.flatten() if view is None else view


def iter_buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[Bucket]:
    """Yield buckets of at most ``bucket_bytes`` bytes (see module docstring), in stream order."""
    if bucket_bytes <= 0:
        raise ValueError(f"weight_sync.bucket_bytes must be > 0, got {bucket_bytes}")
    current = Bucket()
    seen = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice in one weight-update stream")
        seen.add(name)
        size = tensor_bytes(tensor)
        if current.items and (current.num_bytes + size > bucket_bytes
                              or current.items[0][1].dtype != tensor.dtype):
            yield current
            current = Bucket()
        if size > bucket_bytes:
            log.warning("weight %s (%d bytes) exceeds bucket_bytes=%d; sending it alone",
                        name, size, bucket_bytes)
            yield Bucket([(name, tensor)], size, oversized=True)
            continue
        current.items.append((name, tensor))
        current.num_bytes += size
    if current.items:
        yield current
