"""Shared-disk weight transport (the fallback): safetensors files the engine reloads.

Each bucket becomes one ``model-XXXXX.safetensors`` file in a fresh directory
``<disk_dir>/weights-<random>`` plus a ``model.safetensors.index.json`` (the Hugging Face layout
SGLang's loader reads); ``config_dir``'s JSON files (config, generation config) are copied
too, so the directory is a loadable model. The engine then loads it: the embedded engine
directly, SGLang servers through ``/update_weights_from_disk``. The previous directory this
transport wrote is removed once the new one is loaded.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time
from typing import Dict, Optional, Sequence

from gspo_megatron.rollout import sglang_api as api
from gspo_megatron.rollout.types import NamedTensors, WeightSyncStats, WeightTransport
from gspo_megatron.weight_sync.buckets import iter_buckets


class DiskTransport(WeightTransport):
    """Write buckets as safetensors under ``disk_dir``, then make the engine load them."""

    def __init__(self, disk_dir: str, bucket_bytes: int, engine=None, clients: Sequence = (),
                 config_dir: Optional[str] = None) -> None:
        if not disk_dir:
            raise ValueError("the disk weight transport needs rollout.weight_sync.disk_dir")
        if engine is None and not clients:
            raise ValueError("DiskTransport needs an in-process engine or server clients")
        self.disk_dir = disk_dir
        self.bucket_bytes = bucket_bytes
        self.engine = engine
        self.clients = list(clients)
        self.config_dir = config_dir
        self._previous: Optional[str] = None

    def write(self, named_tensors: NamedTensors, stats: WeightSyncStats) -> str:
        from safetensors.torch import save_file

        os.makedirs(self.disk_dir, exist_ok=True)
        out = tempfile.mkdtemp(prefix="weights-", dir=self.disk_dir)
        weight_map: Dict[str, str] = {}
        for bucket in iter_buckets(named_tensors, self.bucket_bytes):
            fname = f"model-{stats.num_buckets + 1:05d}.safetensors"
            save_file({n: t.detach().contiguous().cpu() for n, t in bucket.items},
                      os.path.join(out, fname))
            weight_map.update({n: fname for n in bucket.names})
            stats.num_buckets += 1
            stats.num_tensors += len(bucket.items)
            stats.num_bytes += bucket.num_bytes
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": stats.num_bytes}, "weight_map": weight_map}, f)
        if self.config_dir:
            for src in glob.glob(os.path.join(self.config_dir, "*.json")):
                if not src.endswith(".index.json"):
                    shutil.copy(src, out)
        return out

    def send(self, named_tensors: NamedTensors, weight_version: Optional[str] = None) -> WeightSyncStats:
        stats = WeightSyncStats()
        t0 = time.perf_counter()
        path = self.write(named_tensors, stats)
        if self.engine is not None:
            self.engine.load_weights_from_disk(path)
        for client in self.clients:
            client.update_weights_from_disk(api.update_disk_payload(path, True, weight_version))
        if self._previous is not None:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path
        stats.seconds = time.perf_counter() - t0
        return stats
