"""Transport implementations: a TLS (or plain TCP) byte stream, and WebSocket binary messages.

`StreamTransport` passes bytes straight through any trio Stream (a `trio.SSLStream` for
`tls://`, a raw `trio.SocketStream` for `tcp://`). The WebSocket transports carry the same
bytes in binary messages, so they pass HTTP proxies and L7 load balancers.

The WebSocket transports drive a sans-IO WebSocket core from inside `send()`/`receive()`:
`websockets`' protocol (the core under `websockets.trio`, with C-accelerated masking) or
`wsproto` (the core under trio-websocket). Both libraries' own trio layers need a nursery
for a background reader task for as long as the connection lives, and `dial()` hands out a
transport without one; driving the core in the caller's task keeps every task owned and
lets one code path own buffer sizes, message limits and error mapping. Which core is used
by default was decided by measurement (scripts/bench_websocket.py).

Native exceptions (trio, OSError, ssl, the WebSocket cores) are mapped once, here, into
`TransportError` / `TransportClosed`.
"""

from __future__ import annotations

import abc
import contextlib
import ssl
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import trio
import websockets.client
import websockets.exceptions
import websockets.frames
import websockets.http11
import websockets.protocol
import websockets.server
import websockets.uri
import wsproto
import wsproto.events
import wsproto.utilities
from wsproto.connection import ConnectionState

from tunnel.transport import PeerInfo, Transport, TransportClosed, TransportError

__all__ = [
    "CLOSE_TIMEOUT",
    "MAX_MESSAGE_SIZE",
    "STREAM_RECEIVE_SIZE",
    "WEBSOCKET_IMPLS",
    "WEBSOCKET_RECEIVE_SIZE",
    "StreamTransport",
    "TLSStream",
    "WebSocketHandshakeError",
    "WebSocketImpl",
    "WebSocketTransport",
    "socket_of",
    "websocket_accept",
    "websocket_connect",
]

# The tunnel moves bulk data: read big chunks, so the protocol core sees few, large calls.
STREAM_RECEIVE_SIZE = 256 * 1024
WEBSOCKET_RECEIVE_SIZE = 256 * 1024
# Largest WebSocket message accepted (and sent: bigger sends are split). The tunnel's
# default max frame is 64 KiB; 1 MiB leaves headroom for coalesced frames while a peer
# can never make us buffer more than this for one message.
MAX_MESSAGE_SIZE = 1024 * 1024
# How long aclose() tries to say goodbye (close frame, TLS close_notify) before it just
# closes the socket.
CLOSE_TIMEOUT = 2.0
# Largest HTTP upgrade request/response we read before giving up on a handshake.
MAX_HANDSHAKE_SIZE = 64 * 1024

WebSocketImpl = Literal["websockets", "wsproto"]
WEBSOCKET_IMPLS: tuple[WebSocketImpl, ...] = ("websockets", "wsproto")

# Close codes that mean "the peer is done", as opposed to "something broke".
_CLEAN_CLOSE_CODES = frozenset({1000, 1001, 1005})


def describe_error(exc: BaseException | None) -> str:
    """A short human phrase for a native network error (for messages and logs)."""
    if exc is None:
        return "unknown error"
    if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ is not None:
        return describe_error(exc.__cause__)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"tls: certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return f"tls: {exc.reason or exc}".lower() if exc.reason else f"tls: {exc}"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by peer"
    if isinstance(exc, BrokenPipeError):
        return "broken pipe"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def is_tls_error(exc: BaseException | None) -> bool:
    """Whether a native error (or what caused it) came from TLS."""
    while exc is not None:
        if isinstance(exc, ssl.SSLError):
            return True
        exc = exc.__cause__
    return False


TLS_RECORD_SIZE = 16 * 1024  # largest TLS record payload
_TLS_WRITE_CHUNK = 256 * 1024  # encrypt at most this much before sending it


class TLSStream(trio.abc.Stream):
    """TLS over a socket stream, built for bulk transfer.

    Like trio.SSLStream it runs an `ssl.SSLObject` over memory BIOs, but it reads the
    socket in large chunks and returns every complete record already received in one
    `receive_some` (a TLS record holds at most 16 KiB, and trio.SSLStream hands them out
    one at a time, with a scheduler round trip each — most of its CPU cost in bulk).
    Renegotiation is not supported (the contexts disable it); the handshake is done
    explicitly, once, before the stream is shared between tasks; after it, one task may
    receive while another sends.
    """

    def __init__(self, transport_stream: trio.SocketStream, ssl_context: ssl.SSLContext, *,
                 server_side: bool = False, server_hostname: str | None = None,
                 receive_size: int = STREAM_RECEIVE_SIZE) -> None:
        self.transport_stream = transport_stream
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.ssl_object = ssl_context.wrap_bio(self._incoming, self._outgoing,
                                               server_side=server_side,
                                               server_hostname=server_hostname)
        self._receive_size = receive_size
        # One writer to the socket at a time; whoever holds it sends all queued output.
        self._out_lock = trio.StrictFIFOLock()
        self._handshake_done = False
        self._failed: BaseException | None = None
        self._closed = False
        self._zero_return = False
        # Called before each read from the socket (tunnel.dial uses it to notice that the
        # server's post-handshake flight was processed).
        self.on_receive: Callable[[], None] | None = None

    # Attributes people look at after the handshake.
    def getpeercert(self, binary_form: bool = False) -> Any:
        return self.ssl_object.getpeercert(binary_form)

    def version(self) -> str | None:
        return self.ssl_object.version()

    def cipher(self) -> tuple[str, str, int] | None:
        return self.ssl_object.cipher()

    def selected_alpn_protocol(self) -> str | None:
        return self.ssl_object.selected_alpn_protocol()

    def _check(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("TLS stream is closed")
        if self._failed is not None:
            raise trio.BrokenResourceError("TLS stream is broken") from self._failed

    def _fail(self, exc: BaseException) -> trio.BrokenResourceError:
        self._failed = self._failed or exc
        err = trio.BrokenResourceError(describe_error(exc))
        err.__cause__ = exc
        return err

    async def _flush_locked(self) -> None:
        while self._outgoing.pending:
            data = self._outgoing.read()
            try:
                await self.transport_stream.send_all(data)
            except BaseException as exc:
                # A partial record on the wire: nothing more can be sent.
                self._failed = self._failed or exc
                raise

    async def _flush_if_idle(self) -> None:
        """Send what reading produced (alerts, key updates) unless a sender is busy; it
        sends everything queued before it lets go of the lock."""
        if self._outgoing.pending and not self._out_lock.locked():
            async with self._out_lock:
                await self._flush_locked()

    async def _read_socket(self) -> None:
        if self.on_receive is not None:
            self.on_receive()
        data = await self.transport_stream.receive_some(self._receive_size)
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    async def do_handshake(self) -> None:
        """The TLS handshake; raises trio.BrokenResourceError (cause: the ssl error)."""
        self._check()
        try:
            while True:
                try:
                    self.ssl_object.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    async with self._out_lock:
                        await self._flush_locked()
                    await self._read_socket()
        except ssl.SSLError as exc:
            # Tell the peer why (the engine queued an alert), briefly and best-effort.
            with trio.move_on_after(1), contextlib.suppress(Exception):
                async with self._out_lock:
                    await self._flush_locked()
            raise self._fail(exc) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self._fail(exc) from exc
        async with self._out_lock:  # our last flight (and a server's session tickets)
            try:
                await self._flush_locked()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise self._fail(exc) from exc
        self._handshake_done = True

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        self._check()
        if not self._handshake_done:
            raise RuntimeError("TLSStream: do_handshake() first")
        max_bytes = max_bytes or self._receive_size
        if self._zero_return:
            await trio.lowlevel.checkpoint()
            return b""
        waited = False
        while True:
            try:
                first = self.ssl_object.read(min(max_bytes, TLS_RECORD_SIZE))
                if not first:  # Python reports the peer's close_notify as b""
                    self._zero_return = True
                break
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:
                # The peer's close_notify: a clean end.
                self._zero_return = True
                first = b""
                break
            except ssl.SSLError as exc:
                raise self._fail(exc) from exc
            await self._flush_if_idle()
            await self._read_socket()
            waited = True
        parts = [first]
        total = len(first)
        while first and total < max_bytes:
            try:
                more = self.ssl_object.read(min(max_bytes - total, TLS_RECORD_SIZE))
            except ssl.SSLZeroReturnError:
                self._zero_return = True
                break
            except ssl.SSLError:
                break  # want-read, or an error the next call reports
            if not more:
                self._zero_return = True
                break
            parts.append(more)
            total += len(more)
        if self._outgoing.pending:
            await self._flush_if_idle()
        elif not waited:
            await trio.lowlevel.checkpoint()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._check()
        if not self._handshake_done:
            raise RuntimeError("TLSStream: do_handshake() first")
        view = memoryview(data).cast("B")
        if not len(view):
            await trio.lowlevel.checkpoint()
            return
        async with self._out_lock:
            for offset in range(0, len(view), _TLS_WRITE_CHUNK):
                self._check()
                try:
                    self.ssl_object.write(view[offset:offset + _TLS_WRITE_CHUNK])
                except ssl.SSLError as exc:
                    raise self._fail(exc) from exc
                await self._flush_locked()

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport_stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """Send close_notify (unless a send is in progress or the stream is broken), then
        close the socket. Does not wait for the peer's close_notify."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        try:
            if self._handshake_done and self._failed is None and not self._out_lock.locked():
                with contextlib.suppress(ssl.SSLError):
                    self.ssl_object.unwrap()
                async with self._out_lock:
                    with contextlib.suppress(trio.BrokenResourceError,
                                             trio.ClosedResourceError, OSError):
                        await self._flush_locked()
        finally:
            await self.transport_stream.aclose()


def socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    """The socket under a (TLS) stream, for getsockopt and friends."""
    while True:
        if isinstance(stream, trio.SocketStream):
            return stream.socket
        if isinstance(stream, TLSStream | trio.SSLStream):
            stream = stream.transport_stream
        else:
            return None


class _StreamOwner:
    """What every transport here shares: one trio Stream, serialized sends, a close that
    is idempotent, bounded in time and safe to call while other tasks are blocked."""

    def __init__(self, stream: trio.abc.Stream, peer: PeerInfo, close_timeout: float,
                 initial: bytes = b"") -> None:
        self._stream = stream
        self._peer = peer
        self._close_timeout = close_timeout
        # Sends come from several tasks (the endpoint's writer, a final GOAWAY flush);
        # a trio stream allows one at a time.
        self._send_lock = trio.StrictFIFOLock()
        self._closed = False  # aclose() was called
        # Set when a send failed or was cancelled part-way: the byte stream is no longer
        # in a known state, so nothing more may be written to it.
        self._broken: str | None = None
        # Bytes read from the stream but not yet handed out (e.g. by a cancelled read).
        self._pushback = initial
        self._eof = False

    @property
    def peer(self) -> PeerInfo:
        return self._peer

    @property
    def stream(self) -> trio.abc.Stream:
        """The underlying trio stream (for diagnostics and tests)."""
        return self._stream

    @contextlib.contextmanager
    def _map_errors(self, action: str) -> Iterator[None]:
        """Map native exceptions to TransportError / TransportClosed, once."""
        try:
            yield
        except TransportError:
            raise
        except trio.ClosedResourceError as exc:
            raise TransportClosed(f"transport closed while {action}") from exc
        except (trio.BrokenResourceError, OSError, ssl.SSLError) as exc:
            if self._closed:
                raise TransportClosed(f"transport closed while {action}") from exc
            raise TransportError(f"{action} failed: {describe_error(exc)}") from exc

    async def _receive_some(self, max_bytes: int) -> bytes:
        """Up to max_bytes from the stream (b"" at EOF), pushed-back bytes first."""
        if self._pushback:
            data, self._pushback = self._pushback, b""
            await trio.lowlevel.checkpoint()
            return data
        if self._eof:
            await trio.lowlevel.checkpoint()
            return b""
        with self._map_errors("receiving"):
            received = await self._stream.receive_some(max_bytes)
        if not received:
            self._eof = True
        return received if isinstance(received, bytes) else bytes(received)

    async def _send_raw(self, data: bytes | bytearray | memoryview) -> None:
        """Write to the stream; the caller holds the send lock."""
        try:
            with self._map_errors("sending"):
                await self._stream.send_all(data)
        except BaseException as exc:
            # A partial write (error or cancellation) leaves the peer mid-record.
            self._broken = self._broken or f"an earlier send failed ({type(exc).__name__})"
            raise

    def _check_can_send(self) -> None:
        if self._closed:
            raise TransportClosed("transport is closed")
        if self._broken is not None:
            raise TransportError(f"transport unusable: {self._broken}")

    async def _close_stream(self) -> None:
        """Close the underlying stream: politely if nobody is mid-send, else at once."""
        if self._send_lock.locked() or self._broken is not None:
            await trio.aclose_forcefully(self._stream)
            return
        try:
            with trio.move_on_after(self._close_timeout):
                await self._stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ssl.SSLError):
            pass
        finally:
            # A cancelled or timed-out aclose leaves the socket open on some streams;
            # closing again is idempotent and never blocks.
            await _aclose_now(self._stream)


async def _aclose_now(stream: trio.abc.AsyncResource) -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        with contextlib.suppress(Exception):
            await stream.aclose()


class StreamTransport(_StreamOwner, Transport):
    """The tunnel's bytes directly on a trio Stream (TLS or plain TCP): no framing, fewest
    copies. `initial` is data already read from the stream (it is returned first)."""

    def __init__(self, stream: trio.abc.Stream, peer: PeerInfo, *,
                 receive_size: int = STREAM_RECEIVE_SIZE,
                 close_timeout: float = CLOSE_TIMEOUT, initial: bytes = b"") -> None:
        super().__init__(stream, peer, close_timeout, initial)
        self._receive_size = receive_size

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        self._check_can_send()
        async with self._send_lock:
            self._check_can_send()
            if len(data):
                await self._send_raw(data)
            else:
                await trio.lowlevel.checkpoint()

    async def receive(self) -> bytes:
        if self._closed and not self._pushback:
            raise TransportClosed("transport is closed")
        return await self._receive_some(self._receive_size)

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        await self._close_stream()


# ---------------------------------------------------------------------------- WebSocket


@dataclass(frozen=True)
class _PeerClosed:
    code: int
    reason: str


@dataclass(frozen=True)
class _Failed:
    message: str


_WsEvent = bytes | _PeerClosed | _Failed


class _Codec(abc.ABC):
    """A sans-IO WebSocket connection after the opening handshake, reduced to what the
    transport needs: binary messages in and out, the close handshake, failures."""

    @abc.abstractmethod
    def feed(self, data: bytes) -> list[_WsEvent]:
        """Bytes from the network (b"" = EOF) → complete messages, close, failure."""

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


class _WebsocketsCodec(_Codec):
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


class _WsprotoCodec(_Codec):
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


class WebSocketTransport(_StreamOwner, Transport):
    """The tunnel's bytes in WebSocket binary messages. One `send()` is one message (split
    at `max_message_size`); `receive()` returns one message's bytes; the peer's close
    frame is a clean end (b""), a text or oversized message a TransportError."""

    def __init__(self, stream: trio.abc.Stream, codec: _Codec, peer: PeerInfo, *,
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


# ------------------------------------------------------------------------- handshakes


class WebSocketHandshakeError(TransportError):
    """The HTTP upgrade failed. `status` is the HTTP status the server answered (client
    side) or that we answered (server side), if any; `reason` a short word for logs."""

    def __init__(self, message: str, reason: str = "http", status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


async def _receive_handshake_bytes(stream: trio.abc.Stream, received: int) -> bytes:
    if received > MAX_HANDSHAKE_SIZE:
        raise WebSocketHandshakeError(
            f"HTTP upgrade larger than {MAX_HANDSHAKE_SIZE} bytes", reason="http")
    try:
        data = await stream.receive_some(16 * 1024)
    except (trio.BrokenResourceError, OSError, ssl.SSLError) as exc:
        reason = "tls" if is_tls_error(exc) else "closed"
        raise WebSocketHandshakeError(
            f"connection failed during the HTTP upgrade: {describe_error(exc)}",
            reason=reason) from exc
    return bytes(data)


async def _send_handshake_bytes(stream: trio.abc.Stream, chunks: Sequence[bytes]) -> None:
    data = b"".join(chunks)
    if not data:
        return
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, OSError, ssl.SSLError) as exc:
        reason = "tls" if is_tls_error(exc) else "closed"
        raise WebSocketHandshakeError(
            f"connection failed during the HTTP upgrade: {describe_error(exc)}",
            reason=reason) from exc


async def websocket_connect(
    stream: trio.abc.Stream, *, impl: WebSocketImpl, host: str, port: int, path: str,
    secure: bool, peer: PeerInfo, headers: Sequence[tuple[str, str]] = (),
    max_message_size: int = MAX_MESSAGE_SIZE,
) -> WebSocketTransport:
    """Client side of the upgrade on an open stream (the caller applies the timeout and
    closes the stream on failure). Raises WebSocketHandshakeError."""
    default_port = 443 if secure else 80
    host_header = f"[{host}]" if ":" in host else host
    if port != default_port:
        host_header = f"{host_header}:{port}"
    codec: _Codec
    if impl == "websockets":
        scheme = "wss" if secure else "ws"
        uri = websockets.uri.parse_uri(f"{scheme}://{host_header}{path}")
        proto = websockets.client.ClientProtocol(uri, max_size=max_message_size)
        request = proto.connect()
        for name, value in headers:
            request.headers[name] = value
        proto.send_request(request)
        await _send_handshake_bytes(stream, proto.data_to_send())
        received = 0
        while True:
            data = await _receive_handshake_bytes(stream, received)
            received += len(data)
            if data:
                proto.receive_data(data)
            else:
                proto.receive_eof()
            events = proto.events_received()
            response = next((e for e in events if isinstance(e, websockets.http11.Response)),
                            None)
            if response is not None or proto.handshake_exc is not None:
                break
            if not data:
                raise WebSocketHandshakeError(
                    "server closed the connection during the HTTP upgrade", reason="closed")
        if proto.handshake_exc is not None:
            exc = proto.handshake_exc
            if isinstance(exc, websockets.exceptions.InvalidStatus):
                status = exc.response.status_code
                raise WebSocketHandshakeError(
                    f"server answered HTTP {status} {exc.response.reason_phrase} "
                    f"to the WebSocket upgrade for {path}", status=status)
            raise WebSocketHandshakeError(f"invalid WebSocket upgrade response: {exc}")
        rest = events[events.index(response) + 1:] if response is not None else []
        codec = _WebsocketsCodec(proto, rest)
    else:
        ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        extra = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]
        try:
            out = ws.send(wsproto.events.Request(host=host_header, target=path,
                                                 extra_headers=extra))
        except wsproto.utilities.LocalProtocolError as exc:
            raise WebSocketHandshakeError(f"cannot build the upgrade request: {exc}") from exc
        await _send_handshake_bytes(stream, [out])
        received = 0
        accepted = False
        while not accepted:
            data = await _receive_handshake_bytes(stream, received)
            received += len(data)
            try:
                ws.receive_data(data or None)
                for event in ws.events():
                    if isinstance(event, wsproto.events.AcceptConnection):
                        accepted = True
                        break
                    if isinstance(event, wsproto.events.RejectConnection):
                        raise WebSocketHandshakeError(
                            f"server answered HTTP {event.status_code} to the WebSocket "
                            f"upgrade for {path}", status=event.status_code)
            except wsproto.utilities.RemoteProtocolError as exc:
                raise WebSocketHandshakeError(
                    f"invalid WebSocket upgrade response: {exc}") from exc
            if not accepted and not data:
                raise WebSocketHandshakeError(
                    "server closed the connection during the HTTP upgrade", reason="closed")
        codec = _WsprotoCodec(ws, max_message_size)
    transport = WebSocketTransport(stream, codec, peer, impl=impl,
                                   max_message_size=max_message_size)
    _take_pending(transport, codec)
    return transport


def _take_pending(transport: WebSocketTransport, codec: _Codec) -> None:
    # Frames that arrived in the same read as the upgrade's end.
    if isinstance(codec, _WebsocketsCodec | _WsprotoCodec):
        transport._take(codec.pending_events())


def _path_only(target: str) -> str:
    return target.split("?", 1)[0] or "/"


async def websocket_accept(
    stream: trio.abc.Stream, *, impl: WebSocketImpl, path: str, peer: PeerInfo,
    max_message_size: int = MAX_MESSAGE_SIZE,
) -> WebSocketTransport:
    """Server side of the upgrade: read the request, answer 404 unless its path is
    `path`, else 101. The returned transport's PeerInfo carries the request headers
    (lower-case names). Raises WebSocketHandshakeError (after answering, when an answer
    makes sense)."""
    want = _path_only(path)
    codec: _Codec
    received = 0
    if impl == "websockets":
        proto = websockets.server.ServerProtocol(max_size=max_message_size)
        request: websockets.http11.Request | None = None
        while request is None:
            data = await _receive_handshake_bytes(stream, received)
            received += len(data)
            if data:
                proto.receive_data(data)
            else:
                proto.receive_eof()
            events = proto.events_received()
            request = next((e for e in events if isinstance(e, websockets.http11.Request)),
                           None)
            if request is None and (proto.handshake_exc is not None or not data):
                await _send_handshake_bytes(stream, proto.data_to_send())
                if proto.handshake_exc is not None:
                    raise WebSocketHandshakeError(
                        f"invalid HTTP upgrade request: {proto.handshake_exc}")
                raise WebSocketHandshakeError(
                    "client closed the connection before finishing the upgrade request",
                    reason="closed")
        if _path_only(request.path) != want:
            response = proto.reject(404, f"No WebSocket endpoint at {_path_only(request.path)}\n")
            proto.send_response(response)
            await _send_handshake_bytes(stream, proto.data_to_send())
            raise WebSocketHandshakeError(
                f"upgrade request for unknown path {_path_only(request.path)}", status=404)
        response = proto.accept(request)
        proto.send_response(response)
        await _send_handshake_bytes(stream, proto.data_to_send())
        if response.status_code != 101:
            raise WebSocketHandshakeError(
                f"invalid WebSocket upgrade request: {proto.handshake_exc}",
                status=response.status_code)
        header_items = tuple((k.lower(), v) for k, v in request.headers.raw_items())
        rest = events[events.index(request) + 1:]
        codec = _WebsocketsCodec(proto, rest)
    else:
        ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
        ws_request: wsproto.events.Request | None = None
        while ws_request is None:
            data = await _receive_handshake_bytes(stream, received)
            received += len(data)
            try:
                ws.receive_data(data or None)
                for event in ws.events():
                    if isinstance(event, wsproto.events.Request):
                        ws_request = event
                        break
            except wsproto.utilities.RemoteProtocolError as exc:
                hint = exc.event_hint
                if isinstance(hint, wsproto.events.RejectConnection):
                    with contextlib.suppress(wsproto.utilities.LocalProtocolError):
                        await _send_handshake_bytes(stream, [ws.send(hint)])
                raise WebSocketHandshakeError(f"invalid HTTP upgrade request: {exc}") from exc
            if ws_request is None and not data:
                raise WebSocketHandshakeError(
                    "client closed the connection before finishing the upgrade request",
                    reason="closed")
        target = _path_only(ws_request.target)
        if target != want:
            body = f"No WebSocket endpoint at {target}\n".encode()
            out = ws.send(wsproto.events.RejectConnection(
                status_code=404, has_body=True,
                headers=[(b"content-type", b"text/plain; charset=utf-8"),
                         (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]))
            out += ws.send(wsproto.events.RejectData(data=body))
            await _send_handshake_bytes(stream, [out])
            raise WebSocketHandshakeError(f"upgrade request for unknown path {target}",
                                          status=404)
        await _send_handshake_bytes(stream, [ws.send(wsproto.events.AcceptConnection())])
        # wsproto leaves out Host and the extension/subprotocol headers; put Host back
        # so PeerInfo.headers looks the same whichever core parsed the request.
        header_items = (("host", ws_request.host), *(
            (bytes(k).decode("latin-1").lower(), bytes(v).decode("latin-1"))
            for k, v in ws_request.extra_headers))
        codec = _WsprotoCodec(ws, max_message_size)
    full_peer = PeerInfo(address=peer.address, certificate_der=peer.certificate_der,
                         headers=header_items)
    transport = WebSocketTransport(stream, codec, full_peer, impl=impl,
                                   max_message_size=max_message_size)
    _take_pending(transport, codec)
    return transport
