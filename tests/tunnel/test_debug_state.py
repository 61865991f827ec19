"""What the tunnel keeps for debug views and metrics, over real TCP: why tunnels ended (on
the client and the server, a closed set of labels), the addresses a client is still
dialing and their last failure, and the keepalive round trips reported."""

from __future__ import annotations

import trio

from nodeagent.testing.standalone import free_port
from tests.tunnel.test_reconnect import client, node_from_hello, tunnel_server
from tunnel import protocol as p
from tunnel.endpoint import EndpointSettings
from tunnel.errors import END_LABELS
from tunnel.server import TunnelServer
from tunnel.transports import Endpoint

SETTINGS = EndpointSettings(ping_interval=0)


async def test_a_lost_tunnel_is_counted_by_why_on_both_sides_and_redialed() -> None:
    server = TunnelServer(authenticate=node_from_hello, settings=SETTINGS)
    async with tunnel_server(server) as endpoint, trio.open_nursery() as nursery:
        c = client(endpoint, "edge-1")
        await nursery.start(c.run)
        with trio.fail_after(5):
            first = await c.wait_connected()
        assert c.dialing() == [] and not c.status.lost and not server.recent_ends
        await server.sessions["edge-1"].connection.aclose(
            p.ErrorCode.KEEPALIVE_TIMEOUT, "no PING answer")
        with trio.fail_after(5):
            while (conn := c.connection) is None or conn is first:  # noqa: ASYNC110
                await trio.sleep(0.02)
        assert dict(c.status.lost) == {"keepalive_timeout": 1}
        assert dict(server.disconnects) == {"keepalive_timeout": 1}
        ended = server.recent_ends["edge-1"]
        assert ended.label == "keepalive_timeout" and "no PING answer" in ended.reason
        assert "edge-1" in server.sessions  # back, and its previous end still known
        nursery.cancel_scope.cancel()
    assert set(c.status.lost) <= END_LABELS and set(server.disconnects) <= END_LABELS


async def test_an_address_being_dialed_is_listed_with_its_last_failure() -> None:
    port = free_port()
    c = client(Endpoint("tcp", "127.0.0.1", port), "edge-1")
    async with trio.open_nursery() as nursery:
        await nursery.start(c.run)
        with trio.fail_after(5):
            while c.status.failures < 1:  # noqa: ASYNC110 - a counter, no event
                await trio.sleep(0.02)
        [row] = c.dialing()
        assert row["address"] == f"tcp://127.0.0.1:{port}" and row["server_id"] is None
        assert row["state"] in ("dialing", "backoff")
        assert "dial failed" in str(row["last_error"])
        assert isinstance(row["since_seconds"], float)
        # Refused: the unreachable schedule, about every second at most.
        assert 0 < row["retry_in_seconds"] <= 1.0, row
        server = TunnelServer(authenticate=node_from_hello, settings=SETTINGS)
        async with tunnel_server(server, port):
            with trio.fail_after(5):
                await c.wait_connected()
            assert c.dialing() == []
            nursery.cancel_scope.cancel()


async def test_each_keepalive_round_trip_is_reported() -> None:
    rtts: list[float] = []
    settings = EndpointSettings(ping_interval=0.05, ping_timeout=5, on_rtt=rtts.append)
    server = TunnelServer(authenticate=node_from_hello, settings=SETTINGS)
    async with tunnel_server(server) as endpoint, trio.open_nursery() as nursery:
        c = client(endpoint, "edge-1")
        c.settings = settings
        await nursery.start(c.run)
        with trio.fail_after(5):
            conn = await c.wait_connected()
            while len(rtts) < 3:  # noqa: ASYNC110 - a list, no event
                await trio.sleep(0.02)
        assert all(0 <= rtt < 5 for rtt in rtts) and conn.rtt == rtts[-1]
        nursery.cancel_scope.cancel()
