"""Pick and build the weight transport for an engine from ``rollout.weight_sync``.

=========================  =======================  ==========================================
``rollout.engine``         ``transport``            built
=========================  =======================  ==========================================
embedded                   ``auto`` / ``tensor``    :class:`InProcessTransport`
embedded                   ``disk``                 :class:`DiskTransport` (engine loads files)
sglang / reference         ``auto`` disaggregated,  :class:`BroadcastTransport` (NCCL on GPU,
                           ``nccl``                 gloo on CPU; one group per pipeline stage)
sglang / reference         ``auto`` colocated,      :class:`CudaIpcTransport` (CUDA IPC on GPU,
                           ``tensor``               shared memory on CPU)
sglang / reference         ``disk``                 :class:`DiskTransport` (update_from_disk)
=========================  =======================  ==========================================

On the main rank the transport is attached to the engine (``engine.update_weights`` runs the
whole protocol); on the other ranks of a learner, :func:`build_stage_transport` gives the
broadcast sender of a pipeline stage's first rank (every other transport is fed from rank 0).
"""

from __future__ import annotations

from typing import Optional

from gspo_megatron.weight_sync.disk import DiskTransport
from gspo_megatron.weight_sync.distributed_broadcast import BroadcastTransport
from gspo_megatron.weight_sync.in_process import InProcessTransport
from gspo_megatron.weight_sync.sync import BucketTransport
from gspo_megatron.weight_sync.tensor_ipc import CudaIpcTransport

SERVER_ENGINES = ("sglang", "reference")


def resolve_transport(transport: str, engine_kind: str, mode: str) -> str:
    """``auto`` -> ``tensor`` for the embedded engine and colocated servers, else ``nccl``."""
    if transport not in ("auto", "nccl", "tensor", "disk"):
        raise ValueError(f"rollout.weight_sync.transport={transport!r} is not one of "
                         "auto, nccl, tensor, disk")
    if transport != "auto":
        return transport
    return "tensor" if engine_kind == "embedded" or mode == "colocated" else "nccl"


def transport_dst(sync_cfg, engine_kind: str, mode: str) -> str:
    """Where the learner's gather must deliver buckets for this transport (every rank knows)."""
    return "stage" if resolve_transport(sync_cfg.transport, engine_kind, mode) == "nccl" else "rank0"


def build_transport(sync_cfg, engine, engine_kind: str, mode: str = "colocated",
                    server_tp_size: int = 1, master_address: Optional[str] = None,
                    master_port: Optional[int] = None, config_dir: Optional[str] = None,
                    attach: bool = True, record_dir: Optional[str] = None) -> BucketTransport:
    """The transport named by ``sync_cfg`` (a ``WeightSyncConfig``) into ``engine``;
    ``record_dir``: where a broadcast group's name is recorded (the run directory)."""
    kind = resolve_transport(sync_cfg.transport, engine_kind, mode)
    servers = engine_kind in SERVER_ENGINES
    if kind == "tensor":
        transport = (CudaIpcTransport(engine, sync_cfg.bucket_bytes, server_tp_size) if servers
                     else InProcessTransport(engine, sync_cfg.bucket_bytes))
    elif kind == "disk":
        transport = DiskTransport(sync_cfg.disk_dir, sync_cfg.bucket_bytes, engine=engine,
                                  servers=servers, config_dir=config_dir)
    else:
        if not servers:
            raise ValueError("rollout.weight_sync.transport=nccl needs server engines "
                             "(sglang/reference); the embedded engine uses 'tensor' or 'disk'")
        transport = build_stage_transport(sync_cfg, server_tp_size,
                                          master_address or sync_cfg.master_address,
                                          master_port or sync_cfg.master_port, record_dir)
        transport.engine = engine
    if attach:
        engine.attach_weight_transport(transport)
    return transport


def build_stage_transport(sync_cfg, server_tp_size: int = 1, master_address: Optional[str] = None,
                          master_port: Optional[int] = None,
                          record_dir: Optional[str] = None) -> BroadcastTransport:
    """The broadcast sender of one pipeline stage. Its group rendezvous at ``master_address``
    (None: this host's address on the route to the servers) on ``master_port`` (None: a free
    port). ``weight_sync.master_address`` / ``master_port`` name rank 0's host and port, so only
    :func:`build_transport` (the main rank) passes them. ``record_dir``: where the group's name
    is kept for the run's next trainer (``distributed_broadcast.py``)."""
    return BroadcastTransport(sync_cfg.bucket_bytes, server_tp_size,
                              master_address=master_address, master_port=master_port,
                              record_dir=record_dir)
