"""The WebSocket opening handshake on both cores and both sides, over in-memory streams.

What the peer sees (the 101, a 404 with its body, a 4xx for a bad request), what our side
raises (message, reason, status), the size limit, and messages that arrive in the same
read as the end of the handshake. A scripted peer speaks raw HTTP, so every branch of the
read loop is reached without a socket.
"""

from __future__ import annotations

import base64
import hashlib
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, get_args

import pytest
import trio
import trio.testing
import websockets.frames

from tunnel.transports import (
    MAX_HANDSHAKE_SIZE,
    PeerInfo,
    WebSocketHandshakeError,
    WebSocketImpl,
    WebSocketTransport,
    websocket_accept,
    websocket_connect,
)

IMPLS: tuple[WebSocketImpl, ...] = get_args(WebSocketImpl)
PEER = PeerInfo(address="192.0.2.1:1234")

REQUEST = (b"GET /tunnel HTTP/1.1\r\nHost: tunnel.example\r\nUpgrade: websocket\r\n"
           b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
           b"Sec-WebSocket-Version: 13\r\nX-Node: edge-1\r\n\r\n")
RESPONSE = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\n")  # + the Sec-WebSocket-Accept for the client's key


def frame(data: bytes, *, from_client: bool) -> bytes:
    return websockets.frames.Frame(websockets.frames.Opcode.BINARY, data).serialize(
        mask=from_client)


async def read_all(stream: trio.abc.Stream) -> bytes:
    out = bytearray()
    while data := await stream.receive_some():
        out += data
    return bytes(out)


async def run_side(side: Callable[[], Awaitable[WebSocketTransport]],
                   peer: Callable[[trio.abc.Stream], Awaitable[Any]],
                   peer_stream: trio.abc.Stream) -> tuple[WebSocketTransport | Exception, Any]:
    """Run our side and a scripted peer at once; our result (or error) and the peer's."""
    ours: list[WebSocketTransport | Exception] = []
    theirs: list[Any] = []

    async def run_ours() -> None:
        try:
            ours.append(await side())
        except WebSocketHandshakeError as exc:
            ours.append(exc)

    async def run_theirs() -> None:
        theirs.append(await peer(peer_stream))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_ours)
            nursery.start_soon(run_theirs)
    return ours[0], theirs[0]


def accept_on(stream: trio.abc.Stream, impl: WebSocketImpl,
              path: str = "/tunnel") -> Callable[[], Awaitable[WebSocketTransport]]:
    async def side() -> WebSocketTransport:
        try:
            return await websocket_accept(stream, impl=impl, path=path, peer=PEER)
        except WebSocketHandshakeError:
            await stream.send_stream.aclose()  # type: ignore[attr-defined]
            raise
    return side


def connect_on(stream: trio.abc.Stream,
               impl: WebSocketImpl) -> Callable[[], Awaitable[WebSocketTransport]]:
    return lambda: websocket_connect(stream, impl=impl, host="tunnel.example", port=443,
                                     path="/tunnel", secure=True, peer=PEER,
                                     headers=[("X-Node", "edge-1")])


# ------------------------------------------------------------------------ both ours


@pytest.mark.parametrize("server_impl", IMPLS)
@pytest.mark.parametrize("client_impl", IMPLS)
async def test_every_pair_of_cores_upgrades_and_talks(client_impl: WebSocketImpl,
                                                      server_impl: WebSocketImpl) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    server, client = await run_side(accept_on(server_stream, server_impl),
                                    lambda _: connect_on(client_stream, client_impl)(),
                                    client_stream)
    assert isinstance(server, WebSocketTransport)
    assert server.peer.address == PEER.address
    headers = dict(server.peer.headers)
    assert headers["host"] == "tunnel.example"
    assert headers["x-node"] == "edge-1"
    with trio.fail_after(5):
        await client.send(b"up")
        assert await server.receive() == b"up"
        await server.send(b"down")
        assert await client.receive() == b"down"


# -------------------------------------------------------------- server side, raw client


def raw_client(request: bytes, *, eof: bool = True
               ) -> Callable[[trio.abc.Stream], Awaitable[bytes]]:
    """Sends the request (and EOF); returns all the server answered."""
    async def peer(stream: trio.abc.Stream) -> bytes:
        await stream.send_all(request)
        if eof:
            await stream.send_stream.aclose()  # type: ignore[attr-defined]
        return await read_all(stream)
    return peer


# A client must wait for the 101 before it sends frames (RFC 6455 4.1); websockets' core
# keeps frames sent early anyway, wsproto's server drops them (it does not hand the bytes
# after the request to its frame parser), so this holds for websockets only.
@pytest.mark.parametrize("impl", ["websockets"])
async def test_server_takes_a_message_that_came_with_the_request(impl: WebSocketImpl) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    server, _ = await run_side(
        accept_on(server_stream, impl),
        lambda s: s.send_all(REQUEST + frame(b"early", from_client=True)), client_stream)
    assert isinstance(server, WebSocketTransport)
    assert dict(server.peer.headers)["x-node"] == "edge-1"
    with trio.fail_after(5):
        assert await server.receive() == b"early"
        answer = await client_stream.receive_some()
    assert answer.startswith(b"HTTP/1.1 101 ")
    assert b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in answer  # RFC 6455's example key's answer


@pytest.mark.parametrize("impl", IMPLS)
async def test_server_answers_404_for_another_path(impl: WebSocketImpl) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    error, answer = await run_side(
        accept_on(server_stream, impl, path="/other?x=1"),
        raw_client(REQUEST, eof=False), client_stream)
    assert isinstance(error, WebSocketHandshakeError)
    assert str(error) == "upgrade request for unknown path /tunnel"
    assert (error.status, error.reason) == (404, "http")
    assert answer.startswith(b"HTTP/1.1 404 ")
    assert answer.endswith(b"\r\n\r\nNo WebSocket endpoint at /tunnel\n")


@pytest.mark.parametrize("impl", IMPLS)
async def test_server_answers_a_plain_http_request_with_an_error(impl: WebSocketImpl) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    error, answer = await run_side(
        accept_on(server_stream, impl),
        raw_client(b"GET /tunnel HTTP/1.1\r\nHost: x\r\n\r\n", eof=False), client_stream)
    assert isinstance(error, WebSocketHandshakeError)
    assert error.reason == "http"
    if impl == "websockets":
        assert str(error) == "invalid WebSocket upgrade request: missing Connection header"
        assert error.status == 426
        assert answer.startswith(b"HTTP/1.1 426 Upgrade Required\r\n")
    else:
        assert str(error) == ("invalid HTTP upgrade request: Missing header, "
                              "'Connection: Upgrade'")
        assert error.status is None
        assert answer == b"HTTP/1.1 400 \r\ncontent-length: 0\r\n\r\n"


@pytest.mark.parametrize("impl", IMPLS)
async def test_server_rejects_garbage(impl: WebSocketImpl) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    error, answer = await run_side(
        accept_on(server_stream, impl),
        raw_client(b"\x16\x03\x01 not http at all\r\n\r\n"), client_stream)
    assert isinstance(error, WebSocketHandshakeError)
    assert str(error).startswith("invalid HTTP upgrade request: ")
    assert error.reason == "http"
    # wsproto answers 400; websockets just closes (its parser gives up before a request).
    bad_request = b"HTTP/1.1 400 \r\ncontent-length: 0\r\n\r\n"
    assert answer == (b"" if impl == "websockets" else bad_request)


# Each core's word for a request that ends early: only a clean EOF before the first byte
# reaches our own "closed" (wsproto); websockets calls any EOF an invalid request.
SERVER_HANGUP = {
    ("websockets", 0): ("invalid HTTP upgrade request: did not receive a valid HTTP request",
                        "http"),
    ("websockets", 40): ("invalid HTTP upgrade request: did not receive a valid HTTP request",
                         "http"),
    ("wsproto", 0): ("client closed the connection before finishing the upgrade request",
                     "closed"),
    ("wsproto", 40): ("invalid HTTP upgrade request: Bad HTTP message", "http"),
}


@pytest.mark.parametrize("cut", [0, 40])
@pytest.mark.parametrize("impl", IMPLS)
async def test_server_when_the_client_hangs_up(impl: WebSocketImpl, cut: int) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    error, _ = await run_side(accept_on(server_stream, impl),
                              raw_client(REQUEST[:cut]), client_stream)
    assert isinstance(error, WebSocketHandshakeError)
    assert (str(error), error.reason) == SERVER_HANGUP[impl, cut]


@pytest.mark.parametrize("impl", IMPLS)
async def test_server_gives_up_on_an_endless_request(impl: WebSocketImpl) -> None:
    """Headers that never end: the read stops near MAX_HANDSHAKE_SIZE (or earlier, where
    the core has a tighter limit of its own)."""
    client_stream, server_stream = trio.testing.memory_stream_pair()
    line = b"X-Pad: " + b"a" * 4000 + b"\r\n"
    request = REQUEST[:-2] + line * (2 * MAX_HANDSHAKE_SIZE // len(line))
    error, _ = await run_side(accept_on(server_stream, impl),
                              raw_client(request, eof=False), client_stream)
    assert isinstance(error, WebSocketHandshakeError)
    assert error.reason == "http"
    if impl == "websockets":
        assert str(error) == f"HTTP upgrade larger than {MAX_HANDSHAKE_SIZE} bytes"


# -------------------------------------------------------------- client side, raw server


def raw_server(answer: Callable[[bytes], bytes], *, eof: bool = True
               ) -> Callable[[trio.abc.Stream], Awaitable[bytes]]:
    """Reads the request, sends answer(request) (and EOF); returns the request."""
    async def peer(stream: trio.abc.Stream) -> bytes:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some()
        await stream.send_all(answer(request))
        if eof:
            await stream.send_stream.aclose()  # type: ignore[attr-defined]
        return request
    return peer


def switching(request: bytes) -> bytes:
    key = next(line.split(b":", 1)[1].strip() for line in request.split(b"\r\n")
               if line.lower().startswith(b"sec-websocket-key:"))
    accept = base64.b64encode(hashlib.sha1(
        key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    return RESPONSE + b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"


@pytest.mark.parametrize("impl", IMPLS)
async def test_client_takes_a_message_that_came_with_the_101(impl: WebSocketImpl) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    client, request = await run_side(
        connect_on(client_stream, impl),
        raw_server(lambda r: switching(r) + frame(b"early", from_client=False), eof=False),
        server_stream)
    assert isinstance(client, WebSocketTransport)
    assert request.startswith(b"GET /tunnel HTTP/1.1\r\n")
    assert b"\r\nhost: tunnel.example\r\n" in request.lower()  # 443 is the default port
    assert b"\r\nx-node: edge-1\r\n" in request.lower()
    with trio.fail_after(5):
        assert await client.receive() == b"early"


@pytest.mark.parametrize("impl", IMPLS)
async def test_client_reports_the_servers_refusal(impl: WebSocketImpl) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    error, _ = await run_side(
        connect_on(client_stream, impl),
        raw_server(lambda _: b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n"),
        server_stream)
    assert isinstance(error, WebSocketHandshakeError)
    assert str(error).startswith("server answered HTTP 403 ")
    assert str(error).endswith(" to the WebSocket upgrade for /tunnel")
    assert (error.status, error.reason) == (403, "http")


@pytest.mark.parametrize("impl", IMPLS)
async def test_client_rejects_a_101_with_the_wrong_accept_key(impl: WebSocketImpl) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    error, _ = await run_side(
        connect_on(client_stream, impl),
        raw_server(lambda _: RESPONSE + b"Sec-WebSocket-Accept: bm9wZQ==\r\n\r\n"),
        server_stream)
    assert isinstance(error, WebSocketHandshakeError)
    assert str(error).startswith("invalid WebSocket upgrade response: ")
    assert (error.status, error.reason) == (None, "http")


# Both cores call a response that ends early (or never starts) invalid.
CLIENT_HANGUP = {
    ("websockets", 0): ("invalid WebSocket upgrade response: did not receive a valid HTTP "
                        "response", "http"),
    ("websockets", 30): ("invalid WebSocket upgrade response: did not receive a valid HTTP "
                         "response", "http"),
    ("wsproto", 0): ("invalid WebSocket upgrade response: Bad HTTP message", "http"),
    ("wsproto", 30): ("invalid WebSocket upgrade response: Bad HTTP message", "http"),
}


@pytest.mark.parametrize("cut", [0, 30])
@pytest.mark.parametrize("impl", IMPLS)
async def test_client_when_the_server_hangs_up(impl: WebSocketImpl, cut: int) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    error, _ = await run_side(connect_on(client_stream, impl),
                              raw_server(lambda r: switching(r)[:cut]), server_stream)
    assert isinstance(error, WebSocketHandshakeError)
    assert (str(error), error.reason) == CLIENT_HANGUP[impl, cut]


def real_ssl_error() -> ssl.SSLError:
    """What the ssl module raises when the peer does not speak TLS."""
    incoming = ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, ssl.MemoryBIO(),
                                                server_hostname="x")
    incoming.write(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 4)
    try:
        tls.do_handshake()
    except ssl.SSLError as exc:
        return exc
    raise AssertionError("garbage passed for a TLS handshake")


@pytest.mark.parametrize(("cause", "reason", "phrase"), [
    (real_ssl_error(), "tls", "tls: wrong_version_number"),
    (ConnectionResetError(104, "Connection reset by peer"), "closed",
     "connection reset by peer"),
])
@pytest.mark.parametrize("impl", IMPLS)
async def test_client_when_the_connection_breaks(impl: WebSocketImpl, cause: OSError,
                                                 reason: str, phrase: str) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()

    async def broken() -> None:
        raise trio.BrokenResourceError("broken") from cause

    client_stream.receive_stream.receive_some_hook = broken
    error, request = await run_side(connect_on(client_stream, impl),
                                    lambda s: s.receive_some(), server_stream)
    assert request.startswith(b"GET /tunnel ")
    assert isinstance(error, WebSocketHandshakeError)
    assert str(error).startswith(f"connection failed during the HTTP upgrade: {phrase}")
    assert (error.status, error.reason) == (None, reason)
    assert error.__cause__ is not None
