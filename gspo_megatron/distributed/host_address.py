"""Which of this host's addresses the rollout servers should dial for the weight-update group.

The group's rendezvous is hosted by learner rank 0, wherever torchrun put it (its rendezvous
orders nodes its own way, so "the first learner node" is not reliably rank 0). Rank 0 therefore
publishes its own address, chosen as the local address of the route towards the servers: a UDP
``connect`` picks the route and sends nothing. ``rollout.weight_sync.master_address`` overrides
it (for hosts whose routing table does not match the cluster network).
"""

from __future__ import annotations

import logging
import socket
from typing import Optional, Sequence

log = logging.getLogger(__name__)


def address_towards(peer_host: str) -> str:
    """This host's IP address on the route to ``peer_host`` (a name or an address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((peer_host, 9))  # UDP: no packet is sent, only a route is chosen
        return sock.getsockname()[0]


def update_group_address(master_address: Optional[str], server_addresses: Sequence[str]) -> str:
    """Rendezvous host of the weight-update group, decided on learner rank 0.

    ``master_address`` when configured; else this host's address towards the first server
    (``host:port``); loopback when the servers are launched on this host (no addresses given).
    """
    if master_address:
        return master_address
    if not server_addresses:
        return "127.0.0.1"
    host = server_addresses[0].rsplit(":", 1)[0]
    try:
        return address_towards(host)
    except OSError as exc:
        fallback = socket.gethostbyname(socket.gethostname())
        log.warning("no route to rollout server %s (%s); publishing %s for the weight-update "
                    "group (set rollout.weight_sync.master_address to choose)", host, exc, fallback)
        return fallback
