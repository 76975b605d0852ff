"""Check 5: the CUDA-IPC weight transport from the learner into the embedded engine on the same GPU.

The engine (its own process, :mod:`gpu_check.ipc_engine`) first has every weight perturbed, so
that before the sync no tensor matches the learner. The project's ``CudaIpcTransport`` then
streams the learner's parameters, gathered into HF names by ``checkpoint.gather``, bucket by
bucket as ``/update_weights_from_tensor`` bodies (``send_bucket``: the engine here has no
pause / session protocol to drive). After the sync every engine weight must equal
the learner's bit for bit: the engine lends its weights back through the same IPC serializer
and the comparison runs on the device, without copies.
"""

from __future__ import annotations

from typing import Dict

import torch

from gspo_megatron.gpu_check.ipc_engine import EngineClient, EngineProcess, deserialize, serialize
from gspo_megatron.gpu_check.report import Outcome
from gspo_megatron.gpu_check.throughput import synchronize


def compare_with_engine(learner, engine: EngineProcess) -> Dict[str, int]:
    """Count learner tensors (HF names) that differ from, or are missing in, the engine."""
    from gspo_megatron.checkpoint.gather import iter_hf_tensors
    from gspo_megatron.checkpoint.learner_hf import unwrapped_chunks

    theirs = dict(deserialize(engine.call("share_weights")))
    counts = {"tensors": 0, "bytes": 0, "differ": 0, "missing": 0}
    seen = set()
    try:
        for name, tensor in iter_hf_tensors(unwrapped_chunks(learner), learner.model_cfg):
            counts["tensors"] += 1
            counts["bytes"] += tensor.numel() * tensor.element_size()
            seen.add(name)
            other = theirs.get(name)
            if other is None:
                counts["missing"] += 1
            elif other.dtype != tensor.dtype or not torch.equal(other.to(tensor.device), tensor):
                counts["differ"] += 1
        counts["engine_only"] = len(set(theirs) - seen)
    finally:
        del theirs
        engine.call("release")
    return counts


def check_weight_sync(learner, engine: EngineProcess, bucket_bytes: int,
                      device: torch.device) -> Outcome:
    """Perturb the engine, sync through CudaIpcTransport, then require exact equality."""
    import time

    from gspo_megatron.checkpoint.gather import iter_hf_buckets
    from gspo_megatron.checkpoint.learner_hf import unwrapped_chunks
    from gspo_megatron.rollout.types import WeightSyncStats
    from gspo_megatron.weight_sync.buckets import Bucket
    from gspo_megatron.weight_sync.tensor_ipc import CudaIpcTransport

    ready = engine.wait_ready()
    engine.call("perturb")
    before = compare_with_engine(learner, engine)
    transport = CudaIpcTransport(None, bucket_bytes, tp_size=1, serialize=serialize,
                                 clients=[EngineClient(engine)])
    synchronize(device)
    stats, t0 = WeightSyncStats(), time.perf_counter()
    for items in iter_hf_buckets(unwrapped_chunks(learner), learner.model_cfg, bucket_bytes):
        bucket = Bucket.from_items(items)
        transport.send_bucket(bucket, "gpu-check")
        stats.add_bucket(len(bucket.items), bucket.num_bytes)
    synchronize(device)
    stats.seconds = time.perf_counter() - t0
    after = compare_with_engine(learner, engine)
    numbers = {"transport": type(transport).__name__, "engine_load_s": ready.get("load_s"),
               "sync_s": stats.seconds, "sync_gb": stats.num_bytes / 1e9,
               "sync_gb_per_s": stats.gb_per_s, "buckets": stats.num_buckets,
               "tensors": stats.num_tensors, "bucket_bytes": bucket_bytes,
               "differ_before": before["differ"], "differ_after": after["differ"],
               "missing_in_engine": after["missing"], "engine_only": after["engine_only"],
               "learner_tensors": after["tensors"]}
    problems = []
    if before["differ"] != before["tensors"]:
        problems.append(f"only {before['differ']}/{before['tensors']} tensors differed before "
                        "the sync: the comparison cannot be trusted")
    if after["differ"] or after["missing"] or after["engine_only"]:
        problems.append(f"after the sync {after['differ']} tensors differ, {after['missing']} "
                        f"are missing in the engine, {after['engine_only']} exist only there")
    if stats.num_bytes != after["bytes"] or stats.num_tensors != after["tensors"]:
        problems.append(f"sent {stats.num_tensors} tensors / {stats.num_bytes} bytes, the learner "
                        f"has {after['tensors']} / {after['bytes']}")
    message = "; ".join(problems) or (
        f"{after['tensors']} tensors, {stats.num_bytes / 1e9:.2f} GB in {stats.seconds:.2f} s "
        f"({stats.gb_per_s:.1f} GB/s, {stats.num_buckets} buckets), all equal after the sync")
    return not problems, message, numbers
