"""The descriptor census finds what it counts: a listening socket opened here, and a gloo group's
listener, each appear and go away."""

from __future__ import annotations

import socket

from tests.descriptors import descriptor_kinds, listening_sockets
from tests.multiproc import run_on_ranks


def test_a_listening_socket_is_counted_and_a_connected_one_is_not():
    before = listening_sockets()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname(), timeout=10)
    try:
        assert listening_sockets() == before + 1
        assert descriptor_kinds()["socket"] >= 2
    finally:
        client.close()
        server.close()
    assert listening_sockets() == before


def _gloo_group_listeners(rank: int) -> list:
    import torch.distributed as dist

    counts = [listening_sockets()]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    counts.append(listening_sockets())
    dist.destroy_process_group()
    counts.append(listening_sockets())
    return counts


def test_a_gloo_groups_listener_is_counted_while_the_group_lives():
    before, alive, after = run_on_ranks(_gloo_group_listeners, world_size=1)[0]
    assert alive > before and after == before
