"""A tunnel stream as the HTTP front's HTTP/1.1 upstream, with fewer task switches.

An HTTP/1.1 upstream through a node's tunnel carries one request, then one response, in
turn: the front sends a head (a frame) and waits for the answer (a frame or two). Through
`TunnelStream`'s own `send_all` and `receive_some` that costs two schedule points the
front does not need: `send_all` ends with one although the front waits for the response
next, and `receive_some` takes one more after the reader's wake-up although the task has
just been scheduled. `TunnelUpstream` is the same stream seen through the tunnel's
interface for senders that are not tasks (`send_nowait`, then `send_queued`) and a direct
sink (`DirectSink`: the connection's reader hands each frame over as it arrives, as for
the splice loop): a send queues the frames and wakes the writer, a receive that has to
wait returns as soon as it is woken, and a receive that finds data already there still
takes a checkpoint, so every call that does not wait can be cancelled and lets others
run. Flow control is the stream's: credit returns as the front takes the bytes
(`consumed`), and a send beyond the window waits for `on_window`.

`release()` gives the bare stream back (and the bytes it held), for a protocol switch
(a 101's splice has a faster path for a bare `TunnelStream`).
"""

from __future__ import annotations

import collections

import trio

from tunnel.errors import StreamResetError
from tunnel.stream import RECEIVE_COALESCE, TunnelStream


class TunnelUpstream(trio.abc.HalfCloseableStream):
    """`stream` for a single task that sends, then receives, in turn (see the module)."""

    __slots__ = ("_chunks", "_eof", "_error", "_ready", "_window", "stream")

    def __init__(self, stream: TunnelStream) -> None:
        self.stream = stream
        self._chunks: collections.deque[bytes] = collections.deque()
        self._ready: trio.Event | None = None  # a receive waits for data
        self._window: trio.Event | None = None  # a send waits for credit
        # What arrived before the sink (it may be attached only to an empty stream): the
        # peer's first bytes, its EOF or reset may come with its ACCEPT, in one read.
        early = stream.take_buffered()
        if early:
            self._chunks.append(early)
            early = stream.take_buffered()
        self._eof = early == b""
        self._error: StreamResetError | None = stream.reset_reason
        stream.attach_sink(self)

    # -- the stream's direct sink (called by the connection's reader)

    def on_data(self, data: bytes | memoryview) -> None:
        self._chunks.append(bytes(data))  # lent by the reader: a copy to keep
        self._wake()

    def on_delivered(self) -> None:
        pass  # each frame was handed over (and its receiver woken) as it came

    def on_eof(self) -> None:
        self._eof = True
        self._wake()

    def on_reset(self, error: StreamResetError) -> None:
        self._error = error
        self._wake()
        self.on_window()

    def on_window(self) -> None:
        window, self._window = self._window, None
        if window is not None:
            window.set()

    def _wake(self) -> None:
        ready, self._ready = self._ready, None
        if ready is not None:
            ready.set()

    # -- trio.abc.HalfCloseableStream

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        stream = self.stream
        view = memoryview(data)
        while True:
            view = view[stream.send_nowait(view):]  # raises like send_all
            if not view:
                break
            # No credit: on_window() follows (send_nowait's contract).
            window = self._window = trio.Event()
            await stream.connection.send_queued()
            await window.wait()
        # No schedule point of its own when it did not wait: the front's next step is
        # the response's receive, which waits.
        await stream.connection.send_queued()

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        limit = RECEIVE_COALESCE if max_bytes is None else max_bytes
        if limit < 1:
            raise ValueError("max_bytes must be >= 1")
        waited = False
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks.popleft()
                if len(data) > limit:
                    chunks.appendleft(data[limit:])
                    data = data[:limit]
                elif chunks and len(data) + len(chunks[0]) <= limit:
                    parts = [data]
                    size = len(data)
                    while chunks and size + len(chunks[0]) <= limit:
                        size += len(chunks[0])
                        parts.append(chunks.popleft())
                    data = b"".join(parts)
                self.stream.consumed(len(data))
                if not waited:
                    await trio.lowlevel.checkpoint()
                return data
            if self._error is not None:
                raise self._error
            if self._eof:
                if not waited:
                    await trio.lowlevel.checkpoint()
                return b""
            ready = self._ready = trio.Event()
            await ready.wait()
            waited = True

    async def aclose(self) -> None:
        self._give_back_credit()
        await self.stream.aclose()

    def release(self) -> tuple[TunnelStream, bytes]:
        """The bare stream and the bytes this wrapper held (they come first); the wrapper
        is done with it."""
        self.stream.attach_sink(None)
        data = b"".join(self._chunks)
        self._give_back_credit()
        return self.stream, data

    def _give_back_credit(self) -> None:
        held = sum(map(len, self._chunks))
        self._chunks.clear()
        if held:
            self.stream.consumed(held)
