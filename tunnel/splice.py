"""Join two byte streams both ways, preserving half-close, until both are done.

A tunnel stream joined to a TCP socket (every relay: the agent's targets, the server's TCP
mappings, intercepted connections) is carried by the splice loop of the stream's tunnel
connection (spliceloop.py): no task, nursery or cancel scope per stream, and a caller that
need not wait for the end hands the pair over (`spliceloop.splice_in_loop`, as
`relay.relay_incoming` does) and keeps no task either. Other pairs (TLS, a stream to a
stream, test doubles) are copied by a task per direction here.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

import trio

from tunnel.spliceloop import SpliceEnd, splice_in_loop
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

    if isinstance(a, TunnelStream) and isinstance(b, trio.SocketStream):
        return await _splice_in_loop(a, b, True, a_leftover, b_leftover)
    if isinstance(b, TunnelStream) and isinstance(a, trio.SocketStream):
        return await _splice_in_loop(b, a, False, b_leftover, a_leftover)
    try:
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


def result_of(end: SpliceEnd, stream_first: bool) -> SpliceResult:
    """A loop's SpliceEnd as splice() reports it (a: the first argument)."""
    if stream_first:
        return SpliceResult(end.to_socket, end.to_tunnel, end.error)
    return SpliceResult(end.to_tunnel, end.to_socket, end.error)


async def _splice_in_loop(stream: TunnelStream, sock: trio.SocketStream, stream_first: bool,
                          to_socket: bytes, to_tunnel: bytes) -> SpliceResult:
    """A stream and a TCP socket: carried by the connection's splice loop (no task of
    their own), this task only waits for the end. Cancelled, it closes both."""
    ended: list[SpliceEnd] = []
    done = trio.Event()

    def on_end(end: SpliceEnd) -> None:
        ended.append(end)
        done.set()

    handle = splice_in_loop(stream, sock, on_end=on_end, to_socket=to_socket,
                            to_tunnel=to_tunnel)
    try:
        await done.wait()
    finally:
        handle.close()
    return result_of(ended[0], stream_first)


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
