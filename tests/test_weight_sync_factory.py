"""Tests of transport selection (weight_sync/factory.py)."""

import pytest

from gspo_megatron.config.schema import WeightSyncConfig
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.tiny_task.model import build_tiny_policy
from gspo_megatron.weight_sync import build_transport, resolve_transport, transport_dst
from gspo_megatron.weight_sync.disk import DiskTransport
from gspo_megatron.weight_sync.distributed_broadcast import BroadcastTransport
from gspo_megatron.weight_sync.factory import build_stage_transport
from gspo_megatron.weight_sync.in_process import InProcessTransport
from gspo_megatron.weight_sync.tensor_ipc import CudaIpcTransport


@pytest.fixture(scope="module")
def embedded():
    return EmbeddedEngine(*build_tiny_policy())


def test_auto_resolution_and_where_buckets_go():
    assert resolve_transport("auto", "embedded", "disaggregated") == "tensor"
    assert resolve_transport("auto", "sglang", "colocated") == "tensor"
    assert resolve_transport("auto", "reference", "disaggregated") == "nccl"
    assert resolve_transport("disk", "sglang", "colocated") == "disk"
    assert transport_dst(WeightSyncConfig(), "sglang", "disaggregated") == "stage"
    assert transport_dst(WeightSyncConfig(), "sglang", "colocated") == "rank0"
    assert transport_dst(WeightSyncConfig(transport="disk"), "sglang", "disaggregated") == "rank0"


def test_builds_each_transport_and_attaches(embedded, tmp_path):
    t = build_transport(WeightSyncConfig(), embedded, "embedded")
    assert isinstance(t, InProcessTransport) and embedded._transport is t and t.dst == "rank0"
    disk = build_transport(WeightSyncConfig(transport="disk", disk_dir=str(tmp_path)), embedded,
                           "embedded")
    assert isinstance(disk, DiskTransport) and not disk.servers and not disk.session
    remote = SGLangEngine(["127.0.0.1:1", "127.0.0.1:2"])
    ipc = build_transport(WeightSyncConfig(transport="tensor"), remote, "sglang", server_tp_size=4)
    assert isinstance(ipc, CudaIpcTransport) and ipc.tp_size == 4 and remote._transport is ipc
    bc = build_transport(WeightSyncConfig(transport="nccl"), remote, "sglang", mode="disaggregated",
                         server_tp_size=2, master_port=29999, attach=False)
    assert isinstance(bc, BroadcastTransport) and bc.dst == "stage" and bc.session
    assert bc.server_tp_size == 2 and bc._first_port == 29999 and remote._transport is ipc
    main_cfg = WeightSyncConfig(transport="nccl", master_port=29999, master_address="10.1.2.3")
    main = build_transport(main_cfg, remote, "sglang", mode="disaggregated", attach=False)
    assert (main.master_address, main._first_port) == ("10.1.2.3", 29999)
    stage = build_stage_transport(main_cfg, 4)  # another stage's first rank, on another host
    assert stage._first_port is None and stage.master_address is None


def test_clear_errors(embedded):
    with pytest.raises(ValueError, match="embedded engine uses"):
        build_transport(WeightSyncConfig(transport="nccl"), embedded, "embedded")
    with pytest.raises(ValueError, match="disk_dir"):
        build_transport(WeightSyncConfig(transport="disk"), embedded, "embedded")
    with pytest.raises(ValueError, match="not one of"):
        build_transport(WeightSyncConfig(transport="carrier-pigeon"), embedded, "embedded")
    with pytest.raises(ValueError, match="bucket_bytes"):
        build_transport(WeightSyncConfig(bucket_bytes=0), embedded, "embedded")
