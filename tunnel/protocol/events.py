"""The events `Connection.receive_data()` returns: small frozen dataclasses, one per
thing the peer did that the endpoint must act on (as h11's _events.py).

Owns nothing but their shape; which event follows which frame is decided in
connection.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunnel.protocol.errors import ErrorCode, StreamReason
from tunnel.protocol.wire import Hello, Target


class Event:
    """Base class of everything `receive_data()` returns."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class HelloReceived(Event):
    """Acceptor only: the dialer introduced itself. Answer with `accept_handshake()` or
    `close(ErrorCode.UNAUTHORIZED, ...)`."""

    hello: Hello


@dataclass(frozen=True, slots=True)
class HandshakeCompleted(Event):
    """Dialer only: the acceptor answered; streams may be opened now."""

    hello: Hello
    version: int


@dataclass(frozen=True, slots=True)
class StreamOpened(Event):
    """The peer wants a stream to `target`. Answer with `accept_stream()` or
    `refuse_stream()`."""

    stream_id: int
    target: Target
    metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class StreamAccepted(Event):
    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamRefused(Event):
    stream_id: int
    reason: StreamReason
    message: str


@dataclass(frozen=True, slots=True)
class DataReceived(Event):
    """Payload for a stream. Call `acknowledge_received_data()` once it is consumed. A
    view, valid only until the caller reuses the buffer it fed, when it asked for that
    (`Connection.receive_data(lend=True)`); else bytes of its own."""

    stream_id: int
    data: bytes | memoryview


@dataclass(frozen=True, slots=True)
class DatagramReceived(Event):
    """One whole datagram on a flow. Nothing to acknowledge: its connection credit is
    returned as it arrives, so the app delivers it now or drops it (never buffers)."""

    stream_id: int
    data: bytes


@dataclass(frozen=True, slots=True)
class StreamEnded(Event):
    """The peer half-closed the stream (FIN): it will send no more data."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamReset(Event):
    stream_id: int
    reason: StreamReason
    message: str


@dataclass(frozen=True, slots=True)
class WindowUpdated(Event):
    """More send credit on stream_id (0: the whole connection)."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class PingAcked(Event):
    payload: bytes


@dataclass(frozen=True, slots=True)
class GoAwayReceived(Event):
    """The peer is draining: streams above last_stream_id that we opened were refused;
    open no more streams on this connection."""

    last_stream_id: int
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class ConnectionTerminated(Event):
    """The connection is over. by_peer: the peer ended it (or vanished); otherwise we
    ended it because the peer broke the protocol (a GOAWAY with `code` was queued).
    retry_after: seconds the peer asked us to wait before dialing again (a handshake
    refused as OVERLOADED), else None."""

    code: ErrorCode
    message: str
    by_peer: bool
    retry_after: float | None = None
