"""Join two byte streams both ways, preserving half-close, until both are done.

A tunnel stream joined to a TCP socket (every relay: the agent's targets, the server's TCP
mappings, intercepted connections) takes a shorter way tunnel → socket: the connection's
reader writes each frame straight into the socket, without waking a task, and only what
the socket cannot take at once waits for a drain task started for that moment. That
direction then costs no task switch per frame and no task per idle connection
(`python -m scripts.bench.tunnel` measures it); socket → tunnel stays a task, as reading
a socket has to wait somewhere. The drain task starts through the stream's connection
(`StreamCarrier.start_task`).
"""

from __future__ import annotations

import collections
import os
import socket
import struct
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import trio

from tunnel.errors import StreamResetError
from tunnel.stream import TunnelStream
from tunnel.transports import TransportError

CHUNK = 256 * 1024
_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, TransportError, OSError)


@dataclass
class SpliceResult:
    a_to_b: int = 0
    b_to_a: int = 0
    error: str | None = None  # why it ended abnormally, for the log line


async def splice(a: trio.abc.Stream, b: trio.abc.Stream, *, chunk: int = CHUNK,
                 a_leftover: bytes = b"", b_leftover: bytes = b"") -> SpliceResult:
    """Copy a→b and b→a concurrently. EOF on one side becomes a half-close (send_eof) on
    the other, so request/response protocols that half-close work; a side that cannot be
    half-closed (TLS) is closed, which ends both directions. If either direction breaks,
    both streams are aborted (a TCP peer sees a reset, a tunnel stream an RST): a failure
    is never turned into a clean-looking EOF. Closes both streams at the end.

    `a_leftover` / `b_leftover`: bytes already read from a / b (past an HTTP head, say),
    written to the other side before anything else."""
    result = SpliceResult()

    def fail(exc: BaseException, scope: trio.CancelScope) -> None:
        if result.error is None:
            result.error = f"{type(exc).__name__}: {exc}"
        scope.cancel()

    # One coroutine per direction (no helper frames): an idle spliced connection is
    # mostly suspended tasks, and there may be thousands of them.
    async def guarded(src: trio.abc.Stream, dst: trio.abc.Stream, forward: bool,
                      leftover: bytes, scope: trio.CancelScope) -> None:
        moved = 0
        try:
            if leftover:
                await dst.send_all(leftover)
                moved += len(leftover)
            while True:
                data = await src.receive_some(chunk)
                if not data:
                    if isinstance(dst, trio.abc.HalfCloseableStream):
                        await dst.send_eof()
                    else:
                        scope.cancel()
                    return
                await dst.send_all(data)
                moved += len(data)
        except _BROKEN as exc:
            fail(exc, scope)
        finally:
            if forward:
                result.a_to_b += moved
            else:
                result.b_to_a += moved

    try:
        if isinstance(a, TunnelStream) and isinstance(b, trio.SocketStream):
            # No nursery: this task carries socket → tunnel, the reader tunnel → socket.
            with trio.CancelScope() as scope:
                await _direct(a, b, a_leftover, result, True, lambda e: fail(e, scope),
                              guarded(b, a, False, b_leftover, scope))
        elif isinstance(b, TunnelStream) and isinstance(a, trio.SocketStream):
            with trio.CancelScope() as scope:
                await _direct(b, a, b_leftover, result, False, lambda e: fail(e, scope),
                              guarded(a, b, True, a_leftover, scope))
        else:
            async with trio.open_nursery() as nursery:
                scope = nursery.cancel_scope
                # b→a in a task of its own, a→b in this one: a task fewer per connection.
                nursery.start_soon(guarded, b, a, False, b_leftover, scope)
                await guarded(a, b, True, a_leftover, scope)
    finally:
        with trio.CancelScope(shield=True):
            aborted = result.error is not None
            await close_stream(a, abort=aborted)
            await close_stream(b, abort=aborted)
    return result


async def _direct(tunnel: TunnelStream, sock: trio.SocketStream, leftover: bytes,
                  result: SpliceResult, forward: bool, fail: Callable[[BaseException], None],
                  socket_to_tunnel: Coroutine[Any, Any, None]) -> None:
    """Tunnel → socket by a `_SocketSink`, socket → tunnel by the `socket_to_tunnel`
    coroutine run here; counts the bytes moved tunnel → socket into `result` (a_to_b if
    `forward`). `leftover` (already read from the tunnel) and what the stream buffered
    before the sink was attached go first."""
    sink = _SocketSink(tunnel, sock, fail)
    try:
        try:
            if leftover:
                await sock.send_all(leftover)
                sink.moved += len(leftover)
            while data := tunnel.take_buffered():
                await sock.send_all(data)
                tunnel.consumed(len(data))
                sink.moved += len(data)
        except _BROKEN as exc:
            socket_to_tunnel.close()
            fail(exc)
            return
        tunnel.attach_sink(sink)
        if data == b"":
            sink.on_eof()
        elif tunnel.reset_reason is not None:
            sink.on_reset(tunnel.reset_reason)
        await socket_to_tunnel
        await sink.done.wait()
    finally:
        socket_to_tunnel.close()  # never started if cancelled first: no "never awaited"
        tunnel.attach_sink(None)
        sink.release()
        if forward:
            result.a_to_b += sink.moved
        else:
            result.b_to_a += sink.moved


class _SocketSink:
    """Tunnel → socket without a task (see the module docstring). Writes are non-blocking
    `os.write`s on the socket's descriptor, whose other direction a task reads; the
    stream's flow-control credit returns only for bytes the socket took, so a target that
    stops reading stops its sender at the stream's window, as a task would. What the
    socket cannot take at once is drained by a task in the tunnel connection's nursery
    (the splice has none); the splice waits for it (`done`), and closing the socket at
    the end of a failed splice ends it."""

    __slots__ = ("_eof", "_fail", "_fd", "_pending", "_sock", "_stream", "done", "moved")

    def __init__(self, stream: TunnelStream, sock: trio.SocketStream,
                 fail: Callable[[BaseException], None]) -> None:
        self._stream = stream
        self._sock = sock
        self._fd = sock.socket.fileno()
        self._fail = fail
        self._pending: collections.deque[bytes] | None = None
        self._eof = False
        self.moved = 0
        self.done = trio.Event()  # set at EOF passed on, or on failure

    def on_data(self, data: bytes) -> None:
        if self.done.is_set():
            self._stream.consumed(len(data))
            return
        if self._pending is not None:
            self._pending.append(data)
            return
        try:
            sent = os.write(self._fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._stream.consumed(len(data))
            self._finish(exc)
            return
        if sent:
            self.moved += sent
            self._stream.consumed(sent)
        if sent < len(data):
            self._pending = collections.deque((data[sent:],))
            if not self._stream.connection.start_task(self._drain):
                # The connection is ending: the stream is reset next.
                self._finish(trio.ClosedResourceError("tunnel connection ended"))

    def on_eof(self) -> None:
        self._eof = True
        if self._pending is None and not self.done.is_set():
            self._shutdown()

    def on_reset(self, error: StreamResetError) -> None:
        self._finish(error)

    async def _drain(self) -> None:
        pending = self._pending
        if pending is None or self.done.is_set():
            return
        try:
            while pending:
                data = pending[0]
                await self._sock.send_all(data)
                pending.popleft()
                self.moved += len(data)
                self._stream.consumed(len(data))
        except Exception as exc:
            # In the connection's nursery: end the splice, never the tunnel connection.
            self._finish(exc)
            return
        self._pending = None
        if self._eof:
            self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._sock.socket.shutdown(socket.SHUT_WR)
        except OSError as exc:
            self._finish(exc)
            return
        self.done.set()

    def _finish(self, error: BaseException) -> None:
        if not self.done.is_set():
            self.done.set()
            self._fail(error)
        self.release()

    def release(self) -> None:
        """Give back the credit of data that will never be passed on."""
        if self._pending:
            size = sum(map(len, self._pending))
            self._pending.clear()
            self._stream.consumed(size)


async def close_stream(stream: trio.abc.Stream, *, abort: bool = False) -> None:
    """Close a stream; with abort, make a TCP socket send RST instead of FIN."""
    if abort and isinstance(stream, trio.SocketStream):
        try:
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    try:
        await stream.aclose()
    except _BROKEN:
        pass
