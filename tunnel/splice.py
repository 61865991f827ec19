"""Join two byte streams both ways, preserving half-close, until both are done."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

import trio

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

    # One coroutine per direction (no helper frames): an idle spliced connection is
    # mostly these two suspended tasks, and there may be thousands of them.
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
            if result.error is None:
                result.error = f"{type(exc).__name__}: {exc}"
            scope.cancel()
        finally:
            if forward:
                result.a_to_b += moved
            else:
                result.b_to_a += moved

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(guarded, a, b, True, a_leftover, nursery.cancel_scope)
            nursery.start_soon(guarded, b, a, False, b_leftover, nursery.cancel_scope)
    finally:
        with trio.CancelScope(shield=True):
            aborted = result.error is not None
            await close_stream(a, abort=aborted)
            await close_stream(b, abort=aborted)
    return result


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
