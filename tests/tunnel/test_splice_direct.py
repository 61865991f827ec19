"""splice() of a tunnel stream and a real TCP socket: the direct way tunnel → socket (the
connection's reader writes into the socket; see tunnel/splice.py) keeps every property of
the task-per-direction way — integrity, half-close both ways, backpressure at the stream's
window, resets both ways, credit returned when a stream dies — with real sockets."""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio

from tests.tunnel.test_endpoint import T, echo_handler, linked
from tunnel import protocol as p
from tunnel.endpoint import IncomingStream, StreamResetError, TunnelConnection
from tunnel.splice import SpliceResult, splice

WINDOW = p.Settings().initial_stream_window
CONNECTION_WINDOW = p.Settings().connection_window


@asynccontextmanager
async def socket_pair(small_buffers: bool = False
                      ) -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    """A connected pair of real TCP sockets on loopback: (the relay's end, the target's).
    `small_buffers` shrinks the kernel buffers so a target that stops reading is felt
    within a few hundred KiB rather than megabytes."""
    listener = socket.create_server(("127.0.0.1", 0))
    relay_sock = socket.socket()
    if small_buffers:
        relay_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    relay_sock.connect(listener.getsockname())
    target_sock, _ = listener.accept()
    listener.close()
    if small_buffers:
        target_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    relay = trio.SocketStream(trio.socket.from_stdlib_socket(relay_sock))
    target = trio.SocketStream(trio.socket.from_stdlib_socket(target_sock))
    try:
        yield relay, target
    finally:
        await relay.aclose()
        await target.aclose()


def splicing_handler(relay: trio.SocketStream, results: list[SpliceResult],
                     before: bytes = b"", wait_for_buffered: int = 0,
                     ) -> Callable[[IncomingStream], Awaitable[None]]:
    """Streams opened with metadata echo=1 are echoed; the others spliced to `relay`."""
    async def handler(incoming: IncomingStream) -> None:
        if incoming.metadata.get("echo"):
            await echo_handler(incoming)
            return
        stream = await incoming.accept()
        # Let data pile up in the stream's buffer before the splice starts.
        while wait_for_buffered and stream._buffered < wait_for_buffered:  # noqa: ASYNC110
            await trio.sleep(0.01)
        results.append(await splice(stream, relay, a_leftover=before))
    return handler


async def read_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(65536)
        assert chunk, f"EOF after {len(data)} of {size} bytes"
        data += chunk
    return bytes(data)


async def test_bulk_both_ways_is_complete_and_half_close_works_in_each_order() -> None:
    up = os.urandom(6 * 1024 * 1024 + 7)
    down = os.urandom(5 * 1024 * 1024 + 3)
    results: list[SpliceResult] = []
    async with socket_pair() as (relay, target), \
            linked(acceptor_handler=splicing_handler(relay, results)) as link:
        stream = await link.dialer.open_stream(T)
        got_down = hashlib.sha256()
        got_up = hashlib.sha256()

        async def send_up() -> None:
            await stream.send_all(up)
            await stream.send_eof()  # the tunnel half-closes first…

        async def target_side() -> None:
            seen = 0
            while chunk := await target.receive_some(65536):
                got_up.update(chunk)
                seen += len(chunk)
            assert seen == len(up)  # …and the target sees EOF after all of it,
            await target.send_all(down)  # while it can still answer
            await target.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_up)
            nursery.start_soon(target_side)
            while chunk := await stream.receive_some():
                got_down.update(chunk)
        assert got_up.digest() == hashlib.sha256(up).digest()
        assert got_down.digest() == hashlib.sha256(down).digest()
        with trio.fail_after(5):
            while not results:  # noqa: ASYNC110 (the handler's result, polled)
                await trio.sleep(0.01)
    assert results[0].error is None
    assert (results[0].a_to_b, results[0].b_to_a) == (len(up), len(down))


async def test_target_closing_first_still_gets_the_rest_of_the_tunnel_data() -> None:
    results: list[SpliceResult] = []
    async with socket_pair() as (relay, target), \
            linked(acceptor_handler=splicing_handler(relay, results)) as link:
        stream = await link.dialer.open_stream(T)
        await target.send_all(b"bye")
        await target.send_eof()
        assert await read_exactly(stream, 3) == b"bye"
        assert await stream.receive_some() == b""
        # The target's half is closed; the tunnel's half still flows to it.
        await stream.send_all(b"still here")
        await stream.send_eof()
        assert await read_exactly(target, 10) == b"still here"
        assert await target.receive_some() == b""


async def test_leftover_and_buffered_data_come_first_and_in_order() -> None:
    results: list[SpliceResult] = []
    async with socket_pair() as (relay, target), \
            linked(acceptor_handler=splicing_handler(relay, results, before=b"[leftover]",
                                                     wait_for_buffered=9)) as link:
        stream = await link.dialer.open_stream(T)
        await stream.send_all(b"[buffered]")  # arrives before the splice starts
        expected = b"[leftover][buffered]"
        assert await read_exactly(target, len(expected)) == expected
        await stream.send_all(b"[live]")
        assert await read_exactly(target, 6) == b"[live]"


async def test_a_target_that_stops_reading_stops_its_sender_at_the_window() -> None:
    """Backpressure: credit returns only for bytes the socket took, so the sender stalls
    after about one stream window (plus kernel buffers); other streams on the connection
    carry on meanwhile; when the target reads again, every byte arrives in order."""
    payload = os.urandom(16 * 1024 * 1024)
    results: list[SpliceResult] = []
    async with socket_pair(small_buffers=True) as (relay, target), \
            linked(acceptor_handler=splicing_handler(relay, results)) as link:
        stream = await link.dialer.open_stream(T)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.send_all, payload)
            # Wait for the sender to stall: no progress for 0.3 s.
            last = -1
            while stream.bytes_sent != last:
                last = stream.bytes_sent
                await trio.sleep(0.3)
            # One window in flight, plus what the kernel buffers hold (a few 100 KiB
            # on loopback even when asked for 16 KiB).
            assert WINDOW <= stream.bytes_sent < WINDOW + 4 * 1024 * 1024, stream.bytes_sent
            # Fairness: a second stream through the same connection is not held up.
            other = await link.dialer.open_stream(T, {"echo": "1"})
            await other.send_all(b"ping")
            await other.send_eof()
            assert await other.receive_some() == b"ping"
            await other.aclose()
            received = await read_exactly(target, len(payload))
        assert received == payload


async def test_a_target_reset_resets_the_tunnel_stream_and_returns_its_credit() -> None:
    results: list[SpliceResult] = []
    async with socket_pair(small_buffers=True) as (relay, target), \
            linked(acceptor_handler=splicing_handler(relay, results)) as link:
        stream = await link.dialer.open_stream(T)
        # Data the target never reads, some of it waiting in the splice when it resets.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_send_until_reset, stream)
            await trio.sleep(0.3)
            target.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await target.aclose()
        with pytest.raises(StreamResetError):
            while await stream.receive_some():
                pass
        with trio.fail_after(5):
            while not results:  # noqa: ASYNC110 (the handler's result, polled)
                await trio.sleep(0.01)
        assert results[0].error is not None
        # Every byte of connection credit came back: a fresh stream can move more than
        # the whole connection window.
        await _round_trip(link.dialer, CONNECTION_WINDOW + WINDOW)


async def test_a_tunnel_reset_resets_the_target_connection() -> None:
    results: list[SpliceResult] = []
    async with socket_pair() as (relay, target), \
            linked(acceptor_handler=splicing_handler(relay, results)) as link:
        stream = await link.dialer.open_stream(T)
        await stream.send_all(b"hello")
        assert await read_exactly(target, 5) == b"hello"
        await stream.abort(p.StreamReason.CANCELLED, "gone")
        with trio.fail_after(5), pytest.raises(trio.BrokenResourceError):
            while await target.receive_some():
                pass  # a reset, not a clean EOF


async def _send_until_reset(stream: trio.abc.SendStream) -> None:
    chunk = b"z" * 65536
    try:
        while True:
            await stream.send_all(chunk)
    except trio.BrokenResourceError:
        return


async def _round_trip(dialer: TunnelConnection, size: int) -> None:
    """A bulk stream through the acceptor's echo handler, complete and in order."""
    stream = await dialer.open_stream(T, {"echo": "1"})
    payload = os.urandom(size)
    async with trio.open_nursery() as nursery:
        async def send() -> None:
            await stream.send_all(payload)
            await stream.send_eof()
        nursery.start_soon(send)
        got = bytearray()
        while chunk := await stream.receive_some():
            got += chunk
    assert bytes(got) == payload
