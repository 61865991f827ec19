"""TunnelStream against trio's stream conformance suite (trio.testing.check_*_stream).

Each stream pair is one stream of a real TunnelConnection pair over in-memory transports:
one end opened by the dialer, the other accepted by the acceptor's handler.

One deviation is deliberate and kept: TunnelStream.aclose() on a stream still open is a
reset (RST), like a TCP close with SO_LINGER 0, because tunnel/splice.py aborts a broken
splice with aclose() and the peer must not mistake a truncated transfer for a complete
one. trio's suite expects aclose() after send_all() to deliver the data and then b"", so
it runs against `GracefulClose`, whose aclose() is send_eof() then aclose(): the graceful
close of a TunnelStream. Everything else is TunnelStream's own; the reset itself is
pinned by test_aclose_without_send_eof_resets_the_peer.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from tests.tunnel.memtransport import memory_transport_pair
from tunnel import protocol as p
from tunnel.endpoint import (
    EndpointSettings,
    IncomingStream,
    StreamResetError,
    TunnelConnection,
    TunnelStream,
)
from tunnel.transports import PeerInfo

T = p.Target("svc", 80)


class GracefulClose(trio.abc.HalfCloseableStream):
    """A TunnelStream whose aclose() half-closes first (see the module docstring)."""

    def __init__(self, stream: TunnelStream) -> None:
        self.stream = stream

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        # Shielded: a cancelled aclose() must still close, FIN included.
        with trio.CancelScope(shield=True), \
                contextlib.suppress(trio.BrokenResourceError, trio.BusyResourceError):
            await self.stream.send_eof()
        await self.stream.aclose()


StreamPair = tuple[TunnelStream, TunnelStream]


async def allow_all(hello: p.Hello, peer: PeerInfo) -> p.Hello:
    return p.Hello(identity={"server": "conformance"})


@asynccontextmanager
async def stream_factory(
    protocol_settings: p.Settings | None = None,
) -> AsyncIterator[Callable[[], Awaitable[StreamPair]]]:
    """Yields an async maker of stream pairs; every pair gets its own connection pair,
    whose tasks live until the block exits."""
    settings = EndpointSettings(protocol=protocol_settings or p.Settings(), ping_interval=0)
    async with trio.open_nursery() as nursery:

        async def make() -> StreamPair:
            accepted_send, accepted_receive = trio.open_memory_channel[TunnelStream](1)

            async def hand_over(incoming: IncomingStream) -> None:
                await accepted_send.send(await incoming.accept())
                # The handler's return would close the stream: it lives as long as the
                # connection does.
                await trio.sleep_forever()

            ta, tb = memory_transport_pair()
            dialer = TunnelConnection(ta, p.Role.DIALER, settings, None)
            acceptor = TunnelConnection(tb, p.Role.ACCEPTOR, settings, hand_over)
            nursery.start_soon(acceptor.accept_handshake, allow_all)
            await dialer.dial_handshake(p.Hello(identity={"node": "edge-1"}))
            await nursery.start(dialer.run)
            await nursery.start(acceptor.run)
            opened = await dialer.open_stream(T)
            return opened, await accepted_receive.receive()

        yield make
        nursery.cancel_scope.cancel()


def graceful(make: Callable[[], Awaitable[StreamPair]],
             ) -> Callable[[], Awaitable[tuple[GracefulClose, GracefulClose]]]:
    async def make_graceful() -> tuple[GracefulClose, GracefulClose]:
        left, right = await make()
        return GracefulClose(left), GracefulClose(right)
    return make_graceful


async def test_tunnel_stream_is_a_two_way_stream() -> None:
    async with stream_factory() as make:
        await trio.testing.check_two_way_stream(graceful(make), None)


async def test_tunnel_stream_is_a_half_closeable_stream() -> None:
    async with stream_factory() as make:
        await trio.testing.check_half_closeable_stream(graceful(make), None)


async def test_aclose_without_send_eof_resets_the_peer() -> None:
    async with stream_factory() as make:
        left, right = await make()
        await left.send_all(b"partial")
        await left.aclose()
        assert await right.receive_some() == b"partial"
        with pytest.raises(StreamResetError) as info:
            await right.receive_some()
        assert info.value.reason is p.StreamReason.CANCELLED
        with pytest.raises(trio.BrokenResourceError):
            await right.send_all(b"x")


async def test_receive_some_checks_max_bytes_before_waiting() -> None:
    async with stream_factory() as make:
        left, right = await make()
        with trio.fail_after(1):
            for bad in (0, -1):
                with pytest.raises(ValueError, match="max_bytes"):
                    await right.receive_some(bad)
            with pytest.raises(TypeError):
                await right.receive_some(1.5)  # type: ignore[arg-type]
        await left.send_all(b"ab")
        assert await right.receive_some(1) == b"a"


async def test_wait_send_all_might_not_block_on_a_closed_stream() -> None:
    async with stream_factory() as make:
        left, _ = await make()
        await left.wait_send_all_might_not_block()
        await left.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await left.wait_send_all_might_not_block()
