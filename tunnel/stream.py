"""A tunnel stream as trio code sees it: `TunnelStream`, a trio HalfCloseableStream over one
stream of a tunnel connection (flow-controlled sends, a coalescing receive buffer,
half-close with FIN, abort with RST), and `IncomingStream`, a stream the peer opened that
the handler accepts or refuses. They hold no tasks of their own.

The seam between a stream and its connection is public both ways, and this module owns
it: `StreamCarrier` is what a stream needs of the connection that carries it
(`TunnelConnection` in endpoint.py implements it), and the connection's reader delivers
to a stream through its `*_received` / `window_opened` methods. So this module does not
import endpoint.py, and neither side touches the other's private members.
"""

from __future__ import annotations

import collections
import operator
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio
import trio.lowlevel

from tunnel import protocol as p
from tunnel.errors import StreamResetError, TunnelClosedError

# receive_some() without max_bytes joins buffered frames up to this size.
RECEIVE_COALESCE = 256 * 1024


class StreamCarrier(Protocol):
    """What a stream needs of the connection that carries it (`TunnelConnection`).

    The stream-level protocol actions queue frames; `send_queued()` gets them moving. On
    the hot path a send costs one `send_some()` and one `send_queued()` per window's worth
    of data: no task switch, and no allocation but the memoryview slices of the data."""

    @property
    def end_reason(self) -> TunnelClosedError | None:
        """Why the connection ended; None while it runs."""
        ...

    def send_some(self, stream_id: int, data: memoryview) -> int:
        """Queue as much of `data` as the stream's and the connection's send windows
        allow now; returns how many bytes (0: wait for credit, see wait_for_window)."""
        ...

    def wait_for_window(self, stream: TunnelStream) -> bool:
        """Call `stream.window_opened()` once send credit arrives (or the stream ends).
        False, and no call, if the stream is gone: no credit will ever come."""
        ...

    def end_stream(self, stream_id: int) -> None:
        """Queue FIN. Raises tunnel.protocol.LocalProtocolError if the stream cannot."""
        ...

    def send_datagram(self, stream_id: int, data: bytes | memoryview, *,
                      wake: bool = True) -> str | None:
        """Queue one datagram on a flow and wake the writer (`wake=False`: the caller
        calls flush() after its batch); never waits. None, or why it was dropped
        (too_large, queue_full, congested, closed)."""
        ...

    def flush(self) -> None:
        """Get what was queued moving, from the calling task: written at once when the
        transport takes it without waiting, else handed to the writer. A task that
        queued a batch (a UDP socket's reader) saves the writer's wake-up so."""
        ...

    def accept_stream(self, stream_id: int) -> None:
        """Queue ACCEPT for a stream the peer opened. Raises
        tunnel.protocol.ConnectionClosedError once the connection has ended."""
        ...

    def refuse_stream(self, stream_id: int, reason: p.StreamReason, message: str) -> None:
        """Queue REFUSE for a stream the peer opened; same errors as accept_stream()."""
        ...

    def reset_stream(self, stream_id: int, reason: p.StreamReason, message: str, *,
                     wake: bool = True) -> None:
        """Queue RST (a no-op for a stream already gone) and wake the writer (`wake=False`:
        the caller gets its output moving itself, as the splice loop does after a round)."""
        ...

    def acknowledge(self, stream_id: int, size: int) -> None:
        """The stream consumed `size` received bytes: return their credit to the peer."""
        ...

    def forget(self, stream: TunnelStream) -> None:
        """The stream is closed locally: deliver nothing more to it."""
        ...

    async def send_queued(self, *, now: bool = False) -> None:
        """Wake the writer for what was queued, and wait while the outgoing buffer is
        above its high-water mark. Raises `end_reason` once the connection has ended.
        `now`: write it in this task instead if the transport takes it at once, for a
        caller that gathered a whole round's output (the splice loop), not per stream."""
        ...

    def start_task(self, async_fn: Callable[[], Awaitable[None]]) -> bool:
        """Run `async_fn` in the connection's nursery, for work a direct sink cannot do
        synchronously; it must not raise. False, and nothing started, if the
        connection is ending."""
        ...


class DirectSink(Protocol):
    """Takes a stream's incoming data as the connection's reader delivers it, instead of a
    task calling receive_some() (spliceloop.py's splices). It calls `consumed()` on the
    stream for each byte it has passed on, which returns flow-control credit. It hears
    of send credit too (`on_window`), for a sender that is not a task (`send_nowait`)."""

    def on_data(self, data: bytes | memoryview) -> None:
        """A frame's payload, lent: valid until `on_delivered` returns (a view of the
        reader's buffer); the sink copies what it keeps longer."""

    def on_delivered(self) -> None:
        """The reader is done with one read's frames: data a sink held back since its
        first `on_data` of the read (to pass a read's frames on together) goes now, and
        what the sink keeps beyond this call it has copied."""

    def on_eof(self) -> None: ...

    def on_reset(self, error: StreamResetError) -> None: ...

    def on_window(self) -> None: ...


class DatagramSink(Protocol):
    """Takes a flow's datagrams as the connection's reader delivers them (tunnel/udp.py:
    a UDP socket). It must deliver or drop each at once, or at the latest when the
    reader ends that step (`on_datagrams_end`): datagrams are never buffered past it."""

    def on_datagram(self, data: bytes) -> None: ...

    def on_datagrams_end(self) -> None:
        """The reader delivered what one read of the tunnel held: a sink that held
        datagrams back (to send them together) sends them now."""

    def on_reset(self, error: StreamResetError) -> None: ...


class TunnelStream(trio.abc.HalfCloseableStream):
    """One stream of a tunnel connection, usable like a TCP connection."""

    # Thousands of these sit idle on a busy tunnel: no per-instance dict; the receive
    # buffer exists only while it holds data, and the two wake-up events only while a
    # task waits on them (an idle stream carries ~1.3 KB less per side).
    __slots__ = (
        "__weakref__",
        "_buffer",
        "_buffered",
        "_closed",
        "_conn",
        "_data_ready",
        "_datagram_sink",
        "_eof",
        "_fin_sent",
        "_recv_guard",
        "_reset",
        "_send_guard",
        "_sink",
        "_window_ready",
        "bytes_received",
        "bytes_sent",
        "metadata",
        "opened_at",
        "stream_id",
        "target",
    )

    def __init__(self, conn: StreamCarrier, stream_id: int, target: p.Target,
                 metadata: dict[str, str]) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.target = target
        self.metadata = metadata
        self._buffer: collections.deque[bytes] | None = None
        self._buffered = 0
        self._eof = False
        self._fin_sent = False
        self._closed = False
        self._reset: StreamResetError | None = None
        self._data_ready: trio.Event | None = None
        self._window_ready: trio.Event | None = None
        self._sink: DirectSink | None = None
        self._datagram_sink: DatagramSink | None = None
        self._send_guard = _Guard("another task is already sending on this stream")
        self._recv_guard = _Guard("another task is already receiving on this stream")
        self.bytes_sent = 0
        self.bytes_received = 0
        # When this side learnt of it (sent or received its OPEN), for the debug views.
        self.opened_at = time.monotonic()

    def __repr__(self) -> str:
        return f"<TunnelStream {self.stream_id} {self.target}>"

    @property
    def connection(self) -> StreamCarrier:
        """The connection that carries this stream."""
        return self._conn

    # ---- called by the connection (its reader, and its end), never by users

    def data_received(self, data: bytes | memoryview) -> None:
        """A frame's payload, lent until the reader's `delivered()` (see DirectSink):
        the buffer for a receiving task keeps a copy."""
        if self._closed:
            # Already closed locally: consume at once so connection credit returns.
            self._conn.acknowledge(self.stream_id, len(data))
            return
        if self._sink is not None:
            self._sink.on_data(data)
            return
        if self._buffer is None:
            self._buffer = collections.deque()
        self._buffer.append(bytes(data))
        self._buffered += len(data)
        self._wake_receiver()

    def datagram_received(self, data: bytes) -> None:
        """A datagram on this flow: to its sink, or dropped when there is none yet."""
        if self._datagram_sink is not None and not self._closed:
            self._datagram_sink.on_datagram(data)

    def delivered(self) -> None:
        """The reader is done with one read's data or datagrams for this stream."""
        if self._sink is not None:
            self._sink.on_delivered()
        elif self._datagram_sink is not None:
            self._datagram_sink.on_datagrams_end()

    def eof_received(self) -> None:
        self._eof = True
        if self._sink is not None:
            self._sink.on_eof()
        self._wake_receiver()

    def reset_received(self, reason: p.StreamReason, message: str) -> None:
        """The peer reset the stream, or the connection ended under it."""
        if self._reset is None:
            self._reset = StreamResetError(reason, message)
        if self._sink is not None:
            self._sink.on_reset(self._reset)
        if self._datagram_sink is not None:
            self._datagram_sink.on_reset(self._reset)
        self._wake_receiver()
        self.window_opened()

    def window_opened(self) -> None:
        """Send credit arrived (see StreamCarrier.wait_for_window): wake the sender."""
        if self._window_ready is not None:
            self._window_ready.set()
            self._window_ready = None
        if self._sink is not None:
            self._sink.on_window()

    def mark_closed(self) -> None:
        """The stream was finished without an RST of its own (an abandoned OPEN, a
        refusal): it is closed, and aclose() has nothing left to tell the peer."""
        self._closed = True

    # ---- a direct sink (see DirectSink)

    def take_buffered(self) -> bytes | None:
        """What arrived and was not received yet: data (counted as consumed by the
        caller's `consumed()`), b"" at EOF, None if nothing. Never waits."""
        if self._buffer:
            data = b"".join(self._buffer)
            self._buffer = None
            self._buffered -= len(data)
            return data
        return b"" if self._eof else None

    # ---- flows (a udp target): datagrams instead of bytes

    @property
    def is_flow(self) -> bool:
        return self.target.protocol == "udp"

    def attach_datagram_sink(self, sink: DatagramSink | None) -> None:
        """Deliver this flow's datagrams to `sink` from now on (None: drop them)."""
        self._datagram_sink = sink
        if sink is not None and self._reset is not None:
            sink.on_reset(self._reset)

    def send_datagram(self, data: bytes | memoryview, *, wake: bool = True) -> str | None:
        """Send one datagram on this flow, now or never: None if it was queued, else why
        it was dropped (too_large, queue_full, congested, closed). Never waits.
        `wake=False`: the caller sends a batch and then calls `connection.flush()`."""
        if self._reset is not None or self._closed:
            return "closed"
        dropped = self._conn.send_datagram(self.stream_id, data, wake=wake)
        if dropped is None:
            self.bytes_sent += len(data)
        return dropped

    def attach_sink(self, sink: DirectSink | None) -> None:
        """From now on incoming data, EOF and reset go to `sink` (None: back to
        receive_some). Attach only with nothing buffered (see take_buffered)."""
        if sink is not None and self._buffer:
            raise RuntimeError("drain the buffered data (take_buffered) before attaching")
        self._sink = sink

    def send_nowait(self, data: bytes | memoryview) -> int:
        """send_all() for a sender that is not a task (a direct sink's owner): queue what
        the send windows take now and return how much; 0 means no credit, and the sink's
        `on_window()` follows when some arrives. The caller gets the output moving
        (`connection.send_queued()`). Raises like send_all()."""
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        if self._fin_sent:
            raise trio.ClosedResourceError("send_eof() was called")
        if self._reset is not None:
            raise self._reset
        view = memoryview(data)
        conn = self._conn
        total = 0
        # Until the windows take no more: a short return always leaves the stream
        # waiting for credit (stream or connection), so on_window() follows.
        while view:
            sent = conn.send_some(self.stream_id, view)
            if not sent:
                if not conn.wait_for_window(self):
                    raise self._reset or StreamResetError(p.StreamReason.CANCELLED,
                                                          "stream closed")
                break
            total += sent
            view = view[sent:]
        self.bytes_sent += total
        return total

    def send_eof_nowait(self) -> None:
        """send_eof() without waiting, as send_nowait() is send_all()."""
        if self._fin_sent or self._closed:
            return
        if self._reset is not None:
            raise self._reset
        self._fin_sent = True
        try:
            self._conn.end_stream(self.stream_id)
        except p.LocalProtocolError as exc:
            raise StreamResetError(p.StreamReason.CANCELLED, str(exc)) from None

    def consumed(self, size: int) -> None:
        """A sink passed `size` bytes on (or dropped them, the stream being dead): count
        them and return their credit, which the connection needs back either way."""
        self.bytes_received += size
        self._conn.acknowledge(self.stream_id, size)

    def _wake_receiver(self) -> None:
        if self._data_ready is not None:
            self._data_ready.set()
            self._data_ready = None

    # ---- trio.abc.HalfCloseableStream

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send_guard:
            if self._closed:
                raise trio.ClosedResourceError("stream is closed")
            if self._fin_sent:
                raise trio.ClosedResourceError("send_eof() was called")
            view = memoryview(data)
            conn = self._conn
            waited = False
            while view:
                if self._reset is not None:
                    raise self._reset
                sent = conn.send_some(self.stream_id, view)
                if not sent:
                    ready = trio.Event()
                    if not conn.wait_for_window(self):
                        raise self._reset or StreamResetError(
                            p.StreamReason.CANCELLED, "stream closed")
                    self._window_ready = ready
                    await ready.wait()
                    waited = True
                    continue
                view = view[sent:]
                self.bytes_sent += sent
                await conn.send_queued()
            if not waited:  # a wait for the window was this call's checkpoint already
                await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        # Returning at once is allowed ("may return early"), but like send_all() it is
        # one sender's call, and a closed stream must say so.
        with self._send_guard:
            if self._closed:
                raise trio.ClosedResourceError("stream is closed")
            await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        with self._send_guard:
            await trio.lowlevel.checkpoint()
            if self._fin_sent or self._closed:
                return
            if self._reset is not None:
                raise self._reset
            self._fin_sent = True
            try:
                self._conn.end_stream(self.stream_id)
            except p.LocalProtocolError as exc:
                raise StreamResetError(p.StreamReason.CANCELLED, str(exc)) from None
            await self._conn.send_queued()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)  # TypeError for a float, as trio wants
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
        with self._recv_guard:
            if self._sink is not None:
                raise trio.BusyResourceError("a direct sink receives this stream's data")
            waited = False  # a wait for data is this call's checkpoint: one is enough
            while True:
                if self._closed:
                    raise trio.ClosedResourceError("stream is closed")
                buffer = self._buffer
                if buffer:
                    data = buffer.popleft()
                    if max_bytes is not None and len(data) > max_bytes:
                        buffer.appendleft(data[max_bytes:])
                        data = data[:max_bytes]
                    elif buffer:
                        data = self._coalesce(buffer, data, max_bytes or RECEIVE_COALESCE)
                    if not buffer:
                        self._buffer = None
                    self._buffered -= len(data)
                    self.bytes_received += len(data)
                    self._conn.acknowledge(self.stream_id, len(data))
                    if not waited:
                        await trio.lowlevel.checkpoint()
                    return data
                if self._eof:
                    if not waited:
                        await trio.lowlevel.checkpoint()
                    return b""
                if self._reset is not None:
                    raise self._reset
                ready = self._data_ready = trio.Event()
                await ready.wait()
                waited = True

    @staticmethod
    def _coalesce(buffer: collections.deque[bytes], data: bytes, limit: int) -> bytes:
        """Join further whole frames already buffered, up to `limit` bytes: one copy
        saves the reader a loop iteration and a syscall per frame in bulk transfers."""
        total = len(data)
        if total + len(buffer[0]) > limit:
            return data
        parts = [data]
        while buffer and total + len(buffer[0]) <= limit:
            chunk = buffer.popleft()
            parts.append(chunk)
            total += len(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        """Close. A stream still open in either direction is reset (CANCELLED), like a
        TCP close with data in flight; one finished both ways just goes away."""
        await self.abort(p.StreamReason.CANCELLED, "closed by the local side")

    async def abort(self, reason: p.StreamReason, message: str) -> None:
        self.abort_now(reason, message)
        await trio.lowlevel.checkpoint()

    def abort_now(self, reason: p.StreamReason, message: str, *, wake: bool = True) -> None:
        """abort() without the checkpoint, for owners that are not tasks (a flow handed
        to tunnel.udp.FlowPoller). `wake=False`: see StreamCarrier.reset_stream."""
        if self._closed:
            return
        self._closed = True
        if self._buffered:
            self._conn.acknowledge(self.stream_id, self._buffered)
            self._buffer = None
            self._buffered = 0
        self._conn.forget(self)
        if self._reset is None:
            self._conn.reset_stream(self.stream_id, reason, message, wake=wake)
            self._reset = StreamResetError(reason, message)
        self._wake_receiver()
        self.window_opened()

    @property
    def reset_reason(self) -> StreamResetError | None:
        return self._reset


class _Guard:
    """Raises trio.BusyResourceError when two tasks use one direction at once."""

    __slots__ = ("_held", "_message")

    def __init__(self, message: str) -> None:
        self._message = message
        self._held = False

    def __enter__(self) -> None:
        if self._held:
            raise trio.BusyResourceError(self._message)
        self._held = True

    def __exit__(self, *exc: object) -> None:
        self._held = False


class IncomingStream:
    """A stream the peer asked for; the handler accepts or refuses it."""

    def __init__(self, conn: StreamCarrier, stream: TunnelStream) -> None:
        self.connection = conn
        self.stream = stream
        self.answered = False
        # Set by hand_over(): the handler's return does not close the stream.
        self.handed_over = False

    @property
    def target(self) -> p.Target:
        return self.stream.target

    @property
    def metadata(self) -> dict[str, str]:
        return self.stream.metadata

    async def accept(self) -> TunnelStream:
        self.accept_now()
        await self.connection.send_queued()
        return self.stream

    def accept_now(self) -> TunnelStream:
        """accept() for an owner that is not a task (a dial in the splice loop): the
        ACCEPT is queued, and goes out with that owner's output."""
        self._answer()
        try:
            self.connection.accept_stream(self.stream.stream_id)
        except p.ConnectionClosedError:
            # The connection ended while the handler dialed, before its nursery cancelled
            # the handler: a routine end (BrokenResourceError), not a crash.
            raise StreamResetError(p.StreamReason.CANCELLED,
                                   f"tunnel connection ended: {self.connection.end_reason}",
                                   ) from None
        except p.StreamClosedError:
            # The peer reset the stream in the same read as its OPEN (an opener that gave
            # up at once): the core has dropped it, and the reset reaches this stream right
            # after the reader's taker returns. A routine race, not a crash.
            raise StreamResetError(p.StreamReason.CANCELLED,
                                   "the opener reset the stream before it was answered",
                                   ) from None
        return self.stream

    async def refuse(self, reason: p.StreamReason, message: str = "") -> None:
        if self.refuse_now(reason, message):
            await self.connection.send_queued()
        else:
            await trio.lowlevel.checkpoint()

    def refuse_now(self, reason: p.StreamReason, message: str = "") -> bool:
        """refuse() without waiting, as accept_now() is accept(): False if the connection
        had already ended (nobody to tell), else the REFUSE is queued."""
        self._answer()
        try:
            self.connection.refuse_stream(self.stream.stream_id, reason, message)
        except p.ConnectionClosedError:
            self.stream.mark_closed()
            return False
        except p.StreamClosedError:
            return False  # reset by the opener in the same read: its reset ends the stream
        self.connection.forget(self.stream)
        self.stream.mark_closed()
        return True

    def hand_over(self) -> None:
        """After accept(): another owner keeps the stream (e.g. a flow handed to
        tunnel.udp.FlowPoller, which needs no task per flow), so the handler may return
        without the stream being closed. That owner must close it."""
        if not self.answered:
            raise p.LocalProtocolError("hand_over() follows accept()")
        self.handed_over = True

    def _answer(self) -> None:
        if self.answered:
            raise p.LocalProtocolError("stream already answered")
        self.answered = True
        if self.stream.reset_reason is not None:
            raise self.stream.reset_reason


StreamHandler = Callable[[IncomingStream], Awaitable[None]]


class OpenAnswer(Protocol):
    """Hears how a stream this side opened without waiting (`open_stream_nowait`) was
    answered: from the connection's reader (ACCEPT or REFUSE), or from its end. Each is
    called at most once, and must not raise or wait."""

    def resolve(self, result: p.StreamAccepted | p.StreamRefused) -> None: ...

    def fail(self, error: BaseException) -> None: ...

StreamTaker = Callable[[IncomingStream], bool]
"""Called by the connection's reader with each stream the peer opens, before a handler
task is made for it: True if it answered or took the stream without a task (it must not
wait or raise), False to leave it to the `StreamHandler`'s task."""
