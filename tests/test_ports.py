"""Ports picked for a later bind: below the ephemeral range, never one that is held, and never
one that another picker of this machine was handed and may not have bound yet."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from gspo_megatron.distributed import ports
from gspo_megatron.distributed.ports import free_port


def _two_free_neighbours(registry) -> int:
    """A port ``p`` with ``p`` and ``p + 1`` both free now, inside the picking range."""
    for _ in range(100):
        port = free_port(registry=registry)
        if port < ports.HIGH and ports._bindable("127.0.0.1", port + 1):
            return port
    raise AssertionError("no two free neighbouring ports")


def test_a_port_comes_from_below_the_ephemeral_range_and_can_be_bound(tmp_path):
    port = free_port(registry=tmp_path / "ports")
    assert ports.LOW <= port <= ports.HIGH < ports.ephemeral_low()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free, as it was handed out
    assert ports.ephemeral_low(str(tmp_path / "missing")) == 32768
    (tmp_path / "range").write_text("40000\t60999\n")
    assert ports.ephemeral_low(str(tmp_path / "range")) == 40000


def test_a_held_port_is_never_picked(tmp_path):
    low = _two_free_neighbours(tmp_path / "ports")
    with socket.socket() as held:
        held.bind(("127.0.0.1", low))
        held.listen(1)
        picks = {free_port(low=low, high=low + 1, registry=None) for _ in range(10)}
        assert picks == {low + 1}
        with socket.socket() as other:
            other.bind(("127.0.0.1", low + 1))
            with pytest.raises(RuntimeError, match=rf"no free port on 127.0.0.1 in {low}-{low + 1}"):
                free_port(low=low, high=low + 1, registry=None)


def test_pickers_never_share_a_port_while_it_is_reserved(tmp_path):
    """Two processes, 100 picks each from 300 ports: 200 different ports. Without the registry the
    same picks collide (200 from 300, none bound in between: a repeat is all but certain)."""
    low = ports.LOW + 1000
    code = ("import json, sys; from gspo_megatron.distributed.ports import free_port; "
            f"print(json.dumps([free_port(low={low}, high={low + 299}, registry=sys.argv[1]) "
            "for _ in range(100)]))")
    pickers = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "ports")],
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    picked = []
    for picker in pickers:
        out, _ = picker.communicate(timeout=120)
        assert picker.returncode == 0
        picked += json.loads(out)
    assert len(picked) == 200 and len(set(picked)) == 200
    assert len((tmp_path / "ports").read_text().splitlines()) == 200

    unreserved = [free_port(low=low, high=low + 299, registry=None) for _ in range(200)]
    assert len(set(unreserved)) < 200


def test_a_reservation_expires(tmp_path):
    port = _two_free_neighbours(tmp_path / "ports")
    registry = tmp_path / "one"
    assert free_port(low=port, high=port, registry=registry) == port
    with pytest.raises(RuntimeError, match="handed out in the last 600 s"):
        free_port(low=port, high=port, registry=registry)
    assert free_port(low=port, high=port, registry=registry, reserve_s=0.0) == port


def test_a_cut_line_in_the_registry_loses_only_itself(tmp_path):
    port = _two_free_neighbours(tmp_path / "ports")
    registry = tmp_path / "cut"
    assert free_port(low=port, high=port, registry=registry) == port
    with open(registry, "a") as f:
        f.write("not a line\n17")  # a crash mid-write
    with pytest.raises(RuntimeError):  # the good line still reserves its port
        free_port(low=port, high=port, registry=registry)
    assert registry.read_text().split()[0] == str(port)  # the cut lines are dropped


def test_a_registry_that_cannot_be_opened_leaves_the_bind_check(tmp_path):
    port = free_port(registry=tmp_path / "no such dir" / "ports")
    assert ports.LOW <= port <= ports.HIGH


def test_a_kernel_range_below_ours_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.LOW)
    with pytest.raises(RuntimeError, match="ip_local_port_range"):
        free_port(registry=tmp_path / "ports")
