"""The stream transport and what every transport over a trio Stream shares.

`StreamOwner` owns one trio Stream for a transport: serialized sends, a close that is
idempotent, bounded in time and safe while other tasks are blocked, and the one place
where native exceptions (trio, OSError, ssl) become `TransportError` / `TransportClosed`.
`StreamTransport` is the tunnel's bytes directly on such a stream: a `TLSStream` for
`tls://`, a raw `trio.SocketStream` for `tcp://`.
"""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import Iterator

import trio

from tunnel.transports.base import (
    STREAM_RECEIVE_SIZE,
    PeerInfo,
    Transport,
    TransportClosed,
    TransportError,
)
from tunnel.transports.tcpstate import unacknowledged_wait
from tunnel.transports.tls import TLSStream, describe_error

__all__ = ["CLOSE_TIMEOUT", "StreamOwner", "StreamTransport", "socket_of"]

# What `StreamOwner` maps to TransportError / TransportClosed (TransportError passes as is).
_NATIVE_ERRORS = (trio.ClosedResourceError, trio.BrokenResourceError, OSError, ssl.SSLError)

# How long aclose() tries to say goodbye (close frame, TLS close_notify) before it just
# closes the socket.
CLOSE_TIMEOUT = 2.0


def socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    """The socket under a (TLS) stream, for getsockopt and friends."""
    while True:
        if isinstance(stream, trio.SocketStream):
            return stream.socket
        if isinstance(stream, TLSStream | trio.SSLStream):
            stream = stream.transport_stream
        else:
            return None


class StreamOwner:
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

    def unacknowledged_wait(self) -> float | None:
        sock = socket_of(self._stream)
        return None if sock is None else unacknowledged_wait(sock)

    @contextlib.contextmanager
    def _map_errors(self, action: str) -> Iterator[None]:
        """Map native exceptions to TransportError / TransportClosed, once."""
        try:
            yield
        except _NATIVE_ERRORS as exc:
            raise self._mapped(exc, action) from exc

    def _mapped(self, exc: BaseException, action: str) -> TransportError:
        """The TransportError for a native exception (`_NATIVE_ERRORS`)."""
        if isinstance(exc, trio.ClosedResourceError) or self._closed:
            return TransportClosed(f"transport closed while {action}")
        return TransportError(f"{action} failed: {describe_error(exc)}")

    async def _receive_some(self, max_bytes: int) -> bytes:
        """Up to max_bytes from the stream (b"" at EOF), pushed-back bytes first."""
        if self._pushback:
            data, self._pushback = self._pushback, b""
            await trio.lowlevel.checkpoint()
            return data
        if self._eof:
            await trio.lowlevel.checkpoint()
            return b""
        # Not _map_errors: a context manager per read costs more than the read's Python.
        try:
            received = await self._stream.receive_some(max_bytes)
        except _NATIVE_ERRORS as exc:
            raise self._mapped(exc, "receiving") from exc
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


class StreamTransport(StreamOwner, Transport):
    """The tunnel's bytes directly on a trio Stream (TLS or plain TCP): no framing, fewest
    copies. `initial` is data already read from the stream (it is returned first)."""

    def __init__(self, stream: trio.abc.Stream, peer: PeerInfo, *,
                 receive_size: int = STREAM_RECEIVE_SIZE,
                 close_timeout: float = CLOSE_TIMEOUT, initial: bytes = b"") -> None:
        super().__init__(stream, peer, close_timeout, initial)
        self._receive_size = receive_size
        # Bytes send_nowait() could not write at once on a plain socket: sent first by
        # the next send() (for TLS the TLSStream keeps them, as whole records).
        self._raw_unsent = b""

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        self._check_can_send()
        async with self._send_lock:
            self._check_can_send()
            if self._raw_unsent:
                data, self._raw_unsent = self._raw_unsent + bytes(data), b""
            if len(data) or isinstance(self._stream, TLSStream):
                await self._send_raw(data)  # an empty TLS send flushes what it kept
            else:
                await trio.lowlevel.checkpoint()

    async def send_pieces(self, pieces: list[bytes | memoryview]) -> None:
        stream = self._stream
        if not isinstance(stream, TLSStream):
            await super().send_pieces(pieces)
            return
        self._check_can_send()
        async with self._send_lock:
            self._check_can_send()
            try:
                with self._map_errors("sending"):
                    await stream.send_pieces(pieces)
            except BaseException as exc:
                # A partial write (error or cancellation) leaves the peer mid-record.
                self._broken = self._broken or f"an earlier send failed ({type(exc).__name__})"
                raise

    def can_send_nowait(self) -> bool:
        if self._closed or self._broken is not None or self._send_lock.locked():
            return False
        stream = self._stream
        if isinstance(stream, TLSStream):
            return stream.can_send_nowait()
        return not self._raw_unsent and isinstance(stream, trio.SocketStream)

    def send_nowait(self, data: bytes | bytearray | memoryview) -> bool:
        stream = self._stream
        if isinstance(stream, TLSStream):
            return stream.send_nowait(data)
        assert isinstance(stream, trio.SocketStream) and self.can_send_nowait()
        try:
            sent = os.write(stream.socket.fileno(), data)
        except OSError:  # would block, or broken: the next send() sees which
            sent = 0
        if sent < len(data):
            self._raw_unsent = bytes(memoryview(data)[sent:])
            return False
        return True

    def send_pieces_nowait(self, pieces: list[bytes | memoryview]) -> bool:
        stream = self._stream
        if isinstance(stream, TLSStream):
            return stream.send_pieces_nowait(pieces)
        return super().send_pieces_nowait(pieces)

    async def receive(self) -> bytes:
        if self._closed and not self._pushback:
            raise TransportClosed("transport is closed")
        return await self._receive_some(self._receive_size)

    async def receive_view(self) -> bytes | memoryview:
        stream = self._stream
        if not isinstance(stream, TLSStream) or self._pushback or self._eof:
            return await self.receive()
        if self._closed:
            raise TransportClosed("transport is closed")
        try:
            received = await stream.receive_shared(self._receive_size)
        except _NATIVE_ERRORS as exc:
            raise self._mapped(exc, "receiving") from exc
        if not received:
            self._eof = True
        return received

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        await self._close_stream()
