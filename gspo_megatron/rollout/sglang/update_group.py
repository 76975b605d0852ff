"""A standalone torch.distributed group for broadcasting weights from a learner to servers.

SGLang's ``/init_weights_update_group`` builds, inside each server, a process group that does
not belong to the server's default world: a TCP rendezvous at ``master_address:master_port``
(the learner's rank 0 hosts it as rank 0), a store prefixed with the group name, and a
backend (NCCL on GPU, gloo on CPU). The learner must build its side the same way, and the
reference server does too. Built on ``torch.distributed``'s group helper, which is the only
way to create such a group without an initialised default world.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def create_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                        group_name: str, backend: str = "gloo", timeout_s: float = 120.0,
                        device_id: Optional[torch.device] = None):
    """Join (rank 0 hosts) the group; returns the ProcessGroup. Blocks until all ranks join.

    ``device_id`` makes NCCL initialise eagerly; both sides must agree (sglang 0.5.23 passes
    none, see weight_sync/distributed_broadcast.py), so callers leave it None for that version.
    """
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world)

    if not 0 <= rank < world_size:
        raise ValueError(f"update group {group_name!r}: rank {rank} outside world of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    # An explicit TCPStore, not rendezvous("tcp://..."): under torchrun
    # (TORCHELASTIC_USE_AGENT_STORE=True) rendezvous makes every rank a client, so nobody would
    # host this group's store.
    store = TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                     timeout=timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                         group_name=group_name, timeout=timeout,
                                         device_id=device_id)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    log.info("joined update group %s as rank %d/%d (%s)", group_name, rank, world_size, backend)
    return group


def broadcast_from_learner(tensor: torch.Tensor, group, async_op: bool = False):
    """Broadcast ``tensor`` in place from group rank 0 (the learner) to every member; with
    ``async_op`` returns the work handle (the sender polls it against the servers' answers)."""
    return dist.broadcast(tensor, group_src=0, group=group, async_op=async_op)


def destroy_update_group(group) -> None:
    dist.destroy_process_group(group)
