"""Reconnecting fast without a stampede: the reconnect policy, the server's handshake
admission with retry-after, and a client honouring it, over real TCP sockets."""

from __future__ import annotations

import logging
import random
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from nodeagent.testing.standalone import free_port
from tests.tunnel.memtransport import memory_transport_pair
from tests.tunnel.test_endpoint import echo_handler
from tunnel import protocol as p
from tunnel.accept import serve
from tunnel.backoff import Failure, ReconnectPolicy
from tunnel.client import TunnelClient
from tunnel.endpoint import EndpointSettings, TunnelConnection
from tunnel.server import HandshakeAdmission, TunnelServer
from tunnel.transports import Endpoint, PeerInfo

SETTINGS = EndpointSettings(ping_interval=0)


async def node_from_hello(hello: p.Hello, peer: PeerInfo) -> str:
    return hello.identity["node"]


# ------------------------------------------------------------------ policy


def test_unreachable_is_retried_about_every_second_however_long_the_outage() -> None:
    policy = ReconnectPolicy(rng=random.Random(1))
    delays = [policy.delay(Failure.UNREACHABLE) for _ in range(200)]  # minutes of outage
    assert max(delays) <= 1.0
    assert min(delays[5:]) >= 0.5  # equal jitter: never bunched at zero
    assert delays[0] <= 0.2


def test_rejected_slows_to_the_maximum_and_reset_starts_over() -> None:
    policy = ReconnectPolicy(rng=random.Random(2))
    delays = [policy.delay(Failure.REJECTED) for _ in range(12)]
    assert delays[0] <= 0.2 and 7.5 <= delays[-1] <= 15.0
    policy.reset()
    assert policy.delay(Failure.REJECTED) <= 0.2
    policy.to_maximum()
    assert policy.delay(Failure.REJECTED) >= 7.5
    assert policy.delay(Failure.UNREACHABLE) <= 0.2  # a separate schedule


def test_retry_after_is_honoured_with_jitter_spreading_a_fleet() -> None:
    policy = ReconnectPolicy(rng=random.Random(3))
    delays = [policy.delay(Failure.OVERLOADED, 4.0) for _ in range(1000)]
    assert 4.0 <= min(delays) < 4.1 and 5.9 < max(delays) <= 6.0
    # Spread over the window, not clustered: every tenth of it gets some.
    assert len({int((d - 4.0) / 0.2) for d in delays}) == 10


def test_unreachable_cap_never_exceeds_the_maximum() -> None:
    policy = ReconnectPolicy(0.1, 0.5, unreachable_maximum=1.0)
    assert max(policy.delay(Failure.UNREACHABLE) for _ in range(50)) <= 0.5


# ------------------------------------------------------------------ admission


def test_admission_admits_a_burst_then_the_rate_and_spaces_refusals_by_slots() -> None:
    adm = HandshakeAdmission(rate=10, burst=3)
    assert [adm.admit(0.0) for _ in range(3)] == [None, None, None]
    waits = [adm.admit(0.0) for _ in range(5)]
    # One slot per 1/rate from when the bucket next holds a token: 0.1, 0.2, ...
    assert waits == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert adm.admit(0.1) is None  # the token that refilled meanwhile
    assert adm.refused == 5 and adm.admitted == 4


def test_admission_retry_after_is_bounded() -> None:
    adm = HandshakeAdmission(rate=1, burst=1, max_retry_after=5)
    adm.admit(0.0)
    waits = [adm.admit(0.0) for _ in range(20)]
    assert max(w for w in waits if w is not None) <= 5
    with pytest.raises(ValueError):
        HandshakeAdmission(rate=0)


# ------------------------------------------------------------------ real sockets


@asynccontextmanager
async def tunnel_server(server: TunnelServer, port: int = 0) -> AsyncIterator[Endpoint]:
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(lambda task_status: serve(
            f"tcp://127.0.0.1:{port}", server.handle_transport, task_status=task_status))
        yield bound[0]
        nursery.cancel_scope.cancel()


def client(endpoint: Endpoint, node: str) -> TunnelClient:
    return TunnelClient(endpoint, hello=lambda: p.Hello(identity={"node": node}),
                        handler=None, settings=SETTINGS)


async def test_an_overloaded_server_tells_the_client_when_to_come_back(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    refused: list[str] = []
    server = TunnelServer(authenticate=node_from_hello, settings=SETTINGS,
                          admission=HandshakeAdmission(rate=2, burst=1),
                          on_refusal=refused.append)
    async with tunnel_server(server) as endpoint, trio.open_nursery() as nursery:
        first, second = client(endpoint, "edge-1"), client(endpoint, "edge-2")
        await nursery.start(first.run)
        with trio.fail_after(5):
            await first.wait_connected()
        started = trio.current_time()
        await nursery.start(second.run)
        with trio.fail_after(5):
            await second.wait_connected()
        waited = trio.current_time() - started
        print(f"\nthe second client waited {waited:.2f}s")
        assert second.status.connects == 1
        assert refused == ["overloaded"] and server.refusals["overloaded"] == 1
        assert server.handshake_failures == 0  # a refusal is not a failure
        nursery.cancel_scope.cancel()
    lines = fields_of(caplog, "agent handshake refused")
    assert len(lines) == 1 and lines[0]["reason"] == "overloaded"
    (failed,) = fields_of(caplog, "tunnel connect failed")
    assert failed["failure"] == "overloaded" and "server is busy" in failed["reason"]
    # Told when to come back (about 0.5 s: the next token at 2/s), it chose a delay in
    # [told, 1.5 * told] (the retry-after jitter): not the ~0.2 s of an unreachable
    # retry, not the backoff of a rejected one; and it did wait that long. The told
    # figure is logged to 0.1 s, hence the 0.05 s either side.
    told = float(re.search(r"come back in ([0-9.]+)s", str(failed["reason"]))[1])
    chosen = float(str(failed["retry_in"]).removesuffix("s"))
    assert told - 0.05 <= chosen <= (told + 0.05) * 1.5 + 0.005, failed
    assert waited >= chosen - 0.01, (waited, chosen)  # a lower bound: load only adds


def fields_of(caplog: pytest.LogCaptureFixture, message: str) -> list[dict[str, object]]:
    return [getattr(r, "nodeagent_fields", {}) for r in caplog.records
            if r.getMessage() == message]


async def test_a_draining_server_refuses_handshakes_as_shutting_down() -> None:
    server = TunnelServer(authenticate=node_from_hello, settings=SETTINGS)
    server.start_draining()
    async with tunnel_server(server) as endpoint, trio.open_nursery() as nursery:
        c = client(endpoint, "edge-1")
        await nursery.start(c.run)
        # Refused, it retries soon (0.1-0.2 s, 0.2-0.4 s, ...): a second failure comes
        # (30 s is a hang guard, not a timing of this shared machine).
        with trio.fail_after(30):
            while c.status.failures < 2:  # noqa: ASYNC110 - a counter, no event
                await trio.sleep(0.02)
        assert c.status.last_failure == "unreachable"  # retried soon: elsewhere, or later
        assert "shutting down" in (c.status.last_error or "")
        assert server.refusals["shutting_down"] >= 2 and not server.sessions
        nursery.cancel_scope.cancel()


async def test_client_is_back_within_a_second_of_the_server_returning_after_an_outage(
        caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listens for a while (connect refused): the client keeps retrying about
    every second, logging one line, and connects once the server listens. "About every
    second" is the delay it chose after its last failure, not a timing of this (shared,
    noisy) machine: a growing backoff would be past 1 s by the 6th failure."""
    port = free_port()
    endpoint = Endpoint("tcp", "127.0.0.1", port)
    c = client(endpoint, "edge-1")
    async with trio.open_nursery() as nursery:
        await nursery.start(c.run)
        with trio.fail_after(30):  # hang guard
            while c.status.failures < 6:  # noqa: ASYNC110 - a counter, no event
                await trio.sleep(0.05)
        assert c.status.last_failure == "unreachable"
        [row] = c.dialing()
        assert 0 < row["retry_in_seconds"] <= 1.0, row  # type: ignore[operator]
        server = TunnelServer(authenticate=node_from_hello, settings=SETTINGS)
        async with tunnel_server(server, port):
            back = trio.current_time()
            with trio.fail_after(30):  # hang guard
                await c.wait_connected()
            print(f"\nback {trio.current_time() - back:.2f}s after the server listened "
                  f"(its retry delay then: {row['retry_in_seconds']}s)")
            nursery.cancel_scope.cancel()
    failures = [r for r in caplog.records if r.getMessage() == "tunnel connect failed"]
    assert len(failures) == 1, [r.getMessage() for r in caplog.records]


def test_free_port_helper_gives_a_closed_port() -> None:
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", free_port()), timeout=1)


# ------------------------------------------------------------------ handshake races


async def test_frames_in_the_same_read_as_the_servers_hello_are_not_lost() -> None:
    """A server may open a stream the moment it registers an agent: its OPEN can arrive
    in the same read as its HELLO. The dialer used to drop it (the open timed out)."""
    ours, theirs = memory_transport_pair()
    dialer = TunnelConnection(ours, p.Role.DIALER, SETTINGS, echo_handler)
    server = p.Connection(p.Role.ACCEPTOR)
    async with trio.open_nursery() as nursery:
        async def serve_raw() -> None:
            server.receive_data(await theirs.receive())  # the HELLO
            server.accept_handshake(p.Hello(identity={"server": "s"}))
            sid = server.open_stream(p.Target("svc", 80))
            await theirs.send(server.data_to_send())  # HELLO + OPEN in one write
            events: list[p.Event] = []
            while not any(isinstance(e, p.StreamAccepted) for e in events):
                events += server.receive_data(await theirs.receive())
            server.send_data(sid, b"ping", end_stream=True)
            await theirs.send(server.data_to_send())
            got = b""
            while b"ping" not in got:
                got += b"".join(e.data for e in server.receive_data(await theirs.receive())
                                if isinstance(e, p.DataReceived))
            nursery.cancel_scope.cancel()

        nursery.start_soon(serve_raw)
        await dialer.dial_handshake(p.Hello(identity={"node": "edge-1"}))
        with trio.fail_after(5):
            await dialer.run()
