"""An in-memory Transport pair for endpoint tests (no sockets, no TLS)."""

from __future__ import annotations

import trio
import trio.testing

from tunnel.transports import PeerInfo, Transport, TransportClosed, TransportError


class MemoryTransport(Transport):
    def __init__(self, stream: trio.abc.Stream, name: str) -> None:
        self._stream = stream
        self._peer = PeerInfo(address=name)
        self.closed = False

    @property
    def peer(self) -> PeerInfo:
        return self._peer

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed:
            raise TransportClosed("closed")
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise TransportClosed(str(exc)) from None

    async def receive(self) -> bytes:
        try:
            return await self._stream.receive_some(256 * 1024)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise TransportError(str(exc)) from None

    async def aclose(self) -> None:
        self.closed = True
        await self._stream.aclose()


def memory_transport_pair(acceptor_peer: str = "acceptor"
                          ) -> tuple[MemoryTransport, MemoryTransport]:
    """(dialer's end, acceptor's end); the acceptor sees its peer as `acceptor_peer` (an
    address, for tests of what is counted per address)."""
    a, b = trio.testing.memory_stream_pair()
    return MemoryTransport(a, "dialer"), MemoryTransport(b, acceptor_peer)
