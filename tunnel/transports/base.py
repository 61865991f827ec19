"""The transport interface: how tunnel bytes travel between an agent and a server.

Owns `Transport` (the abstract byte pipe), its errors (`TransportError`, `TransportClosed`,
`DialError`), `PeerInfo` and `Endpoint`. The protocol core does not care whether its bytes
ride in WebSocket binary messages or directly in a TLS byte stream; the endpoints only see
`Transport`. Every implementation passes the same conformance tests
(tests/tunnel/test_transport_conformance.py).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal

# The tunnel moves bulk data: read big chunks, so the protocol core sees few, large calls.
STREAM_RECEIVE_SIZE = 1024 * 1024


# WebSocket figures live here, not in websocket.py, so that dialing and config code can
# name them without importing the WebSocket libraries (loaded only for ws:// and wss://).
WEBSOCKET_RECEIVE_SIZE = 256 * 1024
# Largest WebSocket message accepted (and sent: bigger sends are split). The tunnel's
# default max frame is 64 KiB; 1 MiB leaves headroom for coalesced frames while a peer
# can never make us buffer more than this for one message.
MAX_MESSAGE_SIZE = 1024 * 1024
WebSocketImpl = Literal["websockets", "wsproto"]
WEBSOCKET_IMPLS: tuple[WebSocketImpl, ...] = ("websockets", "wsproto")
# Largest HTTP upgrade request/response we read before giving up on a handshake.
MAX_HANDSHAKE_SIZE = 64 * 1024


class TransportError(Exception):
    """The transport failed (connection reset, TLS failure, dial refused...)."""


class TransportClosed(TransportError):
    """The transport is closed (locally or by the peer); nothing more can be sent."""


class DialError(TransportError):
    """Dialing failed; `reason` is a short word for logs and metrics."""

    def __init__(self, message: str, reason: str = "dial_failed") -> None:
        super().__init__(message)
        self.reason = reason


class WebSocketHandshakeError(TransportError):
    """The HTTP upgrade failed. `status` is the HTTP status the server answered (client
    side) or that we answered (server side), if any; `reason` a short word for logs."""

    def __init__(self, message: str, reason: str = "http", status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


@dataclass(frozen=True)
class PeerInfo:
    """What a transport knows about the other end, for logs and authentication."""

    address: str  # "host:port" of the remote socket
    # DER of the peer's verified TLS certificate (mutual TLS), if any.
    certificate_der: bytes | None = None
    # Request headers of a WebSocket upgrade (lower-case names), if any.
    headers: tuple[tuple[str, str], ...] = ()


class Transport(abc.ABC):
    """A reliable, ordered, bidirectional pipe of bytes with message boundaries ignored."""

    @property
    @abc.abstractmethod
    def peer(self) -> PeerInfo: ...

    @abc.abstractmethod
    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send all of data. Raises TransportClosed if the transport is closed."""

    async def send_pieces(self, pieces: list[bytes | memoryview]) -> None:
        """send() of the pieces' concatenation (the protocol core's queued frames,
        `pieces_to_send`), for a transport that need not join them first. The list is
        the transport's to empty."""
        data = b"".join(pieces)
        pieces.clear()
        await self.send(data)

    @property
    def send_high_water(self) -> int | None:
        """Queued output (bytes) beyond which the endpoint's senders wait, if this
        transport wants less than the endpoint's default (a shaped one: shaping.py)."""
        return None

    def can_send_nowait(self) -> bool:
        """Whether send_nowait() may be called now (no send in progress or left over)."""
        return False

    def send_nowait(self, data: bytes | bytearray | memoryview) -> bool:
        """Take all of `data` now, in the calling task, without awaiting (only when
        can_send_nowait()): True if it all went to the socket; False if some waits in
        the transport for the next send() (an empty one flushes it, and reports any
        error). Never leaves a record or frame half-written, since it cannot be
        cancelled part-way."""
        raise NotImplementedError

    def send_pieces_nowait(self, pieces: list[bytes | memoryview]) -> bool:
        """send_nowait() of the pieces' concatenation (the protocol core's queued frames,
        `pieces_to_send`), for a transport that need not join them first. The list is
        the transport's to empty."""
        data = b"".join(pieces)
        pieces.clear()
        return self.send_nowait(data)

    def unacknowledged_wait(self) -> float | None:
        """While bytes we sent wait for the peer's acknowledgement (TCP's): seconds since
        the peer last acknowledged any. None if nothing waits or it cannot be known. The
        keepalive asks it before it calls a silent peer dead (tcpstate.py says why)."""
        return None

    @abc.abstractmethod
    async def receive(self) -> bytes:
        """Return the next bytes (at least one), or b"" once the peer has closed cleanly.

        Raises TransportError if the transport broke.
        """

    async def receive_view(self) -> bytes | memoryview:
        """receive(), for a caller that uses the bytes before it awaits anything and
        copies what it keeps (the tunnel's reader): a transport may return a view of a
        buffer it reuses (a TLS stream's records decrypted in place, no copy per read)."""
        return await self.receive()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close; idempotent, never raises for an already-broken transport."""


@dataclass(frozen=True)
class Endpoint:
    """Where to dial or listen: parsed from `tls://host:port`, `wss://host:port/path`,
    `ws://...` or `tcp://host:port` (plain TCP: tests and trusted networks only)."""

    scheme: str  # "tls" | "tcp" | "wss" | "ws"
    host: str
    port: int
    path: str = "/"

    @property
    def uses_tls(self) -> bool:
        return self.scheme in ("tls", "wss")

    @property
    def is_websocket(self) -> bool:
        return self.scheme in ("ws", "wss")

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        path = self.path if self.is_websocket else ""
        return f"{self.scheme}://{host}:{self.port}{path}"
