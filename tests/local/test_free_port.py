"""``free_port`` hands each pytest-xdist worker ports of its own, below the kernel's ephemeral range:
a daemon told to listen on one does not find a client's socket, or another worker's daemon, there."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpuhealth.local import process

EPHEMERAL_LOW = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_workers_get_disjoint_slices_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(process._port_slice())
    assert all(len(s) > 1000 and s.stop <= EPHEMERAL_LOW for s in slices)
    assert set(slices[0]).isdisjoint(slices[1])


def test_consecutive_ports_differ_and_a_port_in_use_is_passed_over(monkeypatch: pytest.MonkeyPatch):
    assert process.free_port() != process.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(process, "_SLICE", range(port, port + 1))
        assert process.free_port() != port  # the only candidate is taken: the kernel picks one
        monkeypatch.setattr(process, "_SLICE", range(port - 1, port + 2))
        assert port not in {process.free_port() for _ in range(6)}
