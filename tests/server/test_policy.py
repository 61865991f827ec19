"""The server's data-path policy, end to end over a real tunnel connection (in memory) and
real sockets for what it dials: egress scoped per node with a floor of protected ranges.
Every refusal is FORBIDDEN, counted and logged."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from nodeagent.config import RoutesConfig, ServerConfig
from nodeagent.server.server import Server
from tests.tunnel.memtransport import memory_transport_pair
from tunnel import protocol as p
from tunnel.endpoint import (
    EndpointSettings,
    HandshakeError,
    IncomingStream,
    StreamRefusedError,
    TunnelConnection,
)

TOKEN = "0123456789abcdef0123"
SETTINGS = EndpointSettings(ping_interval=0)


def make_server(routes: dict[str, Any], **extra: Any) -> Server:
    config = ServerConfig.model_validate({
        "tunnel": {"url": "tcp://127.0.0.1:0", "insecure": True},
        "tokens": [{"node": "*", "token": TOKEN}], "debug_socket": "", **routes, **extra})
    return Server(config)


async def refuse_all(incoming: IncomingStream) -> None:
    await incoming.refuse(p.StreamReason.REFUSED, "test agent")


async def connect(server: Server, nursery: trio.Nursery, node: str,
                  handler: Any = refuse_all) -> TunnelConnection:
    ours, theirs = memory_transport_pair()
    nursery.start_soon(server.tunnel.handle_transport, theirs)
    agent = TunnelConnection(ours, p.Role.DIALER, SETTINGS, handler)
    await agent.dial_handshake(p.Hello(identity={"node": node, "token": TOKEN}))
    await nursery.start(agent.run)
    await trio.testing.wait_all_tasks_blocked()
    return agent


@asynccontextmanager
async def echo_listener() -> AsyncIterator[int]:
    async def echo(stream: trio.SocketStream) -> None:
        # A client that resets its stream (aclose() on an open stream) has the relay
        # reset this connection: that ends the echo, it is no error of the target.
        with contextlib.suppress(trio.BrokenResourceError):
            async with stream:
                async for data in stream:
                    await stream.send_all(data)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
        yield int(listeners[0].socket.getsockname()[1])
        nursery.cancel_scope.cancel()


async def refused(agent: TunnelConnection, host: str, port: int) -> StreamRefusedError:
    with pytest.raises(StreamRefusedError) as info:
        await agent.open_stream(p.Target(host, port), {"origin": "10.1.0.9:4000"})
    return info.value


def refusals(server: Server, reason: str) -> float:
    value = server.metrics.registry.get_sample_value(
        "nodeagent_server_refusals_total", {"reason": reason})
    return value or 0.0


async def test_protected_destinations_are_forbidden_under_a_wide_rule() -> None:
    server = make_server({"egress": ["0.0.0.0/0:*"], "protected": ["172.18.0.2/32"]})
    async with echo_listener() as port, trio.open_nursery() as nursery:
        agent = await connect(server, nursery, "edge-1")
        for host in ("169.254.169.254", "172.18.0.2", "127.0.0.1"):
            error = await refused(agent, host, port if host == "127.0.0.1" else 80)
            assert error.reason is p.StreamReason.FORBIDDEN, host
            assert "protected" in error.message
        assert refusals(server, "egress_protected") == 3
        nursery.cancel_scope.cancel()


async def test_a_rule_naming_the_exact_range_unlocks_it() -> None:
    async with echo_listener() as port, trio.open_nursery() as nursery:
        server = make_server({"egress": [f"127.0.0.1/32:{port}"]})
        agent = await connect(server, nursery, "edge-1")
        stream = await agent.open_stream(p.Target("127.0.0.1", port))
        await stream.send_all(b"ping")
        assert await stream.receive_some() == b"ping"
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_egress_follows_the_nodes_scope(caplog: pytest.LogCaptureFixture) -> None:
    async with echo_listener() as port, trio.open_nursery() as nursery:
        server = make_server({"scopes": [{"name": "edge", "nodes": ["edge-1"],
                                          "egress": [f"127.0.0.1/32:{port}"]}]})
        outside = await connect(server, nursery, "cloud-1")
        for _ in range(3):
            error = await refused(outside, "127.0.0.1", port)
            assert error.reason is p.StreamReason.FORBIDDEN
            assert "not in node cloud-1's egress allow list" in error.message
        assert refusals(server, "egress_not_allowed") == 3
        # Three refusals, one log line (rate-limited per reason and node).
        assert sum("destination not allowed" in r.getMessage()
                   for r in caplog.records) == 1
        inside = await connect(server, nursery, "edge-1")
        stream = await inside.open_stream(p.Target("127.0.0.1", port))
        await stream.send_all(b"x")
        assert await stream.receive_some() == b"x"
        await stream.aclose()
        nursery.cancel_scope.cancel()


def test_new_routes_rescope_egress() -> None:
    server = make_server({"egress": ["10.5.0.0/16:*"]})
    assert server.routes.check_egress("a", "10.5.0.1", 1) is None
    server.apply_routes(RoutesConfig(version=2))
    assert server.routes.check_egress("a", "10.5.0.1", 1) == "not_allowed"


async def test_relays_between_nodes_need_a_policy() -> None:
    """Agent A opens a stream to an address node B owns: relayed to B's agent only where a
    scope's relays name it; otherwise FORBIDDEN, and B never sees the OPEN."""
    seen: list[str] = []

    async def b_handler(incoming: IncomingStream) -> None:
        seen.append(f"{incoming.target.host}:{incoming.target.port}")
        stream = await incoming.accept()
        async with stream:
            await stream.send_all(b"from b")

    cidrs = {"node_cidrs": {"node-b": ["10.2.0.0/24"]}}
    async with trio.open_nursery() as nursery:
        server = make_server(cidrs)
        await connect(server, nursery, "node-b", b_handler)
        a = await connect(server, nursery, "node-a")
        error = await refused(a, "10.2.0.7", 8080)
        assert error.reason is p.StreamReason.FORBIDDEN
        assert "no relay policy lets node node-a" in error.message
        assert seen == [] and refusals(server, "relay_not_allowed") == 1
        server.apply_routes(RoutesConfig(scopes=[  # type: ignore[list-item]
            {"name": "t/relays[0]", "nodes": ["node-a"], "relays": ["10.2.0.0/24:8080"]}],
            **cidrs))  # type: ignore[arg-type]
        stream = await a.open_stream(p.Target("10.2.0.7", 8080))
        assert await stream.receive_some() == b"from b"
        assert seen == ["10.2.0.7:8080"]
        assert (await refused(a, "10.2.0.7", 22)).reason is p.StreamReason.FORBIDDEN
        nursery.cancel_scope.cancel()


async def test_a_deleted_or_denied_node_is_disconnected_and_refused() -> None:
    controller = {"controller": "https://127.0.0.1:1"}
    async with trio.open_nursery() as nursery:
        server = make_server({}, **controller)
        with pytest.raises(HandshakeError):  # no routes yet: no node is known
            await connect(server, nursery, "edge-1")
        server.apply_routes(RoutesConfig(nodes=("edge-1", "edge-2")))
        assert await server.close_revoked() == []
        agent = await connect(server, nursery, "edge-1")
        other = await connect(server, nursery, "edge-2")
        with pytest.raises(HandshakeError):
            await connect(server, nursery, "ghost")
        # edge-1's Node deleted, edge-2 denied: both tunnels closed when the routes apply.
        server.apply_routes(RoutesConfig(nodes=("edge-2",), denied_nodes=("edge-2",)))
        assert sorted(await server.close_revoked()) == ["edge-1", "edge-2"]
        await trio.testing.wait_all_tasks_blocked()
        assert not agent.is_open and not other.is_open and server.tunnel.sessions == {}
        for node in ("edge-1", "edge-2"):
            with pytest.raises(HandshakeError):
                await connect(server, nursery, node)
        assert refusals(server, "node_revoked") == 2
        assert refusals(server, "node_not_admitted") == 4
        nursery.cancel_scope.cancel()


async def test_standalone_servers_keep_their_token_rules() -> None:
    async with trio.open_nursery() as nursery:
        server = make_server({})  # no controller: no node list
        agent = await connect(server, nursery, "anything")
        assert agent.is_open and await server.close_revoked() == []
        nursery.cancel_scope.cancel()


async def test_only_control_plane_sources_reach_node_addresses_as_control_plane() -> None:
    """The DNAT path: a stream a cloud node's agent opens to an edge node's address is
    decided like a CONNECT and reaches the edge agent marked purpose=control-plane; any
    other node's agent gets no such path (the address is nobody's egress)."""
    seen: list[tuple[str, dict[str, str]]] = []

    async def edge_handler(incoming: IncomingStream) -> None:
        seen.append((str(incoming.target), dict(incoming.metadata)))
        stream = await incoming.accept()
        async with stream:
            await stream.send_all(b"kubelet")

    routes = {"connect_nodes": {"edge-1": {"addresses": ["192.168.7.10"]},
                                "edge-3": {"addresses": ["192.168.7.30"]}},
              "denied_nodes": ["edge-3"], "control_plane_sources": ["cloud-1"]}
    async with trio.open_nursery() as nursery:
        server = make_server(routes)
        await connect(server, nursery, "edge-1", edge_handler)
        cloud = await connect(server, nursery, "cloud-1")
        stream = await cloud.open_stream(p.Target("192.168.7.10", 10250), {"origin": "h:1"})
        assert await stream.receive_some() == b"kubelet"
        assert seen == [("tcp://192.168.7.10:10250",
                         {"origin": "cloud-1/h:1", "purpose": "control-plane"})]
        for host, port, why in (("192.168.7.10", 22, "allowedNodePorts"),
                                ("192.168.7.30", 10250, "denied")):
            error = await refused(cloud, host, port)
            assert error.reason is p.StreamReason.FORBIDDEN and why in error.message
        assert refusals(server, "control_plane_refused") == 2
        assert server.status()["dnat"]["by_outcome"] == {
            "established": 1, "port_not_allowed": 1, "node_denied": 1}
        assert server.metrics.registry.get_sample_value(
            "nodeagent_dnat_streams_total", {"outcome": "node_denied"}) == 1
        other = await connect(server, nursery, "edge-2")
        error = await refused(other, "192.168.7.10", 10250)
        assert "egress allow list" in error.message and len(seen) == 1
        nursery.cancel_scope.cancel()


async def test_handshakes_beyond_the_configured_rate_are_refused_counted_with_a_retry_after(
        ) -> None:
    server = make_server({}, tunnel={"url": "tcp://127.0.0.1:0", "insecure": True,
                                     "handshake_rate": 0.5, "handshake_burst": 1})
    async with trio.open_nursery() as nursery:
        await connect(server, nursery, "edge-1")
        ours, theirs = memory_transport_pair()
        nursery.start_soon(server.tunnel.handle_transport, theirs)
        agent = TunnelConnection(ours, p.Role.DIALER, SETTINGS, refuse_all)
        with pytest.raises(HandshakeError) as info:
            await agent.dial_handshake(p.Hello(identity={"node": "edge-2", "token": TOKEN},
                                               features=(p.FEATURE_RETRY_AFTER,)))
        assert info.value.code is p.ErrorCode.OVERLOADED
        assert info.value.retry_after == pytest.approx(2.0, abs=0.1)  # next token at 0.5/s
        assert server.metrics.registry.get_sample_value(
            "nodeagent_server_refusals_total", {"reason": "handshake_overloaded"}) == 1
        assert server.status()["handshake_refusals"] == {"overloaded": 1}
        assert set(server.tunnel.sessions) == {"edge-1"}
        nursery.cancel_scope.cancel()
