"""Shared-disk weight transport (the fallback): safetensors files the engine reloads.

Each bucket becomes one ``model-XXXXX.safetensors`` file in a fresh directory
``<disk_dir>/weights-<random>``; :meth:`finish` writes ``model.safetensors.index.json`` (the
Hugging Face layout SGLang's loader reads) and copies ``config_dir``'s JSON files (config,
generation config), so the directory is a loadable model, then makes the engine load it: the
embedded engine directly, SGLang servers through ``/update_weights_from_disk`` (which needs no
begin/end session: it runs its own post-load processing). The previous directory this transport
wrote is removed once the new one is loaded. Profile (``weight_sync/<key>_s``): ``write`` (the
files), ``reply`` (until every server loaded the directory).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.client import SGLangServerClient
from gspo_megatron.weight_sync.buckets import Bucket
from gspo_megatron.weight_sync.sync import BucketTransport, timed


class DiskTransport(BucketTransport):
    """Write buckets as safetensors under ``disk_dir``, then make the engine load them."""

    session = False

    def __init__(self, disk_dir: str, bucket_bytes: int, engine=None, servers: bool = False,
                 config_dir: Optional[str] = None, timeout_s: float = 600.0) -> None:
        if not disk_dir:
            raise ValueError("the disk weight transport needs rollout.weight_sync.disk_dir")
        if not servers and not hasattr(engine, "load_weights_from_disk"):
            raise ValueError("DiskTransport needs an in-process engine with load_weights_from_disk "
                             "or servers=True (SGLang / reference servers)")
        super().__init__(engine, bucket_bytes)
        self.disk_dir = disk_dir
        self.servers = servers
        self.checks_server_model = servers
        self.config_dir = config_dir
        self.timeout_s = timeout_s
        self._clients: List[SGLangServerClient] = []
        self._dir: Optional[str] = None
        self._weight_map: Dict[str, str] = {}
        self._total = 0
        self._previous: Optional[str] = None

    def connect(self, members: List[str]) -> None:
        self._clients = [SGLangServerClient(a, self.timeout_s, self.timeout_s) for a in members]

    def send_bucket(self, bucket: Bucket, weight_version: Optional[str] = None) -> None:
        from safetensors.torch import save_file

        if self._dir is None:
            os.makedirs(self.disk_dir, exist_ok=True)
            self._dir = tempfile.mkdtemp(prefix="weights-", dir=self.disk_dir)
            self._weight_map, self._total = {}, 0
        fname = f"model-{len(set(self._weight_map.values())) + 1:05d}.safetensors"
        with timed(self.profile, "write"):
            save_file({n: t.detach().contiguous().cpu() for n, t in bucket.items},
                      os.path.join(self._dir, fname))
        self._weight_map.update({n: fname for n in bucket.names})
        self._total += bucket.num_bytes

    def finish(self, weight_version: Optional[str]) -> None:
        path, self._dir = self._dir, None
        if path is None:
            raise RuntimeError("the disk transport received no bucket to load")
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self._total}, "weight_map": self._weight_map}, f)
        if self.config_dir:
            for src in glob.glob(os.path.join(self.config_dir, "*.json")):
                if not src.endswith(".index.json"):
                    shutil.copy(src, path)
        with timed(self.profile, "reply"):
            if self.servers:
                body = api.update_disk_payload(path, flush_cache=False,
                                               weight_version=weight_version)
                with ThreadPoolExecutor(max_workers=max(1, len(self._clients))) as pool:
                    for fut in [pool.submit(c.update_weights_from_disk, body)
                                for c in self._clients]:
                        fut.result()
            else:
                self.engine.load_weights_from_disk(path)
        if self._previous is not None:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path
