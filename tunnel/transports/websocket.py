"""The WebSocket transport: the tunnel's bytes in WebSocket binary messages, which pass HTTP
proxies and L7 load balancers. Owns the two codec adapters over sans-IO WebSocket cores
and `WebSocketTransport`; the opening handshake is tunnel.transports.handshake.

The transport drives a sans-IO WebSocket core from inside `send()`/`receive()`:
`websockets`' protocol (the core under `websockets.trio`, with C-accelerated masking) or
`wsproto` (the core under trio-websocket). Both libraries' own trio layers need a nursery
for a background reader task for as long as the connection lives, and `dial()` hands out a
transport without one; driving the core in the caller's task keeps every task owned and
lets one code path own buffer sizes, message limits and error mapping. Which core is used
by default was decided by measurement (`python -m scripts.bench.websocket_transports`; see
tunnel.urls.DEFAULT_WEBSOCKET_IMPL).
"""

from __future__ import annotations

import abc
import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import trio
import websockets.exceptions
import websockets.frames
import websockets.protocol
import wsproto
import wsproto.events
import wsproto.utilities
from wsproto.connection import ConnectionState

from tunnel.transports.base import (
    MAX_MESSAGE_SIZE,
    WEBSOCKET_IMPLS,
    WEBSOCKET_RECEIVE_SIZE,
    PeerInfo,
    Transport,
    TransportClosed,
    TransportError,
    WebSocketImpl,
)
from tunnel.transports.streamtransport import CLOSE_TIMEOUT, StreamOwner

__all__ = [
    "MAX_MESSAGE_SIZE",
    "WEBSOCKET_IMPLS",
    "WEBSOCKET_RECEIVE_SIZE",
    "WebSocketCodec",
    "WebSocketImpl",
    "WebSocketTransport",
    "WebsocketsCodec",
    "WsprotoCodec",
]


# Close codes that mean "the peer is done", as opposed to "something broke".
_CLEAN_CLOSE_CODES = frozenset({1000, 1001, 1005})


@dataclass(frozen=True)
class _PeerClosed:
    code: int
    reason: str


@dataclass(frozen=True)
class _Failed:
    message: str


_WsEvent = bytes | _PeerClosed | _Failed


class WebSocketCodec(abc.ABC):
    """A sans-IO WebSocket connection after the opening handshake, reduced to what the
    transport needs: binary messages in and out, the close handshake, failures."""

    @abc.abstractmethod
    def feed(self, data: bytes) -> list[_WsEvent]:
        """Bytes from the network (b"" = EOF) → complete messages, close, failure."""

    @abc.abstractmethod
    def pending_events(self) -> list[_WsEvent]:
        """What arrived in the same read as the end of the opening handshake."""

    @abc.abstractmethod
    def send_message(self, data: bytes | memoryview) -> None:
        """Queue one binary message. Only while `can_send`."""

    @abc.abstractmethod
    def close(self, code: int, reason: str) -> None:
        """Queue a close frame if the connection is still open; else nothing."""

    @abc.abstractmethod
    def take_output(self) -> list[bytes]:
        """Bytes queued for the network (messages, pongs, close frames)."""

    @property
    @abc.abstractmethod
    def can_send(self) -> bool: ...


class WebsocketsCodec(WebSocketCodec):
    """On `websockets.protocol.Protocol` (the core of websockets.trio, C speedups)."""

    def __init__(self, protocol: websockets.protocol.Protocol,
                 pending: Sequence[websockets.protocol.Event] = ()) -> None:
        self._p = protocol
        self._fragments: list[bytes] | None = None
        self._pending = list(pending)
        self._done = False

    def feed(self, data: bytes) -> list[_WsEvent]:
        p = self._p
        if self._done:
            return []
        if data:
            p.receive_data(data)
        else:
            p.receive_eof()
        frames = [*self._pending, *p.events_received()]
        self._pending.clear()
        return self._frames_to_events(frames)

    def pending_events(self) -> list[_WsEvent]:
        frames, self._pending = self._pending, []
        return self._frames_to_events(frames)

    def _frames_to_events(self, frames: Sequence[websockets.protocol.Event]) -> list[_WsEvent]:
        p = self._p
        out: list[_WsEvent] = []
        opcode = websockets.frames.Opcode
        for frame in frames:
            if not isinstance(frame, websockets.frames.Frame):
                continue
            if frame.opcode is opcode.BINARY:
                if frame.fin:
                    out.append(bytes(frame.data))
                else:
                    self._fragments = [bytes(frame.data)]
            elif frame.opcode is opcode.CONT:
                if self._fragments is not None:
                    self._fragments.append(bytes(frame.data))
                    if frame.fin:
                        out.append(b"".join(self._fragments))
                        self._fragments = None
            elif frame.opcode is opcode.TEXT:
                message = "peer sent a text message; the tunnel uses binary messages only"
                p.fail(websockets.frames.CloseCode.UNSUPPORTED_DATA, "binary messages only")
                out.append(_Failed(message))
                self._done = True
                return out
            elif frame.opcode is opcode.CLOSE:
                rcvd = p.close_rcvd
                code = rcvd.code if rcvd is not None else 1005
                reason = rcvd.reason if rcvd is not None else ""
                out.append(_PeerClosed(code, reason))
                self._done = True
                return out
        if p.parser_exc is not None:
            exc = p.parser_exc
            if isinstance(exc, EOFError):
                message = "connection closed without a WebSocket close frame"
            elif isinstance(exc, websockets.exceptions.PayloadTooBig):
                message = f"peer sent a message over the {p.max_message_size}-byte limit"
            else:
                message = f"WebSocket protocol error: {exc}"
            out.append(_Failed(message))
            self._done = True
        return out

    def send_message(self, data: bytes | memoryview) -> None:
        self._p.send_binary(data)

    def close(self, code: int, reason: str) -> None:
        if self._p.state is websockets.protocol.State.OPEN:
            self._p.send_close(code, reason)

    def take_output(self) -> list[bytes]:
        return self._p.data_to_send()

    @property
    def can_send(self) -> bool:
        return self._p.state is websockets.protocol.State.OPEN and not self._done


class WsprotoCodec(WebSocketCodec):
    """On wsproto (the core of trio-websocket)."""

    def __init__(self, conn: wsproto.WSConnection, max_message_size: int,
                 pending: Sequence[wsproto.events.Event] = ()) -> None:
        self._ws = conn
        self._max = max_message_size
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._pending = list(pending)
        self._done = False

    def feed(self, data: bytes) -> list[_WsEvent]:
        if self._done:
            return []
        try:
            self._ws.receive_data(data or None)
        except wsproto.utilities.LocalProtocolError:
            self._done = True
            return [_Failed("connection closed without a WebSocket close frame")]
        return self.pending_events()

    def pending_events(self) -> list[_WsEvent]:
        out: list[_WsEvent] = []
        events = [*self._pending]
        self._pending.clear()
        try:
            for event in [*events, *self._ws.events()]:
                if isinstance(event, wsproto.events.BytesMessage):
                    self._buffer += event.data
                    if len(self._buffer) > self._max:
                        self._fail(1009, "message too big")
                        out.append(_Failed(
                            f"peer sent a message over the {self._max}-byte limit"))
                        return out
                    if event.message_finished:
                        out.append(bytes(self._buffer))
                        self._buffer.clear()
                elif isinstance(event, wsproto.events.TextMessage):
                    self._fail(1003, "binary messages only")
                    out.append(_Failed(
                        "peer sent a text message; the tunnel uses binary messages only"))
                    return out
                elif isinstance(event, wsproto.events.Ping):
                    self._out.append(self._ws.send(event.response()))
                elif isinstance(event, wsproto.events.CloseConnection):
                    state = self._ws.state
                    self._done = True
                    if state is ConnectionState.REMOTE_CLOSING:
                        self._out.append(self._ws.send(event.response()))
                    elif state is ConnectionState.OPEN:
                        # wsproto reports a frame it cannot parse as a close it wants us
                        # to send.
                        self._fail(event.code, event.reason or "")
                        out.append(_Failed(f"WebSocket protocol error: {event.reason}"))
                        return out
                    if event.code == 1006:
                        out.append(_Failed("connection closed without a WebSocket close frame"))
                    else:
                        out.append(_PeerClosed(event.code, event.reason or ""))
                    return out
        except (wsproto.utilities.RemoteProtocolError, wsproto.utilities.LocalProtocolError) as exc:
            self._done = True
            out.append(_Failed(f"WebSocket protocol error: {exc}"))
        return out

    def _fail(self, code: int, reason: str) -> None:
        self._done = True
        if self._ws.state is ConnectionState.OPEN:
            self._out.append(self._ws.send(wsproto.events.CloseConnection(code, reason)))

    def send_message(self, data: bytes | memoryview) -> None:
        self._out.append(self._ws.send(wsproto.events.BytesMessage(data=data)))  # type: ignore[arg-type]

    def close(self, code: int, reason: str) -> None:
        if self._ws.state is ConnectionState.OPEN:
            self._out.append(self._ws.send(wsproto.events.CloseConnection(code, reason)))

    def take_output(self) -> list[bytes]:
        out, self._out = self._out, []
        return out

    @property
    def can_send(self) -> bool:
        return self._ws.state is ConnectionState.OPEN and not self._done


class WebSocketTransport(StreamOwner, Transport):
    """The tunnel's bytes in WebSocket binary messages. One `send()` is one message (split
    at `max_message_size`); `receive()` returns one message's bytes; the peer's close
    frame is a clean end (b""), a text or oversized message a TransportError. `codec` is
    the connection right after its opening handshake (websocket_connect/websocket_accept
    build it); what arrived with the handshake's end is taken from it at once."""

    def __init__(self, stream: trio.abc.Stream, codec: WebSocketCodec, peer: PeerInfo, *,
                 impl: WebSocketImpl, max_message_size: int = MAX_MESSAGE_SIZE,
                 receive_size: int = WEBSOCKET_RECEIVE_SIZE,
                 close_timeout: float = CLOSE_TIMEOUT) -> None:
        super().__init__(stream, peer, close_timeout)
        self.impl = impl
        self._codec = codec
        self._max_message = max_message_size
        self._receive_size = receive_size
        self._messages: deque[bytes] = deque()
        self._peer_closed: _PeerClosed | None = None
        self._error: TransportError | None = None
        self._take(codec.pending_events())

    def _take(self, events: list[_WsEvent]) -> None:
        for event in events:
            if isinstance(event, bytes):
                if event:  # an empty message must never look like EOF
                    self._messages.append(event)
            elif isinstance(event, _PeerClosed):
                if event.code in _CLEAN_CLOSE_CODES:
                    self._peer_closed = event
                else:
                    reason = f": {event.reason}" if event.reason else ""
                    self._error = TransportError(
                        f"peer closed the WebSocket with code {event.code}{reason}")
            else:
                self._error = TransportError(event.message)

    def _check_can_send(self) -> None:
        super()._check_can_send()
        if self._error is not None:
            raise TransportError(f"transport unusable: {self._error}")
        if self._peer_closed is not None or not self._codec.can_send:
            raise TransportClosed("peer closed the WebSocket")

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        self._check_can_send()
        view = memoryview(data).cast("B")
        async with self._send_lock:
            if not len(view):
                await trio.lowlevel.checkpoint()
                return
            for offset in range(0, len(view), self._max_message):
                self._check_can_send()
                self._codec.send_message(view[offset:offset + self._max_message])
                await self._flush_locked()

    async def _flush_locked(self) -> None:
        # Loop: a receive() may queue a pong or close reply while we are writing.
        while chunks := self._codec.take_output():
            for chunk in chunks:
                if chunk:  # b"" is websockets' "half-close now" marker; aclose does that
                    await self._send_raw(chunk)

    async def _flush_control(self) -> None:
        """After receiving: send what the core answered (pong, close reply) unless a
        sender holds the lock; it flushes everything queued before releasing it."""
        if self._send_lock.locked() or self._broken is not None or self._closed:
            return
        with contextlib.suppress(TransportError):
            async with self._send_lock:
                await self._flush_locked()

    async def receive(self) -> bytes:
        while True:
            if self._messages:
                await trio.lowlevel.checkpoint()
                return self._messages.popleft()
            if self._error is not None:
                await trio.lowlevel.checkpoint()
                raise self._error
            if self._peer_closed is not None:
                await trio.lowlevel.checkpoint()
                return b""
            if self._closed:
                raise TransportClosed("transport is closed")
            data = await self._receive_some(self._receive_size)
            self._take(self._codec.feed(data))
            if not data and self._error is None and self._peer_closed is None:
                self._error = TransportError("connection closed without a WebSocket close frame")
            await self._flush_control()

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        # One deadline for the whole goodbye: close frame, then TLS close_notify.
        with trio.move_on_after(self._close_timeout):
            try:
                if (not self._send_lock.locked() and self._broken is None
                        and self._codec.can_send):
                    async with self._send_lock:
                        self._codec.close(1000, "")
                        with contextlib.suppress(TransportError):
                            await self._flush_locked()
            finally:
                await self._close_stream()
