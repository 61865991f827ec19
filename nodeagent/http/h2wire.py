"""The trio side of one HTTP/2 connection's writes, shared by the front's client connections
(`h2connection`) and the upstream h2c connections (`h2pool`).

Many stream tasks write to one connection: each queues frames on the `H2Session` and then
`flush()`es, which wakes the connection's one writer task (`run`): it sends whatever the
session has queued, in rounds, so frames leave in the order they were queued, many
streams' frames share one write, and a stream task cancelled mid-write cannot cut a frame.
`flush()` does not wait for the write while the writer is idle: a response's head and body,
and the frames of every stream that ran since the writer last did, leave in one `send_all`,
at the cost of one wake-up of the writer, not one round trip to it per frame (each costs
two task switches, more than the `h2` work of a small frame). While the writer is busy in
`send_all` (the peer reads slower than we write), `flush()` waits for the next round once
the round's allowance of body bytes is spent (`_BUSY_ALLOWANCE`): what a connection holds
unsent is bounded by what its streams queue in one round, each waits then.
`drain()` waits until everything queued is written (before a connection closes).

`send_data` honours flow control: it sends what the stream's and the connection's windows
allow and waits for the peer to open them (`wake`, called by the connection's reader on
WINDOW_UPDATE and SETTINGS), at most `stall_timeout` at a time — a peer that never reads (a
zero-window stall) costs one stream task until then, not unbounded buffering: nothing is
queued beyond the window.
"""

from __future__ import annotations

import collections
from typing import Protocol

import trio

from nodeagent.http.h2session import DataIn, H2Event, H2Session, Headers

_BUSY_ALLOWANCE = 64 * 1024
"""Bytes of body data that may be queued while the writer is in `send_all` before a stream
waits for its round (`flush`) or a stream without a task gets one (`may_queue`). trio's
`send_all` yields once even when the kernel took everything at once, and a stream that runs
then is not facing a slow peer: waiting a round (or a task) for it cost a wake-up or a task
per write. Beyond the allowance the peer does read slower than we write: streams wait, and
what a connection holds unsent stays bounded by a round plus the allowance."""


class StreamGone(Exception):
    """The stream was reset or closed, or the connection failed, while we wrote to it."""


class WindowStalled(StreamGone):
    """The peer kept a window shut for longer than the stall timeout."""


class H2Wire:
    """Writes to one HTTP/2 connection from many tasks; see the module docstring."""

    def __init__(self, session: H2Session, stream: trio.abc.Stream, *,
                 stall_timeout: float) -> None:
        self.session = session
        self.stream = stream
        self.stall_timeout = stall_timeout
        self._windows: dict[int, trio.Event] = {}
        self._kick = trio.Event()  # the writer has rounds to send
        self._next_done = trio.Event()  # set when the next round has been sent
        self._running = False
        self._busy = False  # the writer is in send_all
        self._queued_busy = 0  # body bytes queued since, within `_BUSY_ALLOWANCE`
        self.broken = False
        """The transport failed: every write from now on raises StreamGone."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """The connection's one writer: each round sends everything queued so far in one
        `send_all`. Stream tasks never write themselves: a stream task cancelled (its
        client reset it, a deadline) while writing would cut a frame in half and break
        every other stream of the connection."""
        self._running = True
        task_status.started()
        try:
            while not self.broken:
                await self._kick.wait()
                self._kick = trio.Event()
                done, self._next_done = self._next_done, trio.Event()
                data = self.session.data_to_send()
                self._queued_busy = 0
                if data:
                    self._busy = True
                    try:
                        await self.stream.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError,
                            OSError):
                        self.broken = True
                        self.wake(0)
                    finally:
                        self._busy = False
                done.set()
        finally:
            self._running = False
            self._next_done.set()

    async def flush(self, size: int = 0) -> None:
        """Have what the session queued sent (`size`: the body bytes just queued). With
        the writer running (`run`) and idle, it is only woken: many tasks' frames leave in
        one write once they all ran; with the writer busy writing and the allowance spent
        (`may_queue`), wait until the next round is on its way (the backpressure of a peer
        that stops reading TCP). Without the writer (before it starts, after it ends: a
        last GOAWAY), the caller writes."""
        if self.broken:
            raise StreamGone("connection closed")
        if self._running:
            self._kick.set()
            if self._busy and not self.may_queue(size):
                await self._wait_round()
            return
        await self._write_directly()

    def may_queue(self, size: int) -> bool:
        """Whether `size` more body bytes may be queued without waiting: the writer is idle,
        or busy with `_BUSY_ALLOWANCE` not spent yet in this round (then it is counted)."""
        if self.broken:
            return False
        if not self._busy:
            return True
        if self._queued_busy + size > _BUSY_ALLOWANCE:
            return False
        self._queued_busy += size
        return True

    def kick(self) -> None:
        """Have what the session queued sent, from code that cannot wait (a stream relayed
        without a task of its own, `h2connection`): the writer is woken; a caller that must
        not queue more while the peer reads slower than we write checks `may_queue` first."""
        if self._running:
            self._kick.set()

    async def drain(self) -> None:
        """Wait until everything queued so far is written (StreamGone if the write failed)."""
        if self.broken:
            raise StreamGone("connection closed")
        if self._running:
            self._kick.set()
            await self._wait_round()
            return
        await self._write_directly()

    async def _wait_round(self) -> None:
        done = self._next_done
        await done.wait()
        if self.broken:
            raise StreamGone("connection broke")

    async def _write_directly(self) -> None:
        data = self.session.data_to_send()
        if data:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self.broken = True
                self.wake(0)
                raise StreamGone("connection broke") from exc

    def wake(self, stream_id: int) -> None:
        """A window opened (0: the connection's, or the connection ended): wake its writers."""
        if stream_id == 0:
            windows, self._windows = self._windows, {}
            for event in windows.values():
                event.set()
        else:
            waiting = self._windows.get(stream_id)
            if waiting is not None:
                del self._windows[stream_id]
                waiting.set()

    async def send_headers(self, stream_id: int, headers: Headers, end: bool = False) -> None:
        try:
            self.session.send_headers(stream_id, headers, end)
        except Exception as exc:  # h2's StreamClosedError / ProtocolError: the stream is gone
            raise StreamGone(str(exc)) from exc
        await self.flush()

    async def send_data(self, stream_id: int, data: bytes, end: bool = False) -> None:
        """Send `data` as the windows allow: every frame they allow is queued, then one
        flush (a write per frame cost a syscall per 16 KiB)."""
        session = self.session
        if not self.broken and session.send_window(stream_id) >= len(data):
            # The usual case (a piece no larger than a frame, the window open): one frame,
            # without a view and the copy of its slice.
            try:
                session.send_data(stream_id, data, end)
            except Exception as exc:  # the stream closed under us
                raise StreamGone(str(exc)) from exc
            await self.flush(len(data))
            return
        view = memoryview(data)
        queued = 0
        while True:
            if self.broken:
                raise StreamGone("connection closed")
            window = session.send_window(stream_id)
            if window < 0:
                raise StreamGone("stream closed")
            if window == 0 and view:
                # Register before flushing: a WINDOW_UPDATE read while the flush yields
                # must find the event to set, or the wake-up is lost.
                event = self._windows.get(stream_id)
                if event is None:
                    event = self._windows[stream_id] = trio.Event()
                await self.flush(queued)
                queued = 0
                with trio.move_on_after(self.stall_timeout):
                    await event.wait()
                    continue
                raise WindowStalled(f"window shut for {self.stall_timeout:g}s")
            piece = view[:window]
            view = view[window:]
            last = not view
            try:
                session.send_data(stream_id, bytes(piece), end and last)
            except Exception as exc:  # the stream closed under us
                raise StreamGone(str(exc)) from exc
            queued += len(piece)
            if last:
                await self.flush(queued)
                return

    async def end_stream(self, stream_id: int) -> None:
        try:
            self.session.end_stream(stream_id)
        except Exception as exc:
            raise StreamGone(str(exc)) from exc
        await self.flush()

    async def reset(self, stream_id: int, code: int) -> None:
        """Reset a stream (quiet when it is already gone or the connection broke)."""
        self.session.reset(stream_id, code)
        self.wake(stream_id)
        try:
            await self.flush()
        except StreamGone:
            pass

    def give_back(self, stream_id: int, flow_length: int) -> None:
        """`acknowledge` without waiting: a WINDOW_UPDATE, when `h2` makes one, leaves with
        the writer's next round (a window given back needs no backpressure)."""
        self.session.acknowledge(stream_id, flow_length)
        self.kick()

    async def acknowledge(self, stream_id: int, flow_length: int) -> None:
        self.session.acknowledge(stream_id, flow_length)
        try:
            await self.flush()
        except StreamGone:
            pass

class DirectSink(Protocol):
    """Takes a stream's events as they are read, without a task (`Inbox.direct`)."""

    def take(self, item: H2Event) -> bool:
        """Act on `item` now; False: it cannot be (it would have to wait), the inbox keeps
        it and every later one for a task, and the sink is detached."""

    def lost(self, error: Exception) -> None:
        """The connection ended with the stream in flight."""


class Inbox:
    """What the connection's reader received for one stream, in order, until the stream's
    task takes it. Bounded by the stream's receive window: the reader never acknowledges
    data, the task does once it forwarded it (`H2Wire.acknowledge`).

    With a `direct` sink, the reader hands each event to it as read instead; once the sink
    declines one (it would have to wait), that event and the later ones queue here for a
    task, as without a sink."""

    __slots__ = ("_event", "direct", "error", "items")

    def __init__(self) -> None:
        self.items: collections.deque[H2Event] = collections.deque()
        self._event: trio.Event | None = None
        self.error: Exception | None = None
        self.direct: DirectSink | None = None

    def put(self, item: H2Event) -> None:
        direct = self.direct
        if direct is not None:
            if direct.take(item):
                return
            self.direct = None
        self.items.append(item)
        if self._event is not None:
            self._event.set()
            self._event = None

    def fail(self, error: Exception) -> None:
        """Nothing more will come: `get` raises `error` once the items are taken."""
        direct = self.direct
        if direct is not None:
            self.direct = None
            direct.lost(error)
            return
        if self.error is None:
            self.error = error
        if self._event is not None:
            self._event.set()
            self._event = None

    def drop(self) -> int:
        """Empty the inbox (its stream is done with); the window its data used, which the
        caller gives back to the connection: data dropped unread must not shrink the
        window of the connection's other streams for good."""
        owed = 0
        for ev in self.items:
            if type(ev) is DataIn:
                owed += ev.flow_length
        self.items.clear()
        return owed

    def join_data(self, data: bytes, limit: int) -> tuple[bytes, int]:
        """`data` with the body data queued right behind it joined on, up to `limit` bytes
        in all; the bytes and the window the joined frames used (`DataIn.flow_length`).
        A peer's 16 KiB frames leave as one frame of up to `limit` where the other side
        accepts it: `h2`'s work per frame sent costs far more than the copy."""
        items = self.items
        if not items or type(items[0]) is not DataIn:
            return data, 0
        parts = [data]
        size = len(data)
        flow = 0
        while items:
            ev = items[0]
            if type(ev) is not DataIn or size + len(ev.data) > limit:
                break
            items.popleft()
            parts.append(ev.data)
            size += len(ev.data)
            flow += ev.flow_length
        return (b"".join(parts) if len(parts) > 1 else data), flow

    async def get(self) -> H2Event:
        while not self.items:
            if self.error is not None:
                raise self.error
            event = self._event = trio.Event()
            await event.wait()
        return self.items.popleft()


__all__ = ["DirectSink", "H2Wire", "Inbox", "StreamGone", "WindowStalled"]
