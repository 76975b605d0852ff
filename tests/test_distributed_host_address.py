"""distributed/host_address.py: rank 0 publishes the address the servers can reach it at."""

from __future__ import annotations

import socket

from gspo_megatron.distributed.host_address import address_towards, update_group_address


def _non_loopback_address():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only a route is looked up
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_loopback_peer_gets_loopback():
    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert update_group_address(None, ["127.0.0.1:31000", "10.9.9.9:31001"]) == "127.0.0.1"


def test_a_peer_on_this_hosts_network_gets_this_hosts_address_not_loopback():
    addr = _non_loopback_address()
    assert addr is not None, "this test needs a non-loopback IPv4 route on the machine"
    assert update_group_address(None, [f"{addr}:30000"]) == addr


def test_configured_address_wins_and_local_launch_is_loopback():
    assert update_group_address("10.1.2.3", ["127.0.0.1:30000"]) == "10.1.2.3"
    assert update_group_address(None, []) == "127.0.0.1"


def test_unroutable_server_falls_back_to_this_hosts_name(caplog):
    addr = update_group_address(None, ["no-such-host.invalid:30000"])
    assert addr == socket.gethostbyname(socket.gethostname())
    assert "no route to rollout server no-such-host.invalid" in caplog.text
