"""Pick and build the weight transport for an engine from ``rollout.weight_sync``.

=========================  =======================  ==========================================
engine                     ``transport``            built
=========================  =======================  ==========================================
embedded                   ``auto`` / ``tensor``    :class:`InProcessTransport`
embedded                   ``disk``                 :class:`DiskTransport` (engine loads files)
sglang / reference         ``auto`` disaggregated,  :class:`BroadcastTransport` (NCCL on GPU,
                           ``nccl``                 gloo on CPU)
sglang                     ``auto`` colocated,      :class:`CudaIpcTransport`
                           ``tensor``
sglang / reference         ``disk``                 :class:`DiskTransport` (update_from_disk)
=========================  =======================  ==========================================

The transport is attached to the engine, so the trainer only calls
``engine.update_weights(hf_named_tensors)``.
"""

from __future__ import annotations

from typing import Optional

from gspo_megatron.rollout.embedded import EmbeddedEngine
from gspo_megatron.rollout.embedded_process import EmbeddedProcessEngine
from gspo_megatron.rollout.sglang_engine import SGLangEngine
from gspo_megatron.rollout.types import RolloutEngine, WeightTransport
from gspo_megatron.weight_sync.disk import DiskTransport
from gspo_megatron.weight_sync.distributed_broadcast import BroadcastTransport
from gspo_megatron.weight_sync.in_process import CudaIpcTransport, InProcessTransport


_IN_PROCESS_LOADERS = (EmbeddedEngine, EmbeddedProcessEngine)
"""Engines whose ``load_weights`` this process can call (the second one writes shared memory)."""


def resolve_transport(transport: str, engine: RolloutEngine, mode: str) -> str:
    """``auto`` -> ``tensor`` for in-process engines and colocated servers, else ``nccl``."""
    if transport != "auto":
        return transport
    if isinstance(engine, _IN_PROCESS_LOADERS) or mode == "colocated":
        return "tensor"
    return "nccl"


def build_transport(sync_cfg, engine: RolloutEngine, mode: str = "colocated",
                    server_tp_size: int = 1, master_address: str = "127.0.0.1",
                    master_port: Optional[int] = None, config_dir: Optional[str] = None,
                    attach: bool = True) -> WeightTransport:
    """Build the transport named by ``sync_cfg`` (a ``WeightSyncConfig``) for ``engine``."""
    kind = resolve_transport(sync_cfg.transport, engine, mode)
    embedded = isinstance(engine, _IN_PROCESS_LOADERS)
    if not embedded and not isinstance(engine, SGLangEngine):
        raise TypeError(f"no weight transport for engine type {type(engine).__name__}")
    if kind == "tensor":
        transport = (InProcessTransport(engine, sync_cfg.bucket_bytes) if embedded
                     else CudaIpcTransport(engine.clients, sync_cfg.bucket_bytes, server_tp_size))
    elif kind == "disk":
        transport = DiskTransport(sync_cfg.disk_dir, sync_cfg.bucket_bytes,
                                  engine=engine if embedded else None,
                                  clients=() if embedded else engine.clients, config_dir=config_dir)
    elif kind == "nccl":
        if embedded:
            raise ValueError("rollout.weight_sync.transport=nccl needs server engines "
                             "(sglang/reference); the embedded engine uses 'tensor' or 'disk'")
        if master_port is None:
            raise ValueError("the nccl (broadcast) transport needs a master_port for its group")
        transport = BroadcastTransport(engine.clients, master_address, master_port,
                                       sync_cfg.bucket_bytes,
                                       server_tp_sizes=[server_tp_size] * len(engine.clients))
    else:
        raise ValueError(f"rollout.weight_sync.transport={sync_cfg.transport!r} is not one of "
                         "auto, nccl, tensor, disk")
    if attach:
        engine.attach_weight_transport(transport)
    return transport
