"""TunnelServer: the registry of agents by node name, over in-memory transports."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.tunnel.memtransport import memory_transport_pair
from tests.tunnel.test_endpoint import echo_handler
from tunnel import protocol as p
from tunnel.endpoint import (
    EndpointSettings,
    HandshakeError,
    IncomingStream,
    StreamRefusedError,
    TunnelConnection,
)
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
                     identity: dict[str, str], source: str = "acceptor") -> TunnelConnection:
    """A dialer's connection to `server`, which sees it coming from `source`."""
    ours, theirs = memory_transport_pair(acceptor_peer=source)
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
        await dial_hello(capped, nursery, {"node": "edge-1", "bootstrap": "1"},
                         source="192.0.2.1:1000")
        with pytest.raises(HandshakeError, match="too many agents") as info:
            await dial_hello(capped, nursery, {"node": "edge-2", "bootstrap": "1"},
                             source="192.0.2.2:1000")
        assert info.value.code is p.ErrorCode.OVERLOADED
        assert capped.refusals == {"bootstrap_full": 1}
        assert capped.bootstrap_sessions == 1 and plain.bootstrap_sessions == 0
        nursery.cancel_scope.cancel()


async def test_one_address_cannot_take_every_bootstrap_slot(
        caplog: pytest.LogCaptureFixture) -> None:
    """An anonymous client holding all the bootstrap connections it may open leaves room
    for agents elsewhere: it gets `max_bootstrap_per_address`, refused beyond with a reason
    (OVERLOADED, counted, one log line per 10 s), and its slots come back when they end."""
    async def to_signer(claimed: str, incoming: IncomingStream) -> None:
        await echo_handler(incoming)

    reasons: list[str] = []
    server = TunnelServer(authenticate=bootstrap_unless_token, settings=SETTINGS,
                          bootstrap_handler=to_signer, on_refusal=reasons.append)
    boot = {"node": "edge-1", "bootstrap": "1"}
    async with trio.open_nursery() as nursery:
        held = []
        for _ in range(3):  # more than anyone gets, fewer than the 64 in all
            held.extend([await dial_hello(server, nursery, boot, source="192.0.2.66:4000")
                         for _ in range(server.bootstrap_slots.max_per_source or 64)])
            with pytest.raises(HandshakeError, match="at this address") as info:
                await dial_hello(server, nursery, boot, source="192.0.2.66:4001")
            assert info.value.code is p.ErrorCode.OVERLOADED
            assert info.value.retry_after is None  # (told in words: no retry-after feature)
            # Another address (a new agent elsewhere) still gets its certificate.
            agent = await dial_hello(server, nursery, boot, source="198.51.100.9:5000")
            stream = await agent.open_stream(p.Target("signer", 443))
            await stream.send_all(b"csr")
            assert await stream.receive_some() == b"csr"
            await agent.aclose()
            # The client's connections end: its slots are free again.
            for conn in held:
                await conn.aclose()
            held.clear()
            await trio.testing.wait_all_tasks_blocked()
            assert server.bootstrap_sessions == 0
        assert 2 <= server.bootstrap_slots.max_per_source <= 4  # type: ignore[operator]
        assert reasons == ["bootstrap_per_address"] * 3
        assert server.refusals == {"bootstrap_per_address": 3}
        assert server.handshake_failures == 0  # a refusal, not a failed handshake
        lines = [r for r in caplog.records if r.getMessage() == "agent handshake refused"]
        assert len(lines) == 1 and lines[0].nodeagent_fields["reason"] == (  # type: ignore[attr-defined]
            "bootstrap_per_address")
        assert lines[0].nodeagent_fields["source"] == "192.0.2.66"  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()


async def test_a_bootstrap_connection_is_closed_within_ten_seconds_by_default(
        autojump_clock: trio.abc.Clock) -> None:
    """One certificate request needs well under a second: an idle bootstrap connection is
    closed after at most 10 s (virtual time), and its slot freed."""
    async def to_signer(claimed: str, incoming: IncomingStream) -> None:
        await echo_handler(incoming)

    server = TunnelServer(authenticate=bootstrap_unless_token, settings=SETTINGS,
                          bootstrap_handler=to_signer)
    async with trio.open_nursery() as nursery:
        ours, theirs = memory_transport_pair()
        nursery.start_soon(server.handle_transport, theirs)
        fetcher = TunnelConnection(ours, p.Role.DIALER, SETTINGS, None)
        await fetcher.dial_handshake(p.Hello(identity={"node": "edge-1", "bootstrap": "1"}))
        started = trio.current_time()
        with trio.fail_after(60):
            await fetcher.run()
        assert trio.current_time() - started <= 10.0
        await trio.testing.wait_all_tasks_blocked()
        assert server.bootstrap_sessions == 0 and server.bootstrap_served == 1
        nursery.cancel_scope.cancel()


async def test_a_bootstrap_connection_opens_at_most_two_streams() -> None:
    """Each bootstrap stream becomes a connection to the controller: a bootstrap connection
    gets 2 (announced in the server's HELLO, and counted over the connection's life), and
    one that ignores the announcement has the rest refused as OVERLOADED, counted."""
    reached: list[str] = []

    async def to_signer(claimed: str, incoming: IncomingStream) -> None:
        reached.append(claimed)
        await echo_handler(incoming)

    reasons: list[str] = []
    server = TunnelServer(authenticate=bootstrap_unless_token, settings=SETTINGS,
                          bootstrap_handler=to_signer, on_refusal=reasons.append)
    signer = p.Target("signer", 443)
    boot = {"node": "edge-1", "bootstrap": "1"}
    async with trio.open_nursery() as nursery:
        honest = await dial_hello(server, nursery, boot)
        first, second = [await honest.open_stream(signer) for _ in range(2)]
        with pytest.raises(StreamRefusedError, match="allows 2 concurrent") as info:
            await honest.open_stream(signer)  # the dialer read the cap in the HELLO
        assert info.value.reason is p.StreamReason.OVERLOADED
        await first.aclose()
        await second.aclose()
        with pytest.raises(StreamRefusedError, match="at most 2 streams") as info:
            await honest.open_stream(signer)  # over the connection's life too
        assert info.value.reason is p.StreamReason.OVERLOADED
        assert reasons == ["bootstrap_streams"] and len(reached) == 2

        # A dialer that ignores the announced cap and opens 10 at once.
        ours, theirs = memory_transport_pair(acceptor_peer="192.0.2.5:1000")
        nursery.start_soon(server.handle_transport, theirs)
        rogue = p.Connection(p.Role.DIALER)
        rogue.start(p.Hello(identity=boot))
        await ours.send(rogue.data_to_send())
        events = rogue.receive_data(await ours.receive())
        assert isinstance(events[0], p.HandshakeCompleted)
        assert rogue.remote_settings.max_streams == 2
        rogue.remote_settings = p.Settings()  # ignore it
        for _ in range(10):
            rogue.open_stream(signer)
        await ours.send(rogue.data_to_send())
        answers: list[p.Event] = []
        with trio.fail_after(5):
            while len(answers) < 10:
                answers += [e for e in rogue.receive_data(await ours.receive())
                            if isinstance(e, p.StreamAccepted | p.StreamRefused)]
        refused = [e for e in answers if isinstance(e, p.StreamRefused)]
        assert len(refused) == 8 and len(reached) == 4
        assert {e.reason for e in refused} == {p.StreamReason.OVERLOADED}
        await ours.aclose()
        await trio.testing.wait_all_tasks_blocked()
        # Counted when the connection ends (the protocol core refused them itself).
        assert server.refusals["bootstrap_streams"] == 1 + 8
        assert reasons.count("bootstrap_streams") == 9
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
