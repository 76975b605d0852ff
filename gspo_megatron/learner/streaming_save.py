"""dist_checkpointing's save, written in this process one tensor at a time.

megatron-core 0.16.1's ``torch_dist`` save (``strategies/filesystem_async.py``,
``FileSystemWriterAsync``) prepares every tensor before writing any: it clones each one that
is a view of a larger storage (``_clone_if_needed``: the gate and up halves of every fused
SwiGLU ``linear_fc1``, i.e. two thirds of the expert weights), copies GPU tensors to host, and
then forks one writer process per file. A rank's whole share of the model is thereby held
twice (the views' clones, or the host copies of GPU tensors), and every forked writer maps the
parent's heap (its copy-on-write pages count in its RSS as well).

:class:`StreamingSaveStrategy` is Megatron's own strategy with one part replaced: its
:class:`StreamingFileSystemWriter` keeps references instead of copies and writes the files here,
one after the other, through Megatron's own per-file writer
(``FileSystemWriterAsync.write_preloaded_data``), handing it each tensor when it is written:
moved to host or cloned (if it is a view) at that moment and dropped after. The files, their
names and the ``.metadata`` are the same as Megatron's; host memory beyond the model is one
tensor.

    dist_checkpointing.save(state, directory, sharded_strategy=StreamingSaveStrategy())
"""

from __future__ import annotations

import os
import queue
from typing import Iterator, List, Tuple

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from gspo_megatron.distributed.host_heap import resident_bytes


def _one_at_a_time(tensor_data: List[Tuple[object, torch.Tensor]], on_tensor=None
                   ) -> Iterator[Tuple[object, torch.Tensor]]:
    """Each ``(item, tensor)`` as a host tensor that owns exactly its storage, made when asked
    (``on_tensor()`` is called while it exists: the writer's memory high-water mark)."""
    for item, tensor in tensor_data:
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        elif tensor.untyped_storage().nbytes() != tensor.numel() * tensor.itemsize:
            tensor = tensor.clone()  # torch.save writes a view's whole storage
        if on_tensor is not None:
            on_tensor()
        yield item, tensor


class StreamingFileSystemWriter(filesystem_async.FileSystemWriterAsync):
    """``FileSystemWriterAsync`` without up-front copies and without writer processes. It
    keeps the highest resident set it saw while a tensor was in hand (:attr:`peak_rss_bytes`),
    the save's host-memory metric."""

    peak_rss_bytes = 0

    def _note_rss(self) -> None:
        self.peak_rss_bytes = max(self.peak_rss_bytes, resident_bytes())

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """The parent's file plan (same buckets, same file names), holding references."""
        bins = self.thread_count // 2 if self.separation_hint is not None else self.thread_count
        buckets = filesystem_async._split_by_separation_hint(
            filesystem_async._split_by_size_and_type(bins, plan.items), self.separation_hint)
        self.write_buckets = []
        for group, group_buckets in buckets.items():
            for bucket in group_buckets:
                bytes_data = [(i, planner.resolve_data(i)) for i in bucket
                              if i.type == WriteItemType.BYTE_IO]
                tensor_data = [(i, planner.resolve_data(i)) for i in bucket
                               if i.type != WriteItemType.BYTE_IO]
                if bytes_data or tensor_data:
                    name = (f"{group}{plan.storage_data.prefix}{len(self.write_buckets)}"
                            f"{DEFAULT_SUFFIX}")
                    self.write_buckets.append((os.path.join(self.checkpoint_dir, name), name,
                                               (bytes_data, tensor_data)))
        self.results_queue = queue.Queue() if self.write_buckets else None

    def get_save_function_and_args(self):
        if not self.write_buckets:
            return None, None, []
        return self._write_files, None, []

    def _write_files(self) -> None:
        """Every file in turn; the results (or the first failure) go to ``results_queue``, where
        the parent's ``retrieve_write_results`` reads them."""
        transforms = [self.transforms] if hasattr(self, "transforms") else []
        results = {}
        for index, (path, key, (bytes_data, tensor_data)) in enumerate(self.write_buckets):
            out, pending = queue.Queue(), queue.Queue()
            pending.put(index)  # the per-file writer marks its task done on this queue
            filesystem_async.FileSystemWriterAsync.write_preloaded_data(
                transforms, index,
                (path, key, (bytes_data, _one_at_a_time(tensor_data, self._note_rss))), out,
                pending, True, use_msc=self.use_msc)
            _, written = out.get()
            if isinstance(written, Exception):
                self.results_queue.put(written)
                return
            results[index] = written
        self.results_queue.put(results)


class StreamingSaveStrategy(torch_strategy.TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` save strategy (same format), writing through
    :class:`StreamingFileSystemWriter`."""

    def __init__(self, cached_metadata: bool = False) -> None:
        super().__init__("torch_dist", 1, cached_metadata=cached_metadata)

    def async_save(self, sharded_state_dict, checkpoint_dir):
        # The parent builds its writer from this module-level name; swap it for this call only.
        original = torch_strategy.FileSystemWriterAsync
        torch_strategy.FileSystemWriterAsync = StreamingFileSystemWriter
        try:
            return super().async_save(sharded_state_dict, checkpoint_dir)
        finally:
            torch_strategy.FileSystemWriterAsync = original
