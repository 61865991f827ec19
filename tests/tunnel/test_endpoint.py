"""The trio endpoint: a TunnelConnection pair over an in-memory transport, and (every test
that does not run on a virtual clock) again over real TLS on loopback sockets, where the
writer fast path (a stream's task sending straight into the socket) is taken."""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial

import pytest
import trio

from nodeagent.trust import pki
from tests.tunnel.memtransport import MemoryTransport, memory_transport_pair
from tunnel import protocol as p
from tunnel.accept import serve
from tunnel.dial import dial
from tunnel.endpoint import (
    AuthenticationFailed,
    EndpointSettings,
    HandshakeError,
    IncomingStream,
    StreamRefusedError,
    StreamResetError,
    TunnelConnection,
)
from tunnel.transports import PeerInfo, Transport

T = p.Target("svc", 80)


async def echo_handler(incoming: IncomingStream) -> None:
    stream = await incoming.accept()
    while data := await stream.receive_some():
        await stream.send_all(data)
    await stream.send_eof()


async def allow_all(hello: p.Hello, peer: PeerInfo) -> p.Hello:
    return p.Hello(identity={"server": "test"})


@dataclass
class Linked:
    dialer: TunnelConnection
    acceptor: TunnelConnection
    nursery: trio.Nursery


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Real sockets and a virtual clock do not mix: those tests run in memory only.
    if "wire" in metafunc.fixturenames:
        virtual = "autojump_clock" in metafunc.fixturenames
        metafunc.parametrize("wire", ["memory"] if virtual else ["memory", "tls", "tcp"],
                             indirect=True)


_WIRE = "memory"


@pytest.fixture(autouse=True)
def wire(request: pytest.FixtureRequest) -> Iterator[str]:
    global _WIRE
    _WIRE = str(request.param)
    yield _WIRE
    _WIRE = "memory"  # modules importing linked() get the in-memory pair


_CERTS: list[tuple[pki.CertificateAuthority, pki.IssuedCertificate]] = []


@asynccontextmanager
async def transports(nursery: trio.Nursery) -> AsyncIterator[tuple[Transport, Transport]]:
    if _WIRE == "memory":
        yield memory_transport_pair()
        return
    accepted = trio.Event()
    got: list[Transport] = []

    async def handler(transport: Transport) -> None:
        got.append(transport)
        accepted.set()
        await trio.sleep_forever()

    if _WIRE == "tcp":
        bound = await nursery.start(serve, "tcp://127.0.0.1:0", handler)
        client = await dial(bound[0])
    else:
        if not _CERTS:
            ca = pki.create_ca("endpoint test CA")
            _CERTS.append((ca, pki.issue_server_certificate(ca, ["localhost"],
                                                            ["127.0.0.1"])))
        ca, server = _CERTS[0]
        bound = await nursery.start(partial(
            serve, "tls://127.0.0.1:0", handler,
            ssl_context=pki.server_ssl_context(server.certificate_pem, server.key_pem)))
        client = await dial(bound[0], ssl_context=pki.client_ssl_context(ca.certificate_pem),
                            server_hostname="localhost")
    await accepted.wait()
    yield client, got[0]


@asynccontextmanager
async def linked(
    dialer_handler: Callable[[IncomingStream], Awaitable[None]] | None = None,
    acceptor_handler: Callable[[IncomingStream], Awaitable[None]] | None = echo_handler,
    settings: EndpointSettings | None = None,
    authenticate: Callable[[p.Hello, PeerInfo], Awaitable[p.Hello]] = allow_all,
) -> AsyncIterator[Linked]:
    # On real sockets the writer fast path is on: every test here checks it too.
    settings = replace(settings or EndpointSettings(ping_interval=0),
                       send_fast_path=_WIRE != "memory")
    async with trio.open_nursery() as nursery, transports(nursery) as (ta, tb):
        d = TunnelConnection(ta, p.Role.DIALER, settings, dialer_handler)
        a = TunnelConnection(tb, p.Role.ACCEPTOR, settings, acceptor_handler)
        nursery.start_soon(a.accept_handshake, authenticate)
        await d.dial_handshake(p.Hello(identity={"node": "edge-1"}))
        await nursery.start(d.run)
        await nursery.start(a.run)
        yield Linked(d, a, nursery)
        nursery.cancel_scope.cancel()


async def test_echo_both_directions_and_half_close() -> None:
    async with linked(dialer_handler=echo_handler) as link:
        assert link.acceptor.identity == {"node": "edge-1"}
        assert link.dialer.identity == {"server": "test"}
        for opener in (link.dialer, link.acceptor):
            stream = await opener.open_stream(T, {"origin": "1.2.3.4:5"})
            await stream.send_all(b"ping")
            await stream.send_eof()
            got = b""
            while chunk := await stream.receive_some():
                got += chunk
            assert got == b"ping"
            await stream.aclose()


async def test_bulk_transfer_is_complete_and_in_order() -> None:
    payload = os.urandom(8 * 1024 * 1024 + 123)
    async with linked() as link:
        stream = await link.dialer.open_stream(T)
        received = hashlib.sha256()
        count = 0

        async def reader() -> None:
            nonlocal count
            while chunk := await stream.receive_some(100_000):
                received.update(chunk)
                count += len(chunk)

        async with trio.open_nursery() as n:
            n.start_soon(reader)
            await stream.send_all(payload)
            await stream.send_eof()
        assert count == len(payload)
        assert received.digest() == hashlib.sha256(payload).digest()


async def test_stalled_reader_does_not_block_sibling_stream() -> None:
    stalled_got = trio.Event()

    async def sink_that_never_reads(incoming: IncomingStream) -> None:
        await incoming.accept()
        stalled_got.set()
        await trio.sleep_forever()

    async def handler(incoming: IncomingStream) -> None:
        if incoming.target.port == 1:
            await sink_that_never_reads(incoming)
        else:
            await echo_handler(incoming)

    async with linked(acceptor_handler=handler) as link:
        stalled = await link.dialer.open_stream(p.Target("svc", 1))
        with trio.move_on_after(1) as scope:
            await stalled.send_all(b"x" * (4 * 1024 * 1024))  # more than its window
        assert scope.cancelled_caught, "a 4 MiB send into a stalled stream cannot finish"
        busy = await link.dialer.open_stream(p.Target("svc", 2))
        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                async def drain() -> None:
                    total = 0
                    while chunk := await busy.receive_some():
                        total += len(chunk)
                    assert total == 16 * 1024 * 1024
                n.start_soon(drain)
                await busy.send_all(b"y" * (16 * 1024 * 1024))
                await busy.send_eof()


async def test_refusal_reason_reaches_the_opener() -> None:
    async def refuse(incoming: IncomingStream) -> None:
        await incoming.refuse(p.StreamReason.FORBIDDEN, "svc:80 is not in the allow list")

    async with linked(acceptor_handler=refuse) as link:
        with pytest.raises(StreamRefusedError) as info:
            await link.dialer.open_stream(T)
        assert info.value.reason is p.StreamReason.FORBIDDEN
        assert "allow list" in info.value.message


async def test_handler_that_never_answers_gets_refused_internal() -> None:
    async def broken(incoming: IncomingStream) -> None:
        raise_it = False
        if not raise_it:
            return

    async with linked(acceptor_handler=broken) as link:
        with pytest.raises(StreamRefusedError) as info:
            await link.dialer.open_stream(T)
        assert info.value.reason is p.StreamReason.INTERNAL


async def test_open_cancelled_while_the_handler_dials_is_a_reset_not_a_crash(
        caplog: pytest.LogCaptureFixture) -> None:
    # The opener gives up while the acceptor's handler is still dialing its target: the
    # handler's accept() raises StreamResetError (a BrokenResourceError: routine), the
    # connection and its other streams carry on, and nothing is logged as a failure.
    dialing = trio.Event()
    dialed = trio.Event()
    answered = trio.Event()
    outcome: list[BaseException] = []
    opened: list[int] = []

    async def slow_dial(incoming: IncomingStream) -> None:
        if incoming.target.port != 81:
            await echo_handler(incoming)
            return
        opened.append(incoming.stream.stream_id)
        dialing.set()
        await dialed.wait()
        try:
            await incoming.accept()
        except StreamResetError as exc:
            outcome.append(exc)
            raise
        finally:
            answered.set()

    async with linked(acceptor_handler=slow_dial) as link:
        with trio.move_on_after(5) as scope:
            async with trio.open_nursery() as nursery:
                async def give_up() -> None:
                    await dialing.wait()
                    opening.cancel()
                opening = trio.CancelScope()
                nursery.start_soon(give_up)
                with opening:
                    await link.dialer.open_stream(p.Target("svc", 81))
        assert not scope.cancelled_caught
        for _ in range(500):  # the RST crosses a real socket on the TCP wire
            if not link.acceptor._core.has_stream(opened[0]):
                break
            await trio.sleep(0.01)
        dialed.set()
        with trio.fail_after(5):
            await answered.wait()
        assert isinstance(outcome[0], StreamResetError)
        stream = await link.dialer.open_stream(T)
        await stream.send_all(b"after")
        assert await stream.receive_some() == b"after"
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


async def test_connection_end_resets_every_stream() -> None:
    async with linked() as link:
        stream = await link.dialer.open_stream(T)
        await link.acceptor.aclose(p.ErrorCode.SHUTTING_DOWN, "server stopping")
        with trio.fail_after(5), pytest.raises(StreamResetError) as info:
            await stream.receive_some()
        assert "server stopping" in str(info.value)
        await link.dialer.wait_finished()
        assert link.dialer.end_reason is not None
        assert link.dialer.end_reason.code is p.ErrorCode.SHUTTING_DOWN


async def test_unauthorized_handshake_fails_on_both_sides() -> None:
    async def deny(hello: p.Hello, peer: PeerInfo) -> p.Hello:
        raise AuthenticationFailed(f"unknown token for node {hello.identity.get('node')}")

    ta, tb = memory_transport_pair()
    d = TunnelConnection(ta, p.Role.DIALER)
    a = TunnelConnection(tb, p.Role.ACCEPTOR)
    errors: list[HandshakeError] = []

    async def acceptor() -> None:
        try:
            await a.accept_handshake(deny)
        except HandshakeError as exc:
            errors.append(exc)

    async with trio.open_nursery() as n:
        n.start_soon(acceptor)
        with pytest.raises(HandshakeError) as info:
            await d.dial_handshake(p.Hello(identity={"node": "edge-9"}))
    assert info.value.code is p.ErrorCode.UNAUTHORIZED
    assert "unknown token for node edge-9" in str(info.value)
    assert errors and errors[0].code is p.ErrorCode.UNAUTHORIZED


async def test_keepalive_detects_a_silent_peer(autojump_clock: trio.abc.Clock) -> None:
    ta, tb = memory_transport_pair()
    settings = EndpointSettings(ping_interval=5, ping_timeout=3)
    d = TunnelConnection(ta, p.Role.DIALER, settings)
    a = TunnelConnection(tb, p.Role.ACCEPTOR, settings)
    async with trio.open_nursery() as n:
        n.start_soon(a.accept_handshake, allow_all)
        await d.dial_handshake(p.Hello())
        # The acceptor never runs its reader: it is "frozen" (a dead NAT mapping).
        with trio.fail_after(30):
            await d.run()
    assert d.end_reason is not None
    assert d.end_reason.code is p.ErrorCode.KEEPALIVE_TIMEOUT


async def test_keepalive_waits_while_the_peer_sends_but_its_answer_is_late(
        autojump_clock: trio.abc.Clock) -> None:
    """A lossy path with a bulk transfer queues the PING's answer behind seconds of data:
    bytes still arriving prove the peer alive, so the tunnel (and the transfer) stays up;
    once they stop, the keepalive ends it one timeout later."""
    ta, tb = memory_transport_pair()
    settings = EndpointSettings(ping_interval=5, ping_timeout=3)
    d = TunnelConnection(ta, p.Role.DIALER, settings)
    a = TunnelConnection(tb, p.Role.ACCEPTOR, EndpointSettings(ping_interval=0))
    async with trio.open_nursery() as n:
        n.start_soon(a.accept_handshake, allow_all)
        await d.dial_handshake(p.Hello())
        ended = trio.Event()

        async def run_dialer() -> None:
            try:
                await d.run()
            finally:
                ended.set()

        n.start_soon(run_dialer)
        # The acceptor never reads (so never answers) but sends a frame every second
        # for 20 s: its own PINGs stand for the data it sends.
        for i in range(20):
            a._core.ping(struct.pack("!Q", i))
            await tb.send(a._core.data_to_send())
            await trio.sleep(1)
            assert d.is_open, f"closed after {i + 1} s of traffic"
        started = trio.current_time()
        with trio.fail_after(30):
            await ended.wait()
        assert trio.current_time() - started <= 2 * settings.ping_timeout
    assert d.end_reason is not None
    assert d.end_reason.code is p.ErrorCode.KEEPALIVE_TIMEOUT


class _LossyPathTransport(MemoryTransport):
    """A dialer's end whose bytes (its PINGs among them) wait in TCP's retransmission
    queue: the peer's TCP acknowledges a segment every `every` seconds until `until`
    (a path at 20 % loss), then nothing more (the path died)."""

    def __init__(self, inner: MemoryTransport, every: float, until: float) -> None:
        super().__init__(inner._stream, "dialer")
        self.every, self.until = every, until

    def unacknowledged_wait(self) -> float | None:
        now = trio.current_time()
        last_ack = min(now - now % self.every, self.until)
        return now - last_ack


async def test_keepalive_waits_while_the_peers_tcp_still_acknowledges(
        autojump_clock: trio.abc.Clock) -> None:
    """At 20 % loss TCP's retransmission timer backs off past the keepalive timeout: no
    byte arrives for 37 s while our own, the PING among them, wait to be retransmitted
    (the peer cannot answer a PING it has not received). The peer's TCP acknowledging
    now and then proves it alive: the tunnel stays up (before: closed after one timeout,
    and the download through it cut short); once acknowledgements stop too (a dead
    path), it ends one timeout later."""
    ta, tb = memory_transport_pair()
    settings = EndpointSettings(ping_interval=1, ping_timeout=3)
    lossy = _LossyPathTransport(ta, every=2.0, until=40.0)
    d = TunnelConnection(lossy, p.Role.DIALER, settings)
    a = TunnelConnection(tb, p.Role.ACCEPTOR, settings)
    async with trio.open_nursery() as n:
        n.start_soon(a.accept_handshake, allow_all)
        await d.dial_handshake(p.Hello())
        # The acceptor never runs its reader: nothing comes back, as on the stalled path.
        with trio.fail_after(60):
            await d.run()
        ended = trio.current_time()
    assert d.end_reason is not None
    assert d.end_reason.code is p.ErrorCode.KEEPALIVE_TIMEOUT
    assert lossy.until <= ended <= lossy.until + settings.ping_timeout + 1, ended


async def test_keepalive_measures_rtt(autojump_clock: trio.abc.Clock) -> None:
    async with linked(settings=EndpointSettings(ping_interval=1, ping_timeout=1)) as link:
        await trio.sleep(2.5)
        assert link.dialer.rtt is not None and link.dialer.rtt >= 0
        assert link.dialer.is_open


async def test_goaway_lets_running_streams_finish() -> None:
    async with linked() as link:
        running = await link.dialer.open_stream(T)
        link.acceptor.goaway("rolling update")
        with trio.fail_after(5):
            await link.dialer.goaway_received.wait()
        with pytest.raises(StreamRefusedError) as info:
            await link.dialer.open_stream(T)
        assert info.value.reason is p.StreamReason.DRAINING
        await running.send_all(b"still works")
        await running.send_eof()
        assert await running.receive_some() == b"still works"
        assert await running.receive_some() == b""
        await running.aclose()
        with trio.fail_after(5):
            await link.acceptor.wait_idle()


async def test_open_rate_limit_refuses_as_overloaded(autojump_clock: trio.abc.Clock) -> None:
    settings = EndpointSettings(ping_interval=0, open_rate=5)
    async with linked(settings=settings) as link:
        outcomes = []
        for _ in range(30):
            try:
                s = await link.dialer.open_stream(T)
                outcomes.append("ok")
                await s.aclose()
            except StreamRefusedError as exc:
                outcomes.append(exc.reason.name)
        assert outcomes.count("ok") == 10  # the burst (2 x rate)
        assert outcomes.count("OVERLOADED") == 20
        await trio.sleep(1)
        s = await link.dialer.open_stream(T)  # refilled
        await s.aclose()


async def test_closing_with_unread_data_returns_credit() -> None:
    """Data the app never read must not leak connection credit."""
    settings = EndpointSettings(ping_interval=0, protocol=p.Settings(
        connection_window=256 * 1024, initial_stream_window=128 * 1024))

    async def blast(incoming: IncomingStream) -> None:
        stream = await incoming.accept()
        try:
            await stream.send_all(b"z" * 128 * 1024)
        except StreamResetError:
            pass

    async with linked(acceptor_handler=blast, settings=settings) as link:
        with trio.fail_after(10):
            for _ in range(20):  # 20 x 128 KiB >> the 256 KiB connection window
                stream = await link.dialer.open_stream(T)
                await stream.receive_some(1)
                await stream.aclose()
        assert link.dialer._core.unacked_bytes == 0


async def test_small_sends_go_out_without_the_transports_async_send(wire: str) -> None:
    """On a socket (TLS or TCP) the writer writes small sends synchronously
    (`send_nowait`: no lock, no checkpoint); in memory it awaits the transport's send."""
    async with linked() as link:
        transport = link.dialer.transport
        awaited = 0
        send = transport.send

        async def counting_send(data: bytes | bytearray | memoryview) -> None:
            nonlocal awaited
            awaited += 1
            await send(data)

        transport.send = counting_send  # type: ignore[method-assign]
        stream = await link.dialer.open_stream(T)
        for _ in range(20):
            await stream.send_all(b"ping")
            with trio.fail_after(5):
                assert await stream.receive_some() == b"ping"
        await stream.send_eof()
        with trio.fail_after(5):
            assert await stream.receive_some() == b""
        if wire == "memory":
            assert awaited >= 20
        else:
            assert awaited == 0


async def test_cancelled_senders_leave_the_connection_intact() -> None:
    """Stream tasks cancelled at random points in their sends, big and small, while the
    socket is full: no record or frame is ever cut, so every other stream's bytes still
    arrive whole and a new stream works afterwards."""
    async with linked() as link:
        async def victim(seed: int) -> None:
            stream = await link.dialer.open_stream(T)
            with trio.move_on_after(0.001 * (seed % 7)):
                for i in range(50):
                    await stream.send_all(os.urandom(1 + (seed * 7919 + i * 104729) % 300_000))
            await stream.aclose()

        async def survivor(results: list[bool]) -> None:
            stream = await link.dialer.open_stream(T)
            payload = os.urandom(2 * 1024 * 1024)
            got = hashlib.sha256()

            async def read() -> None:
                while chunk := await stream.receive_some():
                    got.update(chunk)

            async with trio.open_nursery() as n:
                n.start_soon(read)
                await stream.send_all(payload)
                await stream.send_eof()
            results.append(got.digest() == hashlib.sha256(payload).digest())

        results: list[bool] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for seed in range(24):
                    n.start_soon(victim, seed)
                for _ in range(3):
                    n.start_soon(survivor, results)
        assert results == [True, True, True]
        assert link.dialer.is_open and link.acceptor.is_open
        stream = await link.dialer.open_stream(T)
        await stream.send_all(b"after")
        with trio.fail_after(5):
            assert await stream.receive_some() == b"after"
