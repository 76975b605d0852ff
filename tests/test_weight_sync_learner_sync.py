"""Weight sync from a pipeline-parallel learner (weight_sync/learner_sync.py) on 2 gloo processes.

Under PP=2 each stage's first rank forms its own broadcast group with a reference server process
(``weight_update_group_pp0`` / ``_pp1``, one after the other) and sends its own stage's buckets;
rank 0 drives the protocol. The server starts from different weights and must end up with the
learner's, bit for bit. The disk transport takes the other road: every bucket to rank 0.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.config.schema import ParallelConfig, WeightSyncConfig
from gspo_megatron.distributed.ports import free_port
from gspo_megatron.rollout.sglang import api
from gspo_megatron.rollout.sglang.launcher import ServerLauncher
from gspo_megatron.rollout.standin.launcher import reference_server_command
from tests.multiproc import run_on_ranks
from tests.test_checkpoint_convert import make_hf_model, reinit_layout


def _sync(rank: int, hf_dir: str, address: str, kind: str, disk_dir: str) -> dict:
    from gspo_megatron.checkpoint.convert import (build_model_chunks, fill_from_hf,
                                                  model_config_for_hf_dir)
    from gspo_megatron.checkpoint.hf_io import HFCheckpointReader
    from gspo_megatron.model.provider import padded_vocab_size
    from gspo_megatron.rollout.sglang.engine import SGLangEngine
    from gspo_megatron.weight_sync.factory import build_stage_transport, build_transport, transport_dst
    from gspo_megatron.weight_sync.learner_sync import LearnerWeightSync

    parallel = ParallelConfig(pp=2)
    reinit_layout(parallel)
    cfg = model_config_for_hf_dir(hf_dir)
    chunks = build_model_chunks(cfg, parallel)
    fill_from_hf(chunks, HFCheckpointReader(hf_dir), cfg,
                 padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, 1), log_every=0)
    sync_cfg = WeightSyncConfig(transport=kind, bucket_bytes=8 * 1024, disk_dir=disk_dir,
                                master_address="127.0.0.1")
    dst = transport_dst(sync_cfg, "reference", "disaggregated")
    engine = transport = None
    if rank == 0:
        engine = SGLangEngine([address], request_timeout_s=120)
        transport = build_transport(sync_cfg, engine, "reference", mode="disaggregated")
    elif dst == "stage":
        transport = build_stage_transport(sync_cfg, 1)
    syncer = LearnerWeightSync(SimpleNamespace(model=chunks, model_cfg=cfg), engine, transport,
                               dst, sync_cfg.bucket_bytes)
    metrics = [syncer("s1"), syncer("s2")]
    weights = {}
    if rank == 0:
        client = engine.clients[0]
        for name in ("model.embed_tokens.weight", "model.layers.0.mlp.experts.2.up_proj.weight",
                     "model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.gate.weight",
                     "lm_head.weight", "model.norm.weight"):
            weights[name] = torch.tensor(client.get_weights_by_name(name, 10 ** 6))
        engine.shutdown()
    elif transport is not None:
        transport.close()
    return {"metrics": metrics, "weights": weights, "group": getattr(transport, "group_name", None)}


def _start_server(tmp_path: Path, hf_dir: Path) -> tuple:
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)  # the server starts from other weights than the learner's
    other.save_pretrained(str(tmp_path / "server_model"))
    for f in hf_dir.glob("tokenizer*"):
        (tmp_path / "server_model" / f.name).write_bytes(f.read_bytes())
    port = free_port()
    launcher = ServerLauncher(str(tmp_path / "logs"), env={"OMP_NUM_THREADS": "1"})
    log = tmp_path / "requests.jsonl"
    launcher.start(reference_server_command(str(tmp_path / "server_model"), port, python=sys.executable,
                                            extra=["--request-log", str(log)]), f"127.0.0.1:{port}")
    return launcher, log


def _original(hf_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir)).state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nccl", "disk"])
def test_pipeline_stages_sync_into_a_server_exactly(tmp_path, kind):
    from gspo_megatron.rollout.sglang.engine import SGLangEngine

    hf_dir = make_hf_model("qwen3_moe", tmp_path / "hf")
    launcher, log = _start_server(tmp_path, hf_dir)
    try:
        SGLangEngine(launcher.addresses, request_timeout_s=60).wait_healthy(180)
        results = run_on_ranks(_sync, world_size=2, hf_dir=str(hf_dir), address=launcher.addresses[0],
                               kind=kind, disk_dir=str(tmp_path / "sync"))
    finally:
        launcher.stop()
    original = _original(hf_dir)
    for name, got in results[0]["weights"].items():
        assert torch.equal(got, original[name].reshape(-1)), name
    m1, m2 = results[0]["metrics"]
    assert m1["weight_sync/num_servers"] == 1.0 and m2["weight_sync/num_skipped_servers"] == 0.0
    total = sum(t.numel() * t.element_size() for t in original.values())
    assert m1["weight_sync/gb"] * 1e9 == pytest.approx(total)  # both stages' bytes, counted once
    assert results[1]["metrics"] == [{}, {}]
    calls = [json.loads(line)["path"] for line in log.read_text().splitlines()]
    if kind == "nccl":  # one group per stage, formed once; both stages sent buckets
        # a random incarnation per trainer process: a server that outlived a killed trainer
        # still holds its groups (weight_sync/distributed_broadcast.py)
        assert re.fullmatch(r"weight_update_group_[0-9a-f]{8}_pp0", results[0]["group"])
        assert re.fullmatch(r"weight_update_group_[0-9a-f]{8}_pp1", results[1]["group"])
        assert calls.count(api.INIT_GROUP) == 2 and calls.count(api.BEGIN_UPDATE) == 2
        assert calls.count(api.UPDATE_FROM_DISTRIBUTED) == 2 * int(m1["weight_sync/num_buckets"])
    else:
        assert calls.count(api.UPDATE_FROM_DISK) == 2 and api.BEGIN_UPDATE not in calls
