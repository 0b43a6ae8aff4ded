"""The synthetic load-test fleet answers many nodes' scrapes on kept-alive connections, each with that
node's own series, and says plainly when a node is unknown."""

from __future__ import annotations

import http.client

import pytest

from gpuhealth.local.process import wait_until
from gpuhealth.local.synthetic_fleet import SyntheticFleet


def _get(conn: http.client.HTTPConnection, path: str, **headers: str) -> tuple[int, bytes]:
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    return response.status, response.read()


def test_one_kept_alive_connection_serves_every_node_its_own_series() -> None:
    fleet = SyntheticFleet(3, sick_every=5).start()
    conn = http.client.HTTPConnection("127.0.0.1", fleet.port, timeout=10)
    try:
        bodies = {}
        for node in fleet.names:
            status, bodies[node] = _get(conn, f"/metrics?node={node}")
            assert status == 200
        assert f'uuid="GPU-{fleet.names[2]}-0"'.encode() in bodies[fleet.names[2]]
        assert f'uuid="GPU-{fleet.names[2]}-0"'.encode() not in bodies[fleet.names[1]]
        assert bodies[fleet.names[0]].count(b"\n") == sum(1 for _ in fleet.series[fleet.names[0]])
        assert len(fleet.connections) == 1
        assert _get(conn, "/metrics?node=elsewhere") == (404, b"unknown node\n")
    finally:
        conn.close()
        fleet.stop()


def test_a_client_that_asks_to_close_is_closed_and_stop_closes_the_rest() -> None:
    fleet = SyntheticFleet(2).start()
    closing = http.client.HTTPConnection("127.0.0.1", fleet.port, timeout=10)
    kept = http.client.HTTPConnection("127.0.0.1", fleet.port, timeout=10)
    try:
        assert _get(closing, "/metrics?node=node0000", Connection="close")[0] == 200
        assert _get(kept, "/metrics?node=node0001")[0] == 200
        wait_until(lambda: len(fleet.connections) == 1, timeout=10, what="the closing connection closed")
    finally:
        closing.close()
        fleet.stop()
    assert fleet.connections == set()
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        _get(kept, "/metrics?node=node0001")
    kept.close()
