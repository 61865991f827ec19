"""TunnelUpstream: a tunnel stream seen through its direct sink, as the HTTP front's
HTTP/1.1 upstream — bytes, EOF, resets, flow control and release() over a real pair of
tunnel connections."""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from nodeagent.server.tunnelupstream import TunnelUpstream
from tests.tunnel.test_endpoint import T, linked
from tunnel.endpoint import IncomingStream


async def test_round_trips_and_eof() -> None:
    async with linked() as link:  # the acceptor echoes
        up = TunnelUpstream(await link.dialer.open_stream(T, {}))
        for message in (b"GET / HTTP/1.1\r\n\r\n", b"x" * 5000, b"last"):
            await up.send_all(message)
            got = b""
            while len(got) < len(message):
                got += await up.receive_some(65536)
            assert got == message
        await up.send_eof()
        assert await up.receive_some() == b""
        assert await up.receive_some() == b""
        await up.aclose()


async def test_more_than_the_window_both_ways_in_order() -> None:
    """A send beyond the stream's window waits for credit (on_window) and credit returns
    as the receiver takes bytes: 4 MiB through the echo, read in small pieces."""
    data = os.urandom(4 * 1024 * 1024)
    async with linked() as link:
        up = TunnelUpstream(await link.dialer.open_stream(T, {}))
        got = bytearray()

        async def read_all() -> None:
            while chunk := await up.receive_some(7000):
                assert len(chunk) <= 7000
                got.extend(chunk)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all)
                await up.send_all(data)
                await up.send_eof()
        assert bytes(got) == data


async def test_a_reset_fails_receive_and_send() -> None:
    async def reset_after_one(incoming: IncomingStream) -> None:
        stream = await incoming.accept()
        await stream.send_all(b"partial")
        await stream.aclose()  # open both ways: an RST

    async with linked(acceptor_handler=reset_after_one) as link:
        up = TunnelUpstream(await link.dialer.open_stream(T, {}))
        with trio.fail_after(10):
            assert await up.receive_some() == b"partial"  # data before the reset first
            with pytest.raises(trio.BrokenResourceError):
                await up.receive_some()
            with pytest.raises(trio.BrokenResourceError):
                await up.send_all(b"more")


async def test_a_waiting_receive_can_be_cancelled() -> None:
    async with linked() as link:
        up = TunnelUpstream(await link.dialer.open_stream(T, {}))
        with trio.move_on_after(0.1) as scope:
            await up.receive_some()
        assert scope.cancelled_caught
        await up.send_all(b"still works")  # the cancelled wait left nothing behind
        assert await up.receive_some() == b"still works"


async def test_release_gives_back_the_bare_stream_and_what_was_held() -> None:
    async with linked() as link:
        up = TunnelUpstream(await link.dialer.open_stream(T, {}))
        await up.send_all(b"one")
        await up.send_all(b"two")
        await trio.testing.wait_all_tasks_blocked()  # the echo is in the wrapper's hands
        bare, held = up.release()
        assert held == b"onetwo"
        await bare.send_all(b"three")  # the bare stream receives on its own again
        assert await bare.receive_some() == b"three"
        await bare.aclose()


async def _origin(incoming: IncomingStream) -> None:
    """An HTTP/1.1 origin on the agent's end of the stream: 200 "hello" to every request,
    101 and then an echo to one asking `upgrade: echo`."""
    stream = await incoming.accept()
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = await stream.receive_some()
            if not data:
                return
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        if b"upgrade: echo" in head.lower():
            await stream.send_all(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\n"
                                  b"upgrade: echo\r\n\r\nfirst")
            while data := await stream.receive_some():
                await stream.send_all(data)
            await stream.send_eof()
            return
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")


async def _read_response(stream: trio.SocketStream, buf: bytes) -> tuple[bytes, bytes]:
    """One response head (and a 5-byte body unless 101), and what followed it."""
    while b"\r\n\r\n" not in buf:
        buf += await stream.receive_some()
    head, _, rest = buf.partition(b"\r\n\r\n")
    if head.startswith(b"HTTP/1.1 101"):
        return head, rest
    while len(rest) < 5:
        rest += await stream.receive_some()
    return head + b"\r\n\r\n" + rest[:5], rest[5:]


async def test_the_front_through_the_servers_opener_keeps_alive_and_switches() -> None:
    """The server's opener wraps an h1 backend's tunnel stream; requests on one client
    connection reuse it, and a 101 hands the bare stream to the splice with the bytes the
    wrapper held."""
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as MetricCounter

    from nodeagent.config import RoutesConfig
    from nodeagent.http import Backend, HttpFront, Route, RouteSpec, RouteTable
    from nodeagent.ops.logs import get_logger
    from nodeagent.ops.streamviews import StreamNotes
    from nodeagent.server.datapath import DataPath
    from nodeagent.server.openers import HttpBackends, StreamOutcomes
    from nodeagent.server.refusals import PolicyRefusals

    async with linked(acceptor_handler=_origin) as link:
        opened: list[object] = []

        async def open_stream(node: str, target: object, metadata: dict[str, str]) -> object:
            stream = await link.dialer.open_stream(T, metadata)
            opened.append(stream)
            return stream

        registry = CollectorRegistry()
        backends = HttpBackends(
            datapath=DataPath(routes=RoutesConfig, open_stream=open_stream,  # type: ignore[arg-type]
                              refusals=PolicyRefusals(registry, get_logger("test")),
                              dial_timeout=10, controller=None),
            notes=StreamNotes(), direct_backends=False,
            outcomes=StreamOutcomes(MetricCounter("streams", "", ["direction", "outcome"],
                                                  registry=registry)))
        wrapped: list[object] = []

        async def open_upstream(backend: Backend, route: Route,
                                client: str = "") -> trio.abc.HalfCloseableStream:
            stream = await backends.open_http_backend(backend, route, client)
            wrapped.append(stream)
            return stream

        route = Route("r", (Backend("node-1", "svc", 80),))
        table = RouteTable.build([RouteSpec("a.test", "/", route)])
        front = HttpFront(table=lambda: table, open_upstream=open_upstream)
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run, "127.0.0.1", 0)
            client = await trio.open_tcp_stream("127.0.0.1", front.port)
            with trio.fail_after(20):
                rest = b""
                for _ in range(3):
                    await client.send_all(b"GET / HTTP/1.1\r\nhost: a.test\r\n\r\n")
                    response, rest = await _read_response(client, rest)
                    assert response.startswith(b"HTTP/1.1 200")
                    assert response.endswith(b"\r\n\r\nhello")
                assert len(opened) == 1  # one tunnel stream for the connection's requests
                assert type(wrapped[0]) is TunnelUpstream
                await client.send_all(b"GET /ws HTTP/1.1\r\nhost: a.test\r\n"
                                      b"connection: upgrade\r\nupgrade: echo\r\n\r\n")
                head, rest = await _read_response(client, rest)
                assert head.startswith(b"HTTP/1.1 101")
                while len(rest) < 5:
                    rest += await client.receive_some()
                assert rest == b"first"  # sent with the 101, held by the wrapper
                await client.send_all(b"ping")
                got = b""
                while len(got) < 4:
                    got += await client.receive_some()
                assert got == b"ping"
            await client.aclose()
            front.stop()
