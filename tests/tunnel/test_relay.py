"""tunnel.relay: open → refuse/accept → splice, for tunnel streams and client connections."""

from __future__ import annotations

import trio
import trio.testing

from tests.tunnel.test_endpoint import T, linked
from tunnel import protocol as p
from tunnel.endpoint import IncomingStream, StreamRefusedError
from tunnel.errors import StreamFailed
from tunnel.relay import Relayed, relay_connection, relay_incoming
from tunnel.tcp import DialFailed


def test_dial_and_tunnel_failures_are_one_family() -> None:
    for exc in (DialFailed("timeout", "slow"),
                StreamRefusedError(p.StreamReason.TIMEOUT, "slow")):
        assert isinstance(exc, StreamFailed)
        assert exc.outcome == "timeout" and exc.message == "slow"


async def test_incoming_stream_is_refused_with_the_openers_reason() -> None:
    results: list[Relayed] = []

    async def handler(incoming: IncomingStream) -> None:
        async def fail() -> trio.abc.HalfCloseableStream:
            raise DialFailed("unreachable", "no route to 10.0.0.9:80")

        results.append(await relay_incoming(incoming, fail))

    async with linked(acceptor_handler=handler) as link:
        try:
            await link.dialer.open_stream(T, {})
        except StreamRefusedError as exc:
            assert exc.reason is p.StreamReason.UNREACHABLE
            assert exc.message == "no route to 10.0.0.9:80"
        else:
            raise AssertionError("the stream was not refused")
    assert results[0].failure is not None and results[0].failure.outcome == "unreachable"
    assert results[0].spliced is None


async def test_incoming_stream_is_accepted_and_spliced_both_ways_with_half_close() -> None:
    accepted: list[str] = []
    results: list[Relayed] = []
    finished = trio.Event()

    async def handler(incoming: IncomingStream) -> None:
        ours, theirs = trio.testing.memory_stream_pair()

        async def upstream_echo() -> None:
            while data := await theirs.receive_some():
                await theirs.send_all(data.upper())
            await theirs.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(upstream_echo)

            async def opened() -> trio.abc.HalfCloseableStream:
                return ours

            results.append(await relay_incoming(incoming, opened,
                                                on_accepted=lambda: accepted.append("yes")))
            finished.set()

    async with linked(acceptor_handler=handler) as link:
        stream = await link.dialer.open_stream(T, {})
        await stream.send_all(b"hello")
        await stream.send_eof()
        got = b""
        while chunk := await stream.receive_some():
            got += chunk
        assert got == b"HELLO"
        with trio.fail_after(5):
            await finished.wait()
    assert accepted == ["yes"]
    spliced = results[0].spliced
    assert spliced is not None and (spliced.a_to_b, spliced.b_to_a) == (5, 5)


async def test_client_connection_is_reset_when_the_upstream_fails() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    results: list[Relayed] = []

    async def fail() -> trio.abc.HalfCloseableStream:
        raise StreamRefusedError(p.StreamReason.FORBIDDEN, "not allowed")

    async with trio.open_nursery() as nursery:
        client = await trio.testing.open_stream_to_socket_listener(listeners[0])
        server_side = await listeners[0].accept()
        nursery.start_soon(lambda: _append(results, relay_connection(server_side, fail)))
        # A reset, not a clean EOF: the client must not mistake a refusal for an answer.
        try:
            with trio.fail_after(5):
                data = await client.receive_some()
        except trio.BrokenResourceError:
            pass
        else:
            raise AssertionError(f"expected a reset, got {data!r}")
        await client.aclose()
    await listeners[0].aclose()
    assert results[0].failure is not None and results[0].failure.outcome == "forbidden"


async def test_client_connection_is_spliced_when_the_upstream_opens() -> None:
    client, server_side = trio.testing.memory_stream_pair()
    upstream, far_end = trio.testing.memory_stream_pair()
    results: list[Relayed] = []

    async def opened() -> trio.abc.HalfCloseableStream:
        return upstream

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _append(results, relay_connection(server_side, opened)))
        await client.send_all(b"abc")
        assert await far_end.receive_some() == b"abc"
        await far_end.send_all(b"xyz!")
        assert await client.receive_some() == b"xyz!"
        await client.send_eof()
        assert await far_end.receive_some() == b""
        await far_end.send_eof()
        assert await client.receive_some() == b""
    spliced = results[0].spliced
    assert spliced is not None and (spliced.a_to_b, spliced.b_to_a) == (3, 4)


async def _append(results: list[Relayed], relay: object) -> None:
    results.append(await relay)  # type: ignore[misc]
