"""One suite every transport passes: tcp, tls, and ws/wss on both WebSocket cores.

Real sockets on 127.0.0.1 (and ::1), real TLS with certificates from nodeagent.trust.pki, the
real dial() and serve(). What the tunnel endpoints rely on: bytes arrive complete and in
order, a clean close reads as b"", a broken connection is a TransportError (never a
hang), a closed transport refuses to send, aclose() wakes a blocked receive, handshakes
are bounded in time, and TLS/WebSocket failures are DialErrors with a reason.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import random
import socket
import ssl
import struct
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
import websockets.frames
from cryptography.hazmat.primitives.serialization import Encoding

from nodeagent.trust import pki
from tunnel.accept import serve
from tunnel.dial import SO_MARK, dial
from tunnel.transports import (
    CLOSE_TIMEOUT,
    MAX_MESSAGE_SIZE,
    DialError,
    Endpoint,
    TLSStream,
    Transport,
    TransportClosed,
    TransportError,
    socket_of,
)
from tunnel.transports.tls import _detached, describe_error


@dataclass(frozen=True)
class Kind:
    scheme: str
    impl: str = "auto"

    @property
    def tls(self) -> bool:
        return self.scheme in ("tls", "wss")

    @property
    def websocket(self) -> bool:
        return self.scheme in ("ws", "wss")

    def url(self, host: str = "127.0.0.1", port: int = 0, path: str = "/tunnel") -> str:
        h = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{h}:{port}" + (path if self.websocket else "")

    def __str__(self) -> str:
        return self.scheme if self.impl == "auto" else f"{self.scheme}-{self.impl}"


KINDS = [Kind("tcp"), Kind("tls"), Kind("ws", "websockets"), Kind("ws", "wsproto"),
         Kind("wss", "websockets"), Kind("wss", "wsproto")]
TLS_KINDS = [k for k in KINDS if k.tls]
WS_KINDS = [k for k in KINDS if k.websocket]


@dataclass(frozen=True)
class Certs:
    ca: pki.CertificateAuthority
    server: pki.IssuedCertificate
    client: pki.IssuedCertificate
    other_ca: pki.CertificateAuthority
    stranger: pki.IssuedCertificate  # a client cert from other_ca

    def server_ctx(self, *, require_client_cert: bool = False) -> Any:
        return pki.server_ssl_context(
            self.server.certificate_pem, self.server.key_pem,
            client_ca=self.ca.certificate_pem if require_client_cert else None,
            require_client_cert=require_client_cert)

    def client_ctx(self, client: pki.IssuedCertificate | None = None,
                   ca: pki.CertificateAuthority | None = None) -> Any:
        return pki.client_ssl_context(
            (ca or self.ca).certificate_pem,
            client.certificate_pem if client else None, client.key_pem if client else None)


@pytest.fixture(scope="module")
def certs() -> Certs:
    ca = pki.create_ca("test CA")
    other = pki.create_ca("someone else's CA")
    return Certs(
        ca=ca,
        server=pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1", "::1"]),
        client=pki.issue_client_certificate(ca, "edge-1"),
        other_ca=other,
        stranger=pki.issue_client_certificate(other, "edge-1"),
    )


@pytest.fixture(params=KINDS, ids=str)
def kind(request: pytest.FixtureRequest) -> Kind:
    return request.param  # type: ignore[no-any-return]


@asynccontextmanager
async def served(kind: Kind, certs: Certs, handler: Callable[[Transport], Awaitable[None]], *,
                 host: str = "127.0.0.1", server_ctx: Any = None,
                 handshake_timeout: float = 10.0) -> AsyncIterator[Endpoint]:
    async with trio.open_nursery() as nursery:
        ctx = server_ctx if server_ctx is not None else (certs.server_ctx() if kind.tls else None)
        bound: list[Endpoint] = await nursery.start(partial(
            serve, kind.url(host), handler, ssl_context=ctx, websocket_impl=kind.impl,
            handshake_timeout=handshake_timeout))
        yield bound[0]
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def transport_pair(kind: Kind, certs: Certs, *, host: str = "127.0.0.1",
                         **dial_kwargs: Any) -> AsyncIterator[tuple[Transport, Transport]]:
    """(client, server) transports; both are closed afterwards."""
    send, receive = trio.open_memory_channel[Transport](1)
    release = trio.Event()

    async def handler(transport: Transport) -> None:
        await send.send(transport)
        await release.wait()

    async with served(kind, certs, handler, host=host) as endpoint:
        dial_kwargs.setdefault("ssl_context", certs.client_ctx() if kind.tls else None)
        client = await dial(endpoint, websocket_impl=kind.impl, **dial_kwargs)
        with trio.fail_after(5):
            server = await receive.receive()
        try:
            yield client, server
        finally:
            await client.aclose()
            release.set()


class LogWatch(logging.Handler):
    """Collects "tunnel.accept" records with one message; `event` is set on the first."""

    def __init__(self, message: str) -> None:
        super().__init__(logging.DEBUG)
        self.message = message
        self.records: list[logging.LogRecord] = []
        self.event = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == self.message:
            self.records.append(record)
            self.event.set()

    async def wait_for(self, count: int = 1) -> None:
        while len(self.records) < count:
            self.event = trio.Event()
            await self.event.wait()

    def fields(self) -> list[dict[str, Any]]:
        return [r.nodeagent_fields for r in self.records]  # type: ignore[attr-defined]


@contextmanager
def watch_log(message: str) -> Iterator[LogWatch]:
    logger = logging.getLogger("tunnel.accept")
    watch = LogWatch(message)
    level = logger.level
    logger.addHandler(watch)
    logger.setLevel(logging.DEBUG)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)


def abort(transport: Transport) -> None:
    """Kill the connection under a transport the rude way: TCP RST, no goodbye."""
    sock = socket_of(transport.stream)  # type: ignore[attr-defined]
    assert sock is not None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def truncate(transport: Transport) -> None:
    """Close the TCP connection with a FIN but without the TLS/WebSocket goodbye."""
    sock = socket_of(transport.stream)  # type: ignore[attr-defined]
    assert sock is not None
    sock.shutdown(socket.SHUT_RDWR)


async def read_all(transport: Transport, limit: int | None = None) -> bytes:
    out = bytearray()
    while limit is None or len(out) < limit:
        data = await transport.receive()
        if not data:
            break
        assert isinstance(data, bytes)
        out += data
    return bytes(out)


# --------------------------------------------------------------------------- data flow


async def test_large_transfer_both_ways_at_once(kind: Kind, certs: Certs) -> None:
    """32 MiB of random bytes each way, concurrently, in random-sized sends (1 B to 2.5
    MiB, so WebSocket sends above the message limit are split): complete, in order."""
    size = 32 * 1024 * 1024
    up, down = os.urandom(size), os.urandom(size)
    rng = random.Random(7)

    async def pump(t: Transport, data: bytes) -> None:
        view = memoryview(data)
        offset = 0
        while offset < len(data):
            n = rng.choice([1, 100, 4096, 65536, 300_000, 2_500_000])
            await t.send(view[offset:offset + n])
            offset += n

    results: dict[str, str] = {}

    async def sink(name: str, t: Transport) -> None:
        h = hashlib.sha256()
        total = 0
        while total < size:
            data = await t.receive()
            assert data, f"{name}: EOF after {total} bytes"
            h.update(data)
            total += len(data)
        assert total == size
        results[name] = h.hexdigest()

    async with transport_pair(kind, certs) as (client, server):
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, up)
                nursery.start_soon(pump, server, down)
                nursery.start_soon(sink, "up", server)
                nursery.start_soon(sink, "down", client)
    assert results["up"] == hashlib.sha256(up).hexdigest()
    assert results["down"] == hashlib.sha256(down).hexdigest()


async def test_concurrent_senders_never_interleave(kind: Kind, certs: Certs) -> None:
    """Several tasks send on one transport at once; each send arrives whole."""
    records = {task: [os.urandom(random.randint(1, 70_000)) for _ in range(40)]
               for task in range(4)}

    async def sender(t: Transport, task: int) -> None:
        for seq, payload in enumerate(records[task]):
            await t.send(struct.pack("!BHI", task, seq, len(payload)) + payload)

    async with transport_pair(kind, certs) as (client, server):
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for task in records:
                    nursery.start_soon(sender, client, task)
                buffer = bytearray()
                seen = {task: 0 for task in records}
                while sum(seen.values()) < sum(len(r) for r in records.values()):
                    buffer += await server.receive()
                    while len(buffer) >= 7:
                        task, seq, length = struct.unpack("!BHI", buffer[:7])
                        if len(buffer) < 7 + length:
                            break
                        assert seq == seen[task]
                        assert buffer[7:7 + length] == records[task][seq]
                        seen[task] += 1
                        del buffer[:7 + length]


async def test_peer_info(kind: Kind, certs: Certs) -> None:
    async with transport_pair(kind, certs) as (client, server):
        assert client.peer.address.startswith("127.0.0.1:")
        assert server.peer.address.startswith("127.0.0.1:")
        if kind.tls:  # the client verified the server's certificate
            assert client.peer.certificate_der == certs.server.certificate.public_bytes(
                Encoding.DER)
        assert server.peer.certificate_der is None  # no client certificate asked for
        if kind.websocket:
            assert ("host", f"127.0.0.1:{client.peer.address.rsplit(':', 1)[1]}") in \
                server.peer.headers


# ------------------------------------------------------------------------------ closing


async def test_clean_close_reads_as_eof(kind: Kind, certs: Certs) -> None:
    async with transport_pair(kind, certs) as (client, server):
        await server.send(b"last words")
        await server.aclose()
        with trio.fail_after(5):
            assert await read_all(client) == b"last words"
            assert await client.receive() == b""  # and stays at EOF
        # The other direction too.
    async with transport_pair(kind, certs) as (client, server):
        await client.send(b"bye")
        await client.aclose()
        with trio.fail_after(5):
            assert await read_all(server) == b"bye"


async def test_abrupt_close_is_an_error_not_a_hang(kind: Kind, certs: Certs) -> None:
    async with transport_pair(kind, certs) as (client, server):
        abort(server)
        with trio.fail_after(5), pytest.raises(TransportError):
            while await client.receive():
                pass


async def test_missing_goodbye(kind: Kind, certs: Certs) -> None:
    """TCP FIN without close_notify / close frame: plain TCP cannot tell, the others
    must call it an error (a truncation attack or a crashed peer, not a clean end)."""
    async with transport_pair(kind, certs) as (client, server):
        truncate(server)
        with trio.fail_after(5):
            if kind.scheme == "tcp":
                assert await client.receive() == b""
            else:
                with pytest.raises(TransportError) as info:
                    await client.receive()
                assert not isinstance(info.value, TransportClosed)


async def test_send_after_close(kind: Kind, certs: Certs) -> None:
    async with transport_pair(kind, certs) as (client, _server):
        await client.aclose()
        await client.aclose()  # idempotent
        with pytest.raises(TransportClosed):
            await client.send(b"too late")
        with pytest.raises(TransportClosed):
            await client.receive()


async def test_aclose_wakes_a_blocked_receive(kind: Kind, certs: Certs) -> None:
    """The endpoint's writer closes the transport to stop its reader: that must work."""
    async with transport_pair(kind, certs) as (client, _server):
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                async def reader() -> None:
                    with pytest.raises(TransportClosed):
                        await client.receive()
                nursery.start_soon(reader)
                await trio.sleep(0.1)
                await client.aclose()


async def test_aclose_during_a_blocked_send(kind: Kind, certs: Certs) -> None:
    """The peer stops reading, our send blocks on a full socket; aclose() from another
    task ends the send with an error and returns promptly."""
    async with transport_pair(kind, certs) as (client, _server):
        blocked = trio.Event()
        with trio.fail_after(CLOSE_TIMEOUT + 5):
            async with trio.open_nursery() as nursery:
                async def writer() -> None:
                    with pytest.raises(TransportError):
                        while True:
                            with trio.move_on_after(0.5) as scope:
                                await client.send(b"x" * 65536)
                            if scope.cancelled_caught:
                                blocked.set()
                                await client.send(b"x" * 65536)  # blocks again
                nursery.start_soon(writer)
                await blocked.wait()
                await trio.sleep(0.1)
                await client.aclose()


async def test_closing_one_end_while_the_other_sends_bulk(kind: Kind, certs: Certs) -> None:
    async with transport_pair(kind, certs) as (client, server):
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                async def writer() -> None:
                    with pytest.raises(TransportError):
                        while True:
                            await client.send(os.urandom(65536))
                nursery.start_soon(writer)
                await server.receive()
                abort(server)


# ------------------------------------------------------------------------- bad peers


def _frame(opcode: websockets.frames.Opcode, data: bytes, *, from_client: bool) -> bytes:
    return websockets.frames.Frame(opcode, data).serialize(mask=from_client)


@pytest.mark.parametrize("kind", WS_KINDS, ids=str)
@pytest.mark.parametrize("side", ["server-receives", "client-receives"])
async def test_text_message_is_an_error(kind: Kind, certs: Certs, side: str) -> None:
    async with transport_pair(kind, certs) as (client, server):
        sender, receiver = (client, server) if side == "server-receives" else (server, client)
        await sender.send(b"binary first")
        await sender.stream.send_all(  # type: ignore[attr-defined]
            _frame(websockets.frames.Opcode.TEXT, b"hello", from_client=sender is client))
        with trio.fail_after(5):
            assert await receiver.receive() == b"binary first"
            with pytest.raises(TransportError, match="text"):
                await receiver.receive()


@pytest.mark.parametrize("kind", WS_KINDS, ids=str)
@pytest.mark.parametrize("side", ["server-receives", "client-receives"])
async def test_oversized_message_is_an_error(kind: Kind, certs: Certs, side: str) -> None:
    async with transport_pair(kind, certs) as (client, server):
        sender, receiver = (client, server) if side == "server-receives" else (server, client)
        big = _frame(websockets.frames.Opcode.BINARY, b"\0" * (MAX_MESSAGE_SIZE + 1),
                     from_client=sender is client)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                # The receiver may give up before the whole frame is written.
                async def write() -> None:
                    try:
                        await sender.stream.send_all(big)  # type: ignore[attr-defined]
                    except trio.BrokenResourceError:
                        pass
                nursery.start_soon(write)
                with pytest.raises(TransportError, match="limit"):
                    await receiver.receive()
                nursery.cancel_scope.cancel()


@pytest.mark.parametrize("kind", WS_KINDS, ids=str)
async def test_empty_message_is_not_eof(kind: Kind, certs: Certs) -> None:
    async with transport_pair(kind, certs) as (client, server):
        await client.stream.send_all(  # type: ignore[attr-defined]
            _frame(websockets.frames.Opcode.BINARY, b"", from_client=True))
        await client.send(b"after")
        with trio.fail_after(5):
            assert await server.receive() == b"after"


@pytest.mark.parametrize("kind", WS_KINDS, ids=str)
async def test_pings_from_a_middlebox_are_answered(kind: Kind, certs: Certs) -> None:
    async with transport_pair(kind, certs) as (client, server):
        await server.stream.send_all(  # type: ignore[attr-defined]
            _frame(websockets.frames.Opcode.PING, b"lb-check", from_client=False))
        await server.send(b"data")
        with trio.fail_after(5):
            assert await client.receive() == b"data"
            raw = await server.stream.receive_some(65536)  # type: ignore[attr-defined]
        # A masked PONG frame (client to server) echoing the payload.
        assert raw[0] == 0x80 | websockets.frames.Opcode.PONG
        assert raw[1] == 0x80 | len(b"lb-check")
        mask = raw[2:6]
        assert bytes(b ^ mask[i % 4] for i, b in enumerate(raw[6:14])) == b"lb-check"


# --------------------------------------------------------------------------- handshakes


async def test_handshake_timeout_keeps_the_listener_healthy(kind: Kind, certs: Certs) -> None:
    """A client that connects and says nothing (or half a request) is dropped after the
    handshake timeout and logged; the next client is served as usual."""
    handled: list[Transport] = []

    async def handler(transport: Transport) -> None:
        handled.append(transport)
        await transport.send(b"welcome")

    with watch_log("handshake failed") as failures:
        async with served(kind, certs, handler, handshake_timeout=0.5) as endpoint:
            await _silent_client_then_a_good_one(kind, certs, endpoint, handled, failures)


async def _silent_client_then_a_good_one(kind: Kind, certs: Certs, endpoint: Endpoint,
                                         handled: list[Transport], failures: LogWatch) -> None:
    silent = await trio.open_tcp_stream(endpoint.host, endpoint.port)
    if kind.scheme == "ws":
        await silent.send_all(b"GET /tunnel HTTP/1.1\r\nHost: x\r\n")  # and stall
    if kind.scheme == "tcp":
        # Nothing to time out: plain TCP has no handshake; the handler runs at once.
        with trio.fail_after(5):
            assert await silent.receive_some() == b"welcome"
    else:
        with trio.fail_after(5):
            try:
                assert await silent.receive_some() == b""
            except trio.BrokenResourceError:
                pass  # reset: also fine
        assert not handled
        with trio.fail_after(5):  # logged just after the socket is closed
            await failures.wait_for(1)
        fields = failures.fields()[-1]
        assert fields["reason"] == "timeout"
        assert fields["peer"].startswith("127.0.0.1:")
    await silent.aclose()
    # The listener still works.
    client = await dial(endpoint, ssl_context=certs.client_ctx() if kind.tls else None,
                        websocket_impl=kind.impl)
    with trio.fail_after(5):
        assert await client.receive() == b"welcome"
    await client.aclose()


@pytest.mark.parametrize("kind", TLS_KINDS, ids=str)
async def test_mutual_tls(kind: Kind, certs: Certs) -> None:
    seen: list[Transport] = []

    async def handler(transport: Transport) -> None:
        seen.append(transport)
        await transport.send(b"hi")

    server_ctx = certs.server_ctx(require_client_cert=True)
    async with served(kind, certs, handler, server_ctx=server_ctx) as endpoint:
        # No certificate: refused, and the dialer learns it at dial time.
        with pytest.raises(DialError) as info:
            await dial(endpoint, ssl_context=certs.client_ctx(), websocket_impl=kind.impl,
                       connect_timeout=5)
        assert info.value.reason == "tls", info.value
        # A certificate from a CA the server does not trust: refused too.
        with pytest.raises(DialError) as info:
            await dial(endpoint, ssl_context=certs.client_ctx(certs.stranger),
                       websocket_impl=kind.impl, connect_timeout=5)
        assert info.value.reason == "tls", info.value
        assert not seen
        # The right one: the server sees it.
        client = await dial(endpoint, ssl_context=certs.client_ctx(certs.client),
                            websocket_impl=kind.impl)
        with trio.fail_after(5):
            assert await client.receive() == b"hi"
        await client.aclose()
    (server_side,) = seen
    der = server_side.peer.certificate_der
    assert der == certs.client.certificate.public_bytes(Encoding.DER)
    assert pki.node_name_from_certificate(der) == "edge-1"


@pytest.mark.parametrize("kind", TLS_KINDS, ids=str)
async def test_server_certificate_from_the_wrong_ca(kind: Kind, certs: Certs) -> None:
    async def handler(transport: Transport) -> None:
        raise AssertionError("no handshake should succeed")

    with watch_log("handshake failed") as failures, \
            trio.fail_after(10):
        async with served(kind, certs, handler) as endpoint:
            await _dial_with_wrong_expectations(kind, certs, endpoint)
            await failures.wait_for(2)
    assert all(f["reason"] == "tls" for f in failures.fields())


async def _dial_with_wrong_expectations(kind: Kind, certs: Certs, endpoint: Endpoint) -> None:
    with pytest.raises(DialError) as info:
        await dial(endpoint, ssl_context=certs.client_ctx(ca=certs.other_ca),
                   websocket_impl=kind.impl)
    assert info.value.reason == "tls"
    assert "certificate verify failed" in str(info.value)
    # And a hostname the certificate does not carry.
    with pytest.raises(DialError) as info:
        await dial(endpoint, ssl_context=certs.client_ctx(), server_hostname="other.test",
                   websocket_impl=kind.impl)
    assert info.value.reason == "tls"


@pytest.mark.parametrize("kind", WS_KINDS, ids=str)
async def test_websocket_wrong_path(kind: Kind, certs: Certs) -> None:
    async def handler(transport: Transport) -> None:
        raise AssertionError("not for this path")

    with watch_log("handshake failed") as failures:
        async with served(kind, certs, handler) as endpoint:
            wrong = Endpoint(endpoint.scheme, endpoint.host, endpoint.port, "/elsewhere")
            with pytest.raises(DialError) as info:
                await dial(wrong, ssl_context=certs.client_ctx() if kind.tls else None,
                           websocket_impl=kind.impl)
            assert info.value.reason == "http"
            assert "404" in str(info.value)
            with trio.fail_after(5):
                await failures.wait_for(1)
    assert failures.fields()[0]["reason"] == "not_found"


@pytest.mark.parametrize("kind", WS_KINDS, ids=str)
async def test_upgrade_headers_reach_the_server(kind: Kind, certs: Certs) -> None:
    headers = (("Authorization", "Bearer s3cret"), ("X-Node", "edge-1"))
    async with transport_pair(kind, certs, headers=headers) as (_client, server):
        assert ("authorization", "Bearer s3cret") in server.peer.headers
        assert ("x-node", "edge-1") in server.peer.headers


# ------------------------------------------------------------------------------ sockets


@pytest.mark.needs("root")  # SO_MARK needs CAP_NET_ADMIN
async def test_socket_mark_is_set_on_the_dialed_socket(kind: Kind, certs: Certs) -> None:
    async with transport_pair(kind, certs, socket_mark=0x4E41) as (client, server):
        sock = socket_of(client.stream)  # type: ignore[attr-defined]
        assert sock is not None
        assert sock.getsockopt(socket.SOL_SOCKET, SO_MARK) == 0x4E41
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        server_sock = socket_of(server.stream)  # type: ignore[attr-defined]
        assert server_sock is not None
        assert server_sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def _ipv6_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_available(), reason="no IPv6 loopback")
async def test_ipv6_loopback(kind: Kind, certs: Certs) -> None:
    async with transport_pair(kind, certs, host="::1") as (client, server):
        assert client.peer.address.startswith("[::1]:")
        assert server.peer.address.startswith("[::1]:")
        payload = os.urandom(3 * 1024 * 1024)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send, payload)
            with trio.fail_after(20):
                assert await read_all(server, len(payload)) == payload


# ----------------------------------------------------------------- TLSStream on its own


async def _tcp_pair() -> tuple[trio.abc.Stream, trio.abc.Stream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    try:
        port = listeners[0].socket.getsockname()[1]
        client = await trio.open_tcp_stream("127.0.0.1", port)
        server = await listeners[0].accept()
    finally:
        await trio.aclose_forcefully(listeners[0])
    return client, server


async def _lockstep_pair() -> tuple[trio.abc.Stream, trio.abc.Stream]:
    return trio.testing.lockstep_stream_pair()


async def _tls_pair(certs: Certs, raw_pair: Callable[[], Awaitable[tuple[
        trio.abc.Stream, trio.abc.Stream]]]) -> tuple[TLSStream, TLSStream]:
    client_raw, server_raw = await raw_pair()
    server_ctx = certs.server_ctx()
    # No TLS 1.3 session tickets: on a lockstep pair the server's ticket flight would
    # wait for a client read that never comes (the client's handshake is already done).
    server_ctx.num_tickets = 0
    client = TLSStream(client_raw, certs.client_ctx(), server_hostname="localhost")
    server = TLSStream(server_raw, server_ctx, server_side=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.do_handshake)
        nursery.start_soon(server.do_handshake)
    return client, server


async def test_tls_stream_passes_trios_stream_conformance(certs: Certs) -> None:
    """trio.testing.check_two_way_stream: over TCP, and over lockstep memory streams for
    the checks that need a clogged pipe. TLSStream has no send_eof (TLS has no
    half-close), so check_half_closeable_stream does not apply."""
    with trio.fail_after(60):
        await trio.testing.check_two_way_stream(partial(_tls_pair, certs, _tcp_pair),
                                                partial(_tls_pair, certs, _lockstep_pair))


async def test_tls_streams_receiving_into_the_shared_buffer_each_get_their_own_bytes(
        certs: Certs) -> None:
    """receive_shared() decrypts into one buffer for the process: two streams received
    at once, each through it (and a lockstep pair, whose reads wait), get exactly what
    their peer sent, in order, then the clean end (close_notify) as an empty view."""
    pairs = [await _tls_pair(certs, _tcp_pair), await _tls_pair(certs, _tcp_pair),
             await _tls_pair(certs, _lockstep_pair)]
    payloads = [os.urandom(3 * 1024 * 1024 + 17), os.urandom(2 * 1024 * 1024 + 5),
                os.urandom(200_000)]
    got: list[bytearray] = [bytearray() for _ in pairs]

    async def send(stream: TLSStream, payload: bytes) -> None:
        for offset in range(0, len(payload), 100_000):
            await stream.send_all(payload[offset:offset + 100_000])
        await stream.aclose()  # close_notify

    async def receive(stream: TLSStream, into: bytearray) -> None:
        while view := await stream.receive_shared(1024 * 1024):
            into += view  # copied before the next await, as the contract says
        await stream.aclose()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for (client, server), payload, into in zip(pairs, payloads, got, strict=True):
                nursery.start_soon(send, client, payload)
                nursery.start_soon(receive, server, into)
    assert [bytes(g) for g in got] == payloads


async def test_a_broken_tls_stream_is_freed_without_the_cyclic_gc(certs: Certs) -> None:
    """A TLSStream whose peer vanished, once closed and dropped, is freed by reference
    counting alone. It remembers the failure (later calls raise it as their cause), but
    not its traceback, whose frames hold the stream: that cycle kept each broken
    connection's TLS buffers until a full GC collection, rare in a quiet agent."""
    client, server = await _tls_pair(certs, _tcp_pair)
    await server.send_all(b"x" * 100_000)
    await trio.aclose_forcefully(server.transport_stream)  # no close_notify: a broken peer
    gc.disable()
    try:
        with pytest.raises(trio.BrokenResourceError):
            while await client.receive_some():
                pass
        with pytest.raises(trio.BrokenResourceError) as later:
            await client.send_all(b"y")
        assert isinstance(later.value.__cause__, ssl.SSLError)  # what broke it, still
        assert later.value.__cause__.__traceback__ is None
        del later
        await client.aclose()
        freed = weakref.ref(client)
        del client
        assert freed() is None
    finally:
        gc.enable()
        await server.aclose()


async def test_what_a_tls_stream_keeps_of_a_failure_has_no_traceback() -> None:
    def raised(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as caught:
            return caught

    reset = raised(ConnectionResetError(104, "Connection reset by peer"))
    broken = raised(trio.BrokenResourceError("socket connection broken"))
    broken.__cause__ = reset
    kept = _detached(broken)
    assert type(kept) is trio.BrokenResourceError and kept.__traceback__ is None
    assert type(kept.__cause__) is ConnectionResetError and kept.__cause__.errno == 104
    assert kept.__cause__.__traceback__ is None
    assert describe_error(kept) == "connection reset by peer"
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.sleep(1)
        except trio.Cancelled as exc:
            original, cancelled = exc, _detached(exc)  # a send cut short breaks it too
            raise
    assert scope.cancelled_caught
    assert cancelled is not original and type(cancelled) is trio.Cancelled
    assert original.__traceback__ is not None and cancelled.__traceback__ is None

    class Unbuildable(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(a + b)  # args cannot rebuild it

    odd = _detached(raised(Unbuildable(1, 2)))
    assert isinstance(odd, trio.BrokenResourceError) and "Unbuildable" in str(odd)


@pytest.mark.parametrize("raw_pair", [_tcp_pair, _lockstep_pair])
async def test_tls_stream_sends_pieces_unjoined_whole_and_in_order(
        certs: Certs, raw_pair: Callable[[], Awaitable[tuple[trio.abc.Stream,
                                                             trio.abc.Stream]]]) -> None:
    """send_pieces() and send_pieces_nowait() (the tunnel writer's frames, headers and
    payload views, encrypted where they lie): the peer gets exactly their concatenation,
    over TCP and over a lockstep pipe whose sends wait; what send_pieces_nowait() could
    not write goes first on the next send_pieces([])."""
    def frames(count: int) -> list[bytes | memoryview]:
        pieces: list[bytes | memoryview] = []
        for i in range(count):
            payload = os.urandom(65536 if i % 3 else 1000 + i)
            pieces += [struct.pack("!IBI", i, 0, i), memoryview(payload)]
        return pieces

    client, server = await _tls_pair(certs, raw_pair)
    batches = [frames(40), frames(3), frames(1), frames(17)]
    expected = b"".join(b"".join(bytes(p) for p in batch) for batch in batches)
    got = bytearray()

    async def send() -> None:
        for i, batch in enumerate(batches):
            if i % 2 and client.can_send_nowait():
                if not client.send_pieces_nowait(batch):
                    await client.send_pieces([])  # flushes what it left
            else:
                await client.send_pieces(batch)
            assert batch == []
        await client.aclose()

    async def receive() -> None:
        while view := await server.receive_shared(1024 * 1024):
            got.extend(view)
        await server.aclose()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            nursery.start_soon(receive)
    assert bytes(got) == expected
