"""Frame reassembly: completing a frame that arrived split across reads.

A read usually holds whole frames, which `Connection` parses in place; only a frame cut
by the end of a read is kept, in a small buffer, and completed here from the next read
with just the bytes it lacks. So the byte stream is never copied through a reassembly
buffer, and the buffer never holds more than one frame.
"""

from __future__ import annotations

from tunnel.protocol.errors import ErrorCode, RemoteProtocolError
from tunnel.protocol.wire import HEADER_SIZE


def complete_pending(inbuf: bytearray, data: bytes | memoryview, limit: int) -> int:
    """Move bytes from `data` into the partial frame in `inbuf` until that frame is
    complete. Returns how many bytes of `data` it took, or -1 when `data` ran out first
    (then all of it is in `inbuf`). A frame longer than `limit` is a protocol error."""
    size = len(data)
    pos = 0
    with memoryview(data) as view:
        if len(inbuf) < HEADER_SIZE:
            pos = min(HEADER_SIZE - len(inbuf), size)
            inbuf += view[:pos]
            if len(inbuf) < HEADER_SIZE:
                return -1
        length = int.from_bytes(inbuf[:3], "big")
        if length > limit:
            raise RemoteProtocolError(
                f"frame of {length} bytes exceeds the limit of {limit}",
                ErrorCode.FRAME_SIZE_ERROR)
        missing = HEADER_SIZE + length - len(inbuf)
        take = min(missing, size - pos)
        if take > 0:
            inbuf += view[pos:pos + take]
            pos += take
    return pos if take >= missing else -1
