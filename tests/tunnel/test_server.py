"""TunnelServer: the registry of agents by node name, over in-memory transports."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.tunnel.memtransport import memory_transport_pair
from tests.tunnel.test_endpoint import echo_handler
from tunnel import protocol as p
from tunnel.endpoint import EndpointSettings, HandshakeError, IncomingStream, TunnelConnection
from tunnel.server import Bootstrap, NodeNotConnected, TunnelServer
from tunnel.transports import PeerInfo

T = p.Target("svc", 80)
SETTINGS = EndpointSettings(ping_interval=0)


async def node_from_hello(hello: p.Hello, peer: PeerInfo) -> str:
    return hello.identity["node"]


async def connect_agent(server: TunnelServer, nursery: trio.Nursery, handler: object
                        ) -> TunnelConnection:
    """A new agent connection for node edge-1; returns the server's side of it once the
    registry holds it."""
    before = server.connection_for("edge-1")
    ours, theirs = memory_transport_pair()
    nursery.start_soon(server.handle_transport, theirs)
    agent = TunnelConnection(ours, p.Role.DIALER, SETTINGS, handler)  # type: ignore[arg-type]
    await agent.dial_handshake(p.Hello(identity={"node": "edge-1"}))
    await nursery.start(agent.run)
    await trio.testing.wait_all_tasks_blocked()
    conn = server.connection_for("edge-1")
    assert conn is not None and conn is not before
    return conn


async def test_open_pending_while_the_agent_reconnects_goes_to_the_new_connection() -> None:
    """An OPEN in flight on a connection that a reconnect replaces is retried on the new
    connection: the caller gets a stream, never a raw TunnelClosedError (which the HTTP
    front and TCP mappings would not expect)."""
    server = TunnelServer(authenticate=node_from_hello, settings=SETTINGS)
    stuck = trio.Event()

    async def never_answers(incoming: IncomingStream) -> None:
        stuck.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await connect_agent(server, nursery, never_answers)
        result: list[object] = []
        opened = trio.Event()

        async def opener() -> None:
            result.append(await server.open_stream("edge-1", T))
            opened.set()

        nursery.start_soon(opener)
        await stuck.wait()
        second = await connect_agent(server, nursery, echo_handler)
        with trio.fail_after(5):
            await opened.wait()
        stream = result[0]
        assert server.connection_for("edge-1") is second
        await stream.send_all(b"hello")  # type: ignore[attr-defined]
        assert await stream.receive_some() == b"hello"  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()


async def test_open_to_an_unknown_node_is_refused_as_not_connected() -> None:
    server = TunnelServer(authenticate=node_from_hello, settings=SETTINGS)
    with pytest.raises(NodeNotConnected) as info:
        await server.open_stream("nobody", T)
    assert info.value.reason is p.StreamReason.UNREACHABLE


async def bootstrap_unless_token(hello: p.Hello, peer: PeerInfo) -> str | Bootstrap:
    if hello.identity.get("bootstrap"):
        return Bootstrap(hello.identity["node"])
    return hello.identity["node"]


async def dial_hello(server: TunnelServer, nursery: trio.Nursery,
                     identity: dict[str, str]) -> TunnelConnection:
    ours, theirs = memory_transport_pair()
    nursery.start_soon(server.handle_transport, theirs)
    agent = TunnelConnection(ours, p.Role.DIALER, SETTINGS, None)
    await agent.dial_handshake(p.Hello(identity=identity))
    await nursery.start(agent.run)
    return agent


async def test_a_bootstrap_connection_is_never_a_node_and_only_reaches_the_signer() -> None:
    seen: list[tuple[str, str]] = []

    async def to_signer(claimed: str, incoming: IncomingStream) -> None:
        seen.append((claimed, str(incoming.target)))
        await echo_handler(incoming)

    server = TunnelServer(authenticate=bootstrap_unless_token, settings=SETTINGS,
                          bootstrap_handler=to_signer, bootstrap_seconds=0.5)
    async with trio.open_nursery() as nursery:
        real = await connect_agent(server, nursery, echo_handler)
        ours, theirs = memory_transport_pair()
        nursery.start_soon(server.handle_transport, theirs)
        fetcher = TunnelConnection(ours, p.Role.DIALER, SETTINGS, None)
        await fetcher.dial_handshake(p.Hello(identity={"node": "edge-1", "bootstrap": "1"}))
        with trio.fail_after(5):
            # The server ends the connection after bootstrap_seconds: run() returns.
            async with trio.open_nursery() as inner:
                await inner.start(fetcher.run)
                # The real edge-1 keeps its registration; the fetcher is not a node.
                assert server.connection_for("edge-1") is real
                assert server.bootstrap_sessions == 1
                stream = await fetcher.open_stream(p.Target("signer", 443))
                await stream.send_all(b"csr")
                assert await stream.receive_some() == b"csr"
        assert seen[0][0] == "edge-1" and "signer" in seen[0][1]
        assert server.bootstrap_sessions == 0 and server.bootstrap_served == 1
        assert server.connection_for("edge-1") is real
        nursery.cancel_scope.cancel()


async def test_bootstrap_is_refused_without_a_handler_and_beyond_the_cap() -> None:
    async def to_signer(claimed: str, incoming: IncomingStream) -> None:
        await incoming.refuse(p.StreamReason.FORBIDDEN, "")

    plain = TunnelServer(authenticate=bootstrap_unless_token, settings=SETTINGS)
    capped = TunnelServer(authenticate=bootstrap_unless_token, settings=SETTINGS,
                          bootstrap_handler=to_signer, max_bootstrap_sessions=1)
    async with trio.open_nursery() as nursery:
        with pytest.raises(HandshakeError, match="issues no credentials"):
            await dial_hello(plain, nursery, {"node": "edge-1", "bootstrap": "1"})
        await dial_hello(capped, nursery, {"node": "edge-1", "bootstrap": "1"})
        with pytest.raises(HandshakeError, match="too many agents"):
            await dial_hello(capped, nursery, {"node": "edge-2", "bootstrap": "1"})
        assert capped.bootstrap_sessions == 1 and plain.bootstrap_sessions == 0
        nursery.cancel_scope.cancel()


async def test_a_full_server_refuses_new_nodes_but_lets_known_ones_reconnect() -> None:
    server = TunnelServer(authenticate=node_from_hello, settings=SETTINGS, max_sessions=1)
    async with trio.open_nursery() as nursery:
        first = await connect_agent(server, nursery, echo_handler)
        with pytest.raises(HandshakeError, match="maximum of 1 agents"):
            await dial_hello(server, nursery, {"node": "edge-2"})
        assert set(server.sessions) == {"edge-1"}
        again = await connect_agent(server, nursery, echo_handler)  # edge-1 reconnecting
        assert again is not first and set(server.sessions) == {"edge-1"}
        nursery.cancel_scope.cancel()
