"""Tests of transport selection (weight_sync/factory.py)."""

import pytest

from gspo_megatron.config.schema import WeightSyncConfig
from gspo_megatron.rollout.embedded import EmbeddedEngine
from gspo_megatron.rollout.sglang_engine import SGLangEngine
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.weight_sync import build_transport, resolve_transport
from gspo_megatron.weight_sync.disk import DiskTransport
from gspo_megatron.weight_sync.distributed_broadcast import BroadcastTransport
from gspo_megatron.weight_sync.in_process import CudaIpcTransport, InProcessTransport


@pytest.fixture(scope="module")
def embedded():
    return EmbeddedEngine(*build_tiny_policy())


def test_auto_resolution(embedded):
    remote = SGLangEngine(["127.0.0.1:1"])
    assert resolve_transport("auto", embedded, "disaggregated") == "tensor"
    assert resolve_transport("auto", remote, "colocated") == "tensor"
    assert resolve_transport("auto", remote, "disaggregated") == "nccl"
    assert resolve_transport("disk", remote, "colocated") == "disk"


def test_builds_each_transport_and_attaches(embedded, tmp_path):
    t = build_transport(WeightSyncConfig(), embedded)
    assert isinstance(t, InProcessTransport) and embedded._transport is t
    assert isinstance(build_transport(WeightSyncConfig(transport="disk", disk_dir=str(tmp_path)),
                                      embedded), DiskTransport)
    remote = SGLangEngine(["127.0.0.1:1", "127.0.0.1:2"])
    ipc = build_transport(WeightSyncConfig(transport="tensor"), remote, server_tp_size=4)
    assert isinstance(ipc, CudaIpcTransport) and ipc.tp_size == 4 and len(ipc.clients) == 2
    bc = build_transport(WeightSyncConfig(transport="nccl"), remote, mode="disaggregated",
                         server_tp_size=2, master_port=29999, attach=False)
    assert isinstance(bc, BroadcastTransport) and bc.world_size == 5 and remote._transport is ipc
    bc.close()


def test_clear_errors(embedded):
    with pytest.raises(ValueError, match="embedded engine uses"):
        build_transport(WeightSyncConfig(transport="nccl"), embedded)
    with pytest.raises(ValueError, match="master_port"):
        build_transport(WeightSyncConfig(transport="nccl"), SGLangEngine(["127.0.0.1:1"]))
    with pytest.raises(ValueError, match="disk_dir"):
        build_transport(WeightSyncConfig(transport="disk"), embedded)
    with pytest.raises(ValueError, match="not one of"):
        build_transport(WeightSyncConfig(transport="carrier-pigeon"), embedded)
