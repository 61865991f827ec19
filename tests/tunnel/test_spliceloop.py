"""tunnel.spliceloop: streams joined to real TCP sockets and handed over to their
connection's splice loop keep no task, report their end once, move every byte both ways
with backpressure, and end when their connection or their owner does."""

from __future__ import annotations

import gc
import os
import socket
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from tests.tunnel.test_endpoint import T, echo_handler, linked
from tunnel import protocol as p
from tunnel.endpoint import EndpointSettings, IncomingStream, StreamResetError
from tunnel.relay import relay_connection, relay_incoming
from tunnel.splice import SpliceResult
from tunnel.spliceloop import SpliceOwner
from tunnel.stream import TunnelStream

WINDOW = p.Settings().initial_stream_window


def count_tasks() -> int:
    """Every task in this trio run."""
    stack = [trio.lowlevel.current_root_task()]
    count = 0
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


@contextmanager
def tcp_pairs() -> Iterator[list[socket.socket]]:
    """Makes real loopback TCP pairs on demand (see `pair`); closes what is left."""
    made: list[socket.socket] = []
    yield made
    for sock in made:
        sock.close()


def pair(made: list[socket.socket]) -> tuple[trio.SocketStream, socket.socket]:
    """(the relay's end as trio sees it, the target's end: a plain non-blocking socket, so
    the test's side needs no task either)."""
    listener = socket.create_server(("127.0.0.1", 0))
    relay = socket.create_connection(listener.getsockname())
    target, _ = listener.accept()
    listener.close()
    target.setblocking(False)
    made.append(target)
    return trio.SocketStream(trio.socket.from_stdlib_socket(relay)), target


async def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    with trio.fail_after(10):
        while len(data) < size:
            await trio.lowlevel.wait_readable(sock)
            chunk = sock.recv(size - len(data))
            assert chunk, f"EOF after {len(data)} of {size} bytes"
            data += chunk
    return bytes(data)


async def recv_until_closed(sock: socket.socket) -> bytes:
    """Everything until EOF; raises ConnectionResetError on a reset."""
    data = bytearray()
    with trio.fail_after(10):
        while True:
            await trio.lowlevel.wait_readable(sock)
            chunk = sock.recv(65536)
            if not chunk:
                return bytes(data)
            data += chunk


async def send_then_eof(sock: socket.socket, view: memoryview, sent: int,
                        chunk: int) -> None:
    """From a non-blocking socket: `view` from byte `sent` on, `chunk` at a time as the
    socket takes it, then EOF."""
    while sent < len(view):
        await trio.lowlevel.wait_writable(sock)
        try:
            sent += sock.send(view[sent:sent + chunk])
        except BlockingIOError:
            pass
    sock.shutdown(socket.SHUT_WR)


def handing_over(made: list[socket.socket], targets: list[socket.socket],
                 results: list[SpliceResult]) -> object:
    """An acceptor handler as the agent's: each stream relayed to a fresh TCP target and
    handed over (on_finished), so the handler's task ends at once."""
    async def handler(incoming: IncomingStream) -> None:
        async def open_target() -> trio.abc.HalfCloseableStream:
            relay, target = pair(made)
            targets.append(target)
            return relay

        relayed = await relay_incoming(incoming, open_target, on_finished=results.append)
        assert relayed.failure is None and relayed.spliced is None
    return handler


@dataclass
class OneRelayed:
    """A stream the acceptor relayed to a TCP target and handed over, proven by a 2-byte
    "go" that reached the target: what `one_relayed` yields."""

    link: Any
    stream: TunnelStream
    target: socket.socket
    targets: list[socket.socket]
    results: list[SpliceResult]


@asynccontextmanager
async def one_relayed(settings: EndpointSettings | None = None
                      ) -> AsyncIterator[OneRelayed]:
    """A linked pair whose acceptor hands its streams over (the agent's way), with one
    stream open and proven; the pair and the target sockets are gone when it ends."""
    results: list[SpliceResult] = []
    targets: list[socket.socket] = []
    with tcp_pairs() as made:
        async with linked(acceptor_handler=handing_over(made, targets, results),
                          settings=settings) as link:
            stream = await link.dialer.open_stream(T)
            await stream.send_all(b"go")
            assert await recv_exactly(targets[0], 2) == b"go"
            yield OneRelayed(link, stream, targets[0], targets, results)


async def test_idle_handed_over_streams_keep_no_task_and_end_once_with_their_bytes() -> None:
    results: list[SpliceResult] = []
    targets: list[socket.socket] = []
    with tcp_pairs() as made:
        async with linked(acceptor_handler=handing_over(made, targets, results)) as link:
            streams = []

            async def open_and_prove() -> None:
                stream = await link.dialer.open_stream(T)
                await stream.send_all(b"ping")
                assert await recv_exactly(targets[-1], 4) == b"ping"
                targets[-1].send(b"pong!")
                with trio.fail_after(10):
                    assert await stream.receive_some() == b"pong!"
                streams.append(stream)

            await open_and_prove()
            await trio.testing.wait_all_tasks_blocked()
            with_one = count_tasks()
            for _ in range(40):
                await open_and_prove()
            await trio.testing.wait_all_tasks_blocked()
            # 41 idle relayed streams cost the tasks one did: none per stream.
            assert count_tasks() == with_one
            assert results == []  # nothing ended yet

            # Both halves close, in either order: each splice ends once, cleanly.
            for i, (stream, target) in enumerate(zip(streams, targets, strict=True)):
                if i % 2:
                    await stream.send_eof()
                    assert await recv_until_closed(target) == b""
                    target.shutdown(socket.SHUT_WR)
                    assert await stream.receive_some() == b""
                else:
                    target.shutdown(socket.SHUT_WR)
                    assert await stream.receive_some() == b""
                    await stream.send_eof()
                    assert await recv_until_closed(target) == b""
            with trio.fail_after(10):
                while len(results) < len(streams):  # noqa: ASYNC110 (callbacks, polled)
                    await trio.sleep(0.01)
    assert len(results) == 41
    assert all(r.error is None and (r.a_to_b, r.b_to_a) == (4, 5) for r in results)


async def test_a_socket_sender_stops_at_the_window_while_the_tunnel_reader_does_not_read(
) -> None:
    """Backpressure socket → tunnel: the loop holds what the window did not take and stops
    reading the socket until credit returns; then every byte arrives, in order."""
    payload = os.urandom(12 * 1024 * 1024)
    async with one_relayed() as relayed:
        link, stream, target, targets = (relayed.link, relayed.stream, relayed.target,
                                         relayed.targets)
        target.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        view = memoryview(payload)
        sent = 0
        # Send until the socket takes nothing for 0.3 s: the loop stopped reading.
        while sent < len(payload):
            try:
                sent += target.send(view[sent:sent + 65536])
            except BlockingIOError:
                with trio.move_on_after(0.3) as waited:
                    await trio.lowlevel.wait_writable(target)
                if waited.cancelled_caught:
                    break
        assert WINDOW <= sent < WINDOW + 4 * 1024 * 1024, sent
        # A second stream on the same connection is not held up.
        other = await link.dialer.open_stream(T)
        await other.send_all(b"x")
        assert await recv_exactly(targets[1], 1) == b"x"

        got = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_then_eof, target, view, sent, 65536)
            with trio.fail_after(30):
                while chunk := await stream.receive_some():
                    got += chunk
        assert bytes(got) == payload


async def test_the_connections_end_resets_the_sockets_of_its_handed_over_splices() -> None:
    async with one_relayed() as relayed:
        await relayed.link.acceptor.aclose()
        # The connection is gone: the target sees a reset, not a clean end.
        with pytest.raises(ConnectionResetError):
            await recv_until_closed(relayed.target)
        with trio.fail_after(10):
            while not relayed.results:  # noqa: ASYNC110 (the callback, polled)
                await trio.sleep(0.01)
    results = relayed.results
    assert len(results) == 1 and results[0].error == "tunnel connection ended"
    # Nothing keeps the ended connection alive (its splice loop is gone with it).
    ended = weakref.ref(relayed.link.acceptor)
    del relayed
    gc.collect()
    assert ended() is None


async def test_an_owner_that_stops_aborts_its_splices_both_ways() -> None:
    """relay_connection hands a client connection and its stream over on behalf of an
    owner (a listener); the owner's abort_all() resets the client and the stream."""
    results: list[SpliceResult] = []
    owner = SpliceOwner()
    with tcp_pairs() as made:
        async with linked(acceptor_handler=echo_handler) as link:
            client_relay, client = pair(made)

            async def open_stream() -> trio.abc.HalfCloseableStream:
                return await link.dialer.open_stream(T)

            relayed = await relay_connection(client_relay, open_stream,
                                             on_finished=results.append, owner=owner)
            assert relayed.handle is not None and len(owner) == 1
            client.send(b"echo me")
            assert await recv_exactly(client, 7) == b"echo me"  # through the acceptor
            owner.abort_all("listener stopped")
            assert len(owner) == 0 and relayed.handle.ended
            with pytest.raises(ConnectionResetError):
                await recv_until_closed(client)
    assert len(results) == 1 and results[0].error == "listener stopped"
    assert (results[0].a_to_b, results[0].b_to_a) == (7, 7)


async def test_a_reset_target_resets_the_stream() -> None:
    async with one_relayed() as relayed:
        relayed.target.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        relayed.target.close()
        with trio.fail_after(10), pytest.raises(StreamResetError):
            while await relayed.stream.receive_some():
                pass
        with trio.fail_after(10):
            while not relayed.results:  # noqa: ASYNC110 (the callback, polled)
                await trio.sleep(0.01)
    error = relayed.results[0].error
    assert error is not None and "ConnectionResetError" in error


async def test_a_socket_sender_limited_by_the_connection_window_is_woken_by_its_credit(
) -> None:
    """A read the stream window would take but the connection window cuts short: the rest
    is held until connection credit returns (a WINDOW for stream 0 wakes only streams
    waiting for it), then every byte arrives."""
    settings = EndpointSettings(ping_interval=0, protocol=p.Settings(
        connection_window=96 * 1024, initial_stream_window=1024 * 1024))
    payload = os.urandom(6 * 1024 * 1024)
    async with one_relayed(settings) as relayed:
        stream, target = relayed.stream, relayed.target
        got = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_then_eof, target, memoryview(payload), 0, 262144)
            with trio.fail_after(30):
                while chunk := await stream.receive_some():
                    got += chunk
        assert bytes(got) == payload
