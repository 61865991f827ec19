"""Tunnel streams joined to TCP sockets, many per task: one `SpliceLoop` per tunnel
connection carries every splice of a stream of that connection with a socket, both ways.

Why: a splice that waits in a task of its own costs ~10 KB per idle stream per side, more
than half of it trio's task and the coroutine frames it waits in
(`python -m scripts.bench.idle_stream_cost`). Here an idle splice is one `_Splice` record
(`__slots__`) and its socket, registered in the loop's epoll set; the loop is one task in
the connection's nursery (started through `StreamCarrier.start_task` on first use), which
trio wakes through the epoll descriptor itself: it is readable while any socket in the
set is ready. No task, nursery or cancel scope per stream; no buffer while nothing waits:

- socket → tunnel: the loop reads a readable socket (one read per socket per round, so a
  busy socket cannot starve the others) and queues what the stream's window takes
  (`TunnelStream.send_nowait`); the rest is held and the socket leaves the read set until
  the stream's credit returns (`DirectSink.on_window`). The loop stops reading while the
  connection's output is above its high-water mark (`send_queued`), as a task would.
- tunnel → socket: the connection's reader hands each frame to the record
  (`DirectSink.on_data`), which holds the frames of one tunnel read and writes them into
  the socket together once the reader is done with the read (`on_delivered`: one
  `sendmsg` for a read's 64 KiB frames, not a `send` each); what the socket does not
  take waits in that queue, the socket joins the write set, and the loop writes the rest
  when it can. Credit returns only for bytes the socket took, so a target that stops
  reading stops its sender at the stream's window.
- half-close both ways (EOF → FIN, FIN → shutdown(SHUT_WR)); a failure either way aborts
  both (a TCP RST, a tunnel RST), never a clean-looking EOF; the end is reported once, by
  `on_end`, with the bytes moved each way.

When the connection ends its nursery cancels the loop, which aborts every splice it
carries: the loop owns its splices as a nursery owns its tasks.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import math
import os
import select
import socket
import struct
import weakref
from collections.abc import Callable
from typing import Protocol

import trio
import trio.lowlevel

from tunnel import protocol as p
from tunnel.buffers import SharedBuffer
from tunnel.errors import StreamFailed, StreamRefusedError, StreamResetError, TunnelClosedError
from tunnel.log import get_logger
from tunnel.stream import IncomingStream, OpenAnswer, StreamCarrier, TunnelStream
from tunnel.tcp import (
    SO_MARK,
    connect_failed,
    format_address,
    mark_failed,
    set_keepalive,
    timed_out,
)

_log = get_logger("tunnel.spliceloop")

# One read per readable socket per round, at most this much; reads land in one buffer
# for the process and only what was read is copied out (see `read`). Not more: a round's
# reads are queued before the loop waits for the connection's output to drain, and a
# shaped tunnel (tunnel/shaping.py) sends them at its rate before a PING behind them:
# 1 MiB at 256 KiB/s outlasted a 2 s ping timeout (tests/e2e/test_shaping.py).
CHUNK = 256 * 1024
_MAX_EVENTS = 256
# EPOLLRDHUP with EPOLLIN: a socket whose peer has sent its FIN says so with the data
# before it, so the read that takes the last data reads the EOF too (`read`): the FIN
# leaves with the data, not a loop round later (a target that answers and closes).
_IN = select.EPOLLIN | select.EPOLLRDHUP
_RDHUP = select.EPOLLRDHUP
_OUT = select.EPOLLOUT
# A client socket waiting for its stream's answer (SpliceLoop.open) is watched for errors
# and hang-ups alone (epoll reports those whatever the mask): a client that resets is
# noticed, one that half-closes (FIN, no HUP) waits in the kernel with its bytes.
_ERR = select.EPOLLERR
_LINGER_RESET = struct.pack("ii", 1, 0)
# At most this many buffers per sendmsg (Linux's IOV_MAX): a peer's tiny frames can put
# more than that in a queue, which then goes out in several calls.
_IOV_MAX = 1024
# A frame from this size on waits for the rest of its tunnel read's frames, to go out
# with them in one sendmsg (a bulk stream's 64 KiB frames); a smaller one is written at
# once.
_BATCH_FROM = 16 * 1024
# Every loop runs in the process's trio thread and copies a read out before it yields
# (see tunnel.buffers). Reads never exceed CHUNK, so the mapping never grows and one
# view of it serves every read.
_READ_BUFFER = SharedBuffer(CHUNK).whole
_READ_VIEW = memoryview(_READ_BUFFER)


class SpliceEnd:
    """How a splice ended: bytes moved each way and, if it failed, why."""

    __slots__ = ("error", "to_socket", "to_tunnel")

    def __init__(self, to_socket: int, to_tunnel: int, error: str | None) -> None:
        self.to_socket = to_socket
        self.to_tunnel = to_tunnel
        self.error = error


OnEnd = Callable[[SpliceEnd], None]
OnRefused = Callable[[StreamFailed], None]
OnLost = Callable[[socket.socket], bool]
"""Offered the client socket of an open whose tunnel connection ended before the answer:
True if it took it (opened again through a newer connection), else it is reset."""


class _Dial:
    """A connect() under way for a stream the peer opened (SpliceLoop.dial): answered
    from the loop once the socket is writable (connected, or failed: SO_ERROR), or
    refused by the loop's timer at `deadline`. The deadline heap holds these, not the
    splice: a finished dial behind a slow one keeps only this small record alive."""

    __slots__ = ("address", "deadline", "incoming", "on_accepted", "on_refused", "splice",
                 "timeout")

    def __init__(self, splice: _Splice, incoming: IncomingStream, address: tuple[str, int],
                 deadline: float, timeout: float, on_accepted: Callable[[], None],
                 on_refused: OnRefused) -> None:
        self.splice: _Splice | None = splice  # None once answered
        self.incoming = incoming
        self.address = address
        self.deadline = deadline
        self.timeout = timeout
        self.on_accepted = on_accepted
        self.on_refused = on_refused

    def answered(self) -> tuple[IncomingStream, Callable[[], None], OnRefused]:
        """Off the heap's books: what an answer needs, dropped here so an entry still
        in the heap (behind a slower dial) holds nothing of its stream."""
        answer = self.incoming, self.on_accepted, self.on_refused
        self.splice = None
        del self.incoming, self.on_accepted, self.on_refused
        return answer

    def expire(self, loop: SpliceLoop) -> None:
        """The deadline passed with the dial still under way: refuse its stream."""
        if self.splice is not None:
            host, port = self.address
            loop.dial_failed(self.splice, timed_out(host, port, self.timeout))


class _Open:
    """A stream this side opened for a client socket (SpliceLoop.open), waiting for the
    peer's answer: the connection's `OpenAnswer` (its reader calls `resolve` with the
    ACCEPT or REFUSE, its end `fail`) and the loop's deadline-heap entry (`expire`), like
    `_Dial`. Accepted, the socket joins the splice (`to_tunnel` first); anything else
    resets the client and calls `on_refused`."""

    __slots__ = ("deadline", "on_accepted", "on_lost", "on_refused", "splice", "timeout",
                 "to_tunnel")

    def __init__(self, timeout: float, to_tunnel: bytes, on_accepted: Callable[[], None],
                 on_refused: OnRefused, on_lost: OnLost | None) -> None:
        self.splice: _Splice | None = None  # set by SpliceLoop.open; None once answered
        self.deadline = math.inf
        self.timeout = timeout
        self.to_tunnel = to_tunnel
        self.on_accepted = on_accepted
        self.on_refused = on_refused
        self.on_lost = on_lost

    def answered(self) -> tuple[bytes, Callable[[], None], OnRefused, OnLost | None]:
        answer = self.to_tunnel, self.on_accepted, self.on_refused, self.on_lost
        self.splice = None
        del self.to_tunnel, self.on_accepted, self.on_refused, self.on_lost
        return answer

    # ---- tunnel.stream.OpenAnswer: called by the connection's reader, or at its end

    def resolve(self, result: p.StreamAccepted | p.StreamRefused) -> None:
        s = self.splice
        if s is None:
            return
        if isinstance(result, p.StreamAccepted):
            s.loop.opened(s)
        else:
            s.loop.open_failed(s, StreamRefusedError(result.reason, result.message))

    def fail(self, error: BaseException) -> None:
        s = self.splice
        if s is not None:
            s.loop.open_failed(s, StreamFailed(p.StreamReason.UNREACHABLE,
                                               f"tunnel connection ended: {error}"))

    def expire(self, loop: SpliceLoop) -> None:
        if self.splice is not None:
            loop.open_failed(self.splice, StreamRefusedError(
                p.StreamReason.TIMEOUT, f"no answer to the OPEN within {self.timeout:g}s"))


class _Splice:
    """One stream joined to one socket: the stream's direct sink, and the loop's record
    of the socket. Buffers exist only while data waits (`out`, `held`)."""

    __slots__ = ("batched", "dial", "ended", "eof_pending", "fd", "free", "held", "loop",
                 "mask", "on_end", "out", "owner", "reading", "sock", "stream",
                 "to_socket", "to_tunnel", "writing")

    def __init__(self, loop: SpliceLoop, stream: TunnelStream, sock: socket.socket,
                 on_end: OnEnd, owner: SpliceOwner | None) -> None:
        self.loop = loop
        self.owner = owner
        self.stream = stream
        self.sock = sock
        self.fd = sock.fileno()
        self.on_end = on_end
        self.mask = 0  # what the epoll set waits for now (0: not in the set)
        self.reading = True  # socket → tunnel still open
        self.writing = True  # tunnel → socket still open
        self.eof_pending = False  # FIN from the tunnel, passed on once `out` drains
        self.out: collections.deque[bytes | memoryview] | None = None  # → socket
        # `out` holds the frames of the read the reader is delivering, to be written
        # when it is done with it (on_delivered), not a write the socket could not take.
        self.batched = False
        self.free = 0  # bytes at the head of `out` that are not the stream's (leftover)
        self.held: memoryview | None = None  # read from the socket, waiting for credit
        self.to_socket = 0
        self.to_tunnel = 0
        self.ended = False
        # While its socket connects (or, for a stream this side opened, while the OPEN
        # waits for its answer): what comes from the tunnel meanwhile waits in `out`.
        self.dial: _Dial | _Open | None = None

    # ---- tunnel.stream.DirectSink: called by the connection's reader

    def on_data(self, data: bytes | memoryview) -> None:
        # `data` is lent (a view of the reader's buffer) until on_delivered.
        out = self.out
        if out is not None:
            # Behind this read's batch: lent like it. Behind an unfinished write or a
            # dial: kept, so copied.
            out.append(data if self.batched else bytes(data))
            return
        if len(data) < _BATCH_FROM:
            # A small frame (a request, a response): written at once, as before the
            # batching. A read rarely holds two of them for one socket, and the batch's
            # deque and second call cost a request/response ~5 µs per side in
            # `scripts.bench.tunnel --only http`.
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self.stream.consumed(len(data))
                self.loop.end(self, _why(exc))
                return
            if sent:
                self.to_socket += sent
                self.stream.consumed(sent)
            if sent < len(data):
                self.out = collections.deque((bytes(data[sent:]),))  # lent: copied
                self.loop.update(self)
            return
        # The first frame of this read for the socket: the rest of the read's follow
        # before on_delivered, which writes them all in one call, from where they lie.
        self.out = collections.deque((data,))
        self.batched = True

    def on_delivered(self) -> None:
        if self.batched:
            self.batched = False
            if self.out and not self.ended:
                self.loop.flush(self)
            if self.out and not self.ended:
                # The socket did not take it all: what waits is kept, so copied.
                self.out = collections.deque(
                    bytes(b) if type(b) is memoryview else b for b in self.out)

    def on_eof(self) -> None:
        if self.out is None:
            self.loop.shut_write(self)
        else:
            self.eof_pending = True  # after the batch or the write under way

    def on_reset(self, error: StreamResetError) -> None:
        # What came before the RST goes to the socket first, as it did frame by frame.
        self.on_delivered()
        self.loop.end(self, _why(error))

    def on_window(self) -> None:
        held = self.held
        if held is not None and not self.ended:
            self.held = None
            if self.loop.to_tunnel(self, held):
                self.loop.update(self)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _os_error(code: int) -> OSError:
    """The exception connect() would have raised for `code` (ConnectionRefusedError...)."""
    return OSError(code, os.strerror(code))


# One loop per tunnel connection, made on first use, dropped when its task ends (the
# connection's end) or cannot start.
_LOOPS: weakref.WeakKeyDictionary[StreamCarrier, SpliceLoop] = weakref.WeakKeyDictionary()


def loop_for(carrier: StreamCarrier) -> SpliceLoop:
    """The splice loop of the connection `carrier` (made, not yet started, if none)."""
    loop = _LOOPS.get(carrier)
    if loop is None or loop.ended:
        loop = _LOOPS[carrier] = SpliceLoop(carrier)
    return loop


def dial_in_loop(incoming: IncomingStream, family: socket.AddressFamily,
                 address: tuple[str, int], *, timeout: float, mark: int | None,
                 on_accepted: Callable[[], None], on_refused: OnRefused,
                 on_end: OnEnd) -> None:
    """Connect to `address` (an IP literal of `family`) for a stream the peer opened, in
    the loop of the stream's connection, and return at once: no task waits for it. The
    loop accepts the stream when the socket connects (then `on_accepted`) and splices the
    two as `splice_in_loop` does (`on_end` at the end); a connect that fails or takes
    longer than `timeout` refuses the stream with the reason a `connect_tcp` failure
    gives (then `on_refused`, and no `on_end`). Callbacks must not raise or wait. Called
    from the connection's reader (a `StreamTaker`): the answer goes out with its output."""
    loop_for(incoming.stream.connection).dial(
        incoming, family, address, timeout=timeout, mark=mark, on_accepted=on_accepted,
        on_refused=on_refused, on_end=on_end)


class StreamOpener(Protocol):
    """Opens a stream without waiting for its answer (TunnelConnection)."""

    def open_stream_nowait(self, target: p.Target, metadata: dict[str, str] | None,
                           answer: OpenAnswer) -> TunnelStream: ...


def open_in_loop(opener: StreamOpener, target: p.Target, metadata: dict[str, str],
                 sock: socket.socket, *, timeout: float, on_accepted: Callable[[], None],
                 on_refused: OnRefused, on_end: OnEnd, to_tunnel: bytes = b"",
                 owner: SpliceOwner | None = None,
                 on_lost: OnLost | None = None) -> TunnelStream | None:
    """Open a stream to `target` for the client connection `sock` (a non-blocking socket
    this call owns from now on) and return at once: no task waits for the answer. The
    OPEN is queued (the caller gets it moving: `send_queued` after a batch). Accepted
    (then `on_accepted`), the loop of the stream's connection splices the two as
    `splice_in_loop` does, `to_tunnel` first (the opener's bytes, a PROXY header: not
    counted in `on_end`'s figures) (`on_end` at the end); refused, unanswered
    within `timeout`, the connection lost or the client reset first: the client is reset,
    the stream (if any) too, and `on_refused` says why (no `on_end`). Callbacks must not
    raise or wait. The stream, for notes; None if it could not even be opened. `on_lost`:
    the tunnel connection ended first (an agent that reconnected replaces its old one),
    and the client socket may be opened again elsewhere (see OnLost)."""
    pending = _Open(timeout, to_tunnel, on_accepted, on_refused, on_lost)
    try:
        stream = opener.open_stream_nowait(target, metadata, pending)
    except (StreamFailed, TunnelClosedError) as exc:
        reset_socket(sock)
        failure = exc if isinstance(exc, StreamFailed) else StreamFailed(
            p.StreamReason.UNREACHABLE, f"tunnel connection ended: {exc}")
        _answer_refused(on_refused, failure, target)
        return None
    loop_for(stream.connection).open(pending, stream, sock, on_end=on_end, owner=owner)
    return stream


def reset_socket(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0): the peer sees a failure, not a clean EOF."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        pass
    sock.close()


def _answer_refused(on_refused: OnRefused, failure: StreamFailed, target: p.Target) -> None:
    try:
        on_refused(failure)
    except Exception as exc:  # a bad callback must not end the others
        _log.error("open refusal callback failed", target=str(target), error=repr(exc))


def splice_in_loop(stream: TunnelStream, sock: trio.SocketStream, *, on_end: OnEnd,
                   to_socket: bytes = b"", to_tunnel: bytes = b"",
                   owner: SpliceOwner | None = None) -> SpliceHandle:
    """Join `stream` to `sock` in the loop of the stream's connection and return at once;
    `on_end` is called when both directions are done (from the loop or the connection's
    reader: it must not raise or wait). The loop owns both from now on: it closes them.
    `to_socket` / `to_tunnel`: bytes already read elsewhere that go first. `owner`: one
    that may end it sooner than the connection does (see SpliceOwner)."""
    return loop_for(stream.connection).add(stream, sock, on_end=on_end, owner=owner,
                                           to_socket=to_socket, to_tunnel=to_tunnel)


class SpliceOwner:
    """The splices handed over on behalf of one owner whose end must end them too (a
    listener: stopping a TCP mapping cuts its connections, as cancelling its nursery did
    when each was a task). The owner calls `abort_all()` as it ends."""

    def __init__(self) -> None:
        self._splices: set[_Splice] = set()

    def __len__(self) -> int:
        return len(self._splices)

    def abort_all(self, why: str) -> None:
        for splice in list(self._splices):
            splice.loop.end(splice, why)


class SpliceHandle:
    """A splice handed to a loop, for an owner that may end it early (a listener that
    stops): `abort()` resets both ends now; after the end it does nothing."""

    __slots__ = ("_splice",)

    def __init__(self, splice: _Splice) -> None:
        self._splice = splice

    @property
    def ended(self) -> bool:
        return self._splice.ended

    def abort(self, why: str = "aborted by its owner") -> None:
        self._splice.loop.end(self._splice, why)

    def close(self) -> None:
        """End without an error: the socket gets a FIN, the stream (if still open) an
        RST as a TunnelStream's aclose() sends."""
        self._splice.loop.end(self._splice, None)


class SpliceLoop:
    """Every stream-to-socket splice of one tunnel connection, carried by one task (see
    the module docstring). Made by `loop_for`; its task starts with the first splice."""

    def __init__(self, carrier: StreamCarrier) -> None:
        self._carrier = carrier
        self._epoll = select.epoll()
        self._splices: dict[int, _Splice] = {}
        self._started = False
        self.ended = False
        self._in_round = False  # the task is going over ready sockets (it sends after)
        # A read of the round filled CHUNK and its socket stays in the read set: more is
        # likely waiting, so the next round looks before it waits (see _run).
        self._full_read = False
        # Dials under way, earliest deadline first (heapq; answered ones leave lazily),
        # and the one task that refuses those whose deadline passes: a timer per
        # connection, not a cancel scope per dial.
        self._deadlines: list[tuple[float, int, _Dial | _Open]] = []
        self._dial_order = itertools.count()
        self._timer_started = False
        self._timer: trio.CancelScope | None = None  # the timer's wait, while it waits

    def __len__(self) -> int:
        return len(self._splices)

    def add(self, stream: TunnelStream, sock: trio.SocketStream, *, on_end: OnEnd,
            to_socket: bytes = b"", to_tunnel: bytes = b"",
            owner: SpliceOwner | None = None) -> SpliceHandle:
        # The socket leaves trio: a plain socket object on the same descriptor (trio's
        # wrappers are ~700 B an idle stream would carry for nothing).
        tsock = sock.socket  # (family, type, proto given: no getsockopt to learn them)
        raw = socket.socket(tsock.family, tsock.type, tsock.proto, tsock.detach())
        splice = _Splice(self, stream, raw, on_end, owner)
        if owner is not None:
            owner._splices.add(splice)
        handle = SpliceHandle(splice)
        if not self._started and not self.ended:
            self._started = self._carrier.start_task(self._run)
        self._splices[splice.fd] = splice
        if not self._started:
            self._forget()
            self.end(splice, "tunnel connection ended")
            return handle
        if to_socket:
            splice.out = collections.deque((to_socket,))
            splice.free = len(to_socket)
        while data := stream.take_buffered():
            if splice.out is None:
                splice.out = collections.deque()
            splice.out.append(data)
        stream.attach_sink(splice)
        if stream.reset_reason is not None:
            self.end(splice, _why(stream.reset_reason))
            return handle
        if data == b"":  # EOF already received
            splice.eof_pending = True
        if splice.out is not None:
            self.flush(splice)
        elif splice.eof_pending:
            self.shut_write(splice)
        if to_tunnel and not splice.ended:
            self.to_tunnel(splice, memoryview(to_tunnel))
        if not splice.ended:
            self.update(splice)
        return handle

    def dial(self, incoming: IncomingStream, family: socket.AddressFamily,
             address: tuple[str, int], *, timeout: float, mark: int | None,
             on_accepted: Callable[[], None], on_refused: OnRefused, on_end: OnEnd) -> None:
        """See `dial_in_loop`."""
        stream = incoming.stream
        host, port = address
        try:
            sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        except OSError as exc:  # out of descriptors or memory: this node's trouble
            self._refuse(incoming, on_refused,
                         StreamFailed(p.StreamReason.INTERNAL, f"no socket: {exc}"))
            return
        try:
            if mark is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
                except OSError as exc:
                    raise mark_failed(mark, exc) from None
            code = sock.connect_ex(address)
            if code == errno.EINPROGRESS:
                # A target on this host (loopback, a pod's veth) has usually answered
                # before connect() returns: then the stream is answered now, with the
                # reader's output, not from a loop round of its own.
                try:
                    sock.getpeername()
                    code = 0
                except OSError:
                    pass  # still connecting (ENOTCONN), or failed: the loop learns which
            elif code:
                raise connect_failed(host, port, [(format_address(address),
                                                   _os_error(code))])
            if not self._started and not self.ended:
                self._started = self._carrier.start_task(self._run)
            if not self._started:
                raise StreamFailed(p.StreamReason.INTERNAL, "tunnel connection ended")
        except StreamFailed as failure:
            sock.close()
            self._refuse(incoming, on_refused, failure)
            return
        splice = _Splice(self, stream, sock, on_end, None)
        splice.out = collections.deque()  # the tunnel's bytes wait here until connected
        dial = splice.dial = _Dial(splice, incoming, address,
                                   trio.current_time() + timeout, timeout, on_accepted,
                                   on_refused)
        self._splices[splice.fd] = splice
        stream.attach_sink(splice)
        if code == 0:
            self.connected(splice, known=True)
            return
        try:
            self._epoll.register(splice.fd, _OUT)
        except OSError as exc:
            self.dial_failed(splice, StreamFailed(p.StreamReason.INTERNAL, _why(exc)))
            return
        splice.mask = _OUT
        self._add_deadline(dial)

    def connected(self, s: _Splice, *, known: bool = False) -> None:
        """The socket of a dial is writable: connected (accept and splice) or failed.
        `known`: getpeername() has said connected already (no SO_ERROR to ask)."""
        dial = s.dial
        assert isinstance(dial, _Dial)
        code = 0 if known else s.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            host, port = dial.address
            self.dial_failed(s, connect_failed(host, port, [(format_address(dial.address),
                                                             _os_error(code))]))
            return
        s.dial = None
        incoming, on_accepted, _ = dial.answered()
        try:
            incoming.accept_now()
        except StreamResetError as exc:
            self.end(s, _why(exc))
            return
        sock = s.sock
        set_keepalive(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        on_accepted()
        if not s.out:
            s.out = None
        if s.out is not None:
            self.flush(s)
        elif s.eof_pending:
            self.shut_write(s)
        if not s.ended:
            self.update(s)

    def dial_failed(self, s: _Splice, failure: StreamFailed) -> None:
        """Refuse the stream of a dial that failed; its splice ends without `on_end`."""
        dial = s.dial
        assert isinstance(dial, _Dial)
        s.dial = None
        incoming, _, on_refused = dial.answered()
        self._drop_unanswered(s)
        s.sock.close()
        self._refuse(incoming, on_refused, failure)

    def _drop_unanswered(self, s: _Splice) -> None:
        """End a splice whose dial or open was never answered: off the loop's and its
        owner's books, its sink detached; data the tunnel sent meanwhile gives its credit
        back. The socket and the stream are the caller's to end."""
        s.ended = True
        if self._splices.get(s.fd) is s:
            del self._splices[s.fd]
        if s.owner is not None:
            s.owner._splices.discard(s)
        s.stream.attach_sink(None)
        if s.out:
            s.stream.consumed(sum(map(len, s.out)))
        s.out = None

    def open(self, pending: _Open, stream: TunnelStream, sock: socket.socket, *,
             on_end: OnEnd, owner: SpliceOwner | None) -> None:
        """See `open_in_loop`: `stream`'s OPEN is queued, `pending` its answer."""
        splice = _Splice(self, stream, sock, on_end, owner)
        splice.out = collections.deque()  # the tunnel's bytes wait here until answered
        splice.dial = pending
        pending.splice = splice
        if owner is not None:
            owner._splices.add(splice)
        if not self._started and not self.ended:
            self._started = self._carrier.start_task(self._run)
        stream.attach_sink(splice)
        if not self._started:
            self._forget()
            self.open_failed(splice, StreamFailed(p.StreamReason.UNREACHABLE,
                                                  "tunnel connection ended"))
            return
        self._splices[splice.fd] = splice
        try:
            self._epoll.register(splice.fd, _ERR)
        except OSError as exc:
            self.open_failed(splice, StreamFailed(p.StreamReason.INTERNAL, _why(exc)))
            return
        splice.mask = _ERR
        pending.deadline = trio.current_time() + pending.timeout
        self._add_deadline(pending)

    def _add_deadline(self, entry: _Dial | _Open) -> None:
        """Put a dial or an open on the deadline heap, and bring the one timer forward
        (or start it) if this deadline is the earliest. Answered entries at its head
        leave first: answers come mostly in the order of the opens, so the heap holds
        about what is unanswered now, not every open of the last `timeout` seconds
        (until the timer's next wake: ~14,000 at 2,800 opens/s and 5 s, ~2 MB)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].splice is None:
            heapq.heappop(deadlines)
        heapq.heappush(deadlines, (entry.deadline, next(self._dial_order), entry))
        timer = self._timer
        if timer is not None:
            if entry.deadline < timer.deadline:
                timer.deadline = entry.deadline
        elif not self._timer_started:
            self._timer_started = self._carrier.start_task(self._expire_dials)

    def opened(self, s: _Splice) -> None:
        """The peer accepted the stream of an `open`: the client socket joins the splice."""
        pending = s.dial
        assert isinstance(pending, _Open)
        s.dial = None
        to_tunnel, on_accepted, _, _ = pending.answered()
        try:
            on_accepted()
        except Exception as exc:  # a bad callback must not end the others
            _log.error("open accept callback failed", stream=s.stream.stream_id,
                       target=str(s.stream.target), error=repr(exc))
        if to_tunnel:
            sent_all = self.to_tunnel(s, to_tunnel)
            s.to_tunnel -= len(to_tunnel)  # the owner's bytes (a header): not the client's
            if not sent_all and s.ended:
                return
        if not s.out:
            s.out = None
        if s.out is not None:
            self.flush(s)
        elif s.eof_pending:
            self.shut_write(s)
        if not s.ended and s.reading and s.held is None:
            # What the client sent while the OPEN waited (its request: most clients
            # speak first) goes now, with the reader's output: no loop round for it.
            self.read(s)
        if not s.ended:
            self.update(s)

    def open_failed(self, s: _Splice, failure: StreamFailed) -> None:
        """End the splice of an `open` that was not accepted: the stream is reset (an
        RST the peer ignores for a stream it refused), the client too; `on_refused`."""
        pending = s.dial
        assert isinstance(pending, _Open)
        s.dial = None
        _, _, on_refused, on_lost = pending.answered()
        self._drop_unanswered(s)
        stream = s.stream
        stream.abort_now(p.StreamReason.CANCELLED, "open abandoned", wake=not self._in_round)
        if (on_lost is not None and failure.reason is p.StreamReason.UNREACHABLE
                and stream.connection.end_reason is not None):
            # The connection ended under the open: the client may get another one.
            if s.mask:
                try:
                    self._epoll.unregister(s.fd)
                except (OSError, ValueError):
                    pass  # closed with the loop already
                s.mask = 0
            try:
                if on_lost(s.sock):
                    return
            except Exception as exc:  # a bad callback must not end the others
                _log.error("open lost callback failed", target=str(stream.target),
                           error=repr(exc))
        reset_socket(s.sock)
        _answer_refused(on_refused, failure, stream.target)

    @staticmethod
    def _refuse(incoming: IncomingStream, on_refused: OnRefused, failure: StreamFailed) -> None:
        try:
            incoming.refuse_now(failure.reason, failure.message)
        except StreamResetError:
            return  # the opener gave up first: nobody to answer
        try:
            on_refused(failure)
        except Exception as exc:  # a bad callback must not end the others
            _log.error("dial refusal callback failed", stream=incoming.stream.stream_id,
                       target=str(incoming.target), error=repr(exc))

    # ---- the record's moves (called by _Splice and the loop)

    def update(self, s: _Splice) -> None:
        """Put the socket in the epoll set for what its splice waits for now."""
        if s.ended:
            return
        want = (_IN if s.reading and s.held is None else 0) | (_OUT if s.out else 0)
        if want == s.mask:
            return
        try:
            if not s.mask:
                self._epoll.register(s.fd, want)
            elif not want:
                self._epoll.unregister(s.fd)
            else:
                self._epoll.modify(s.fd, want)
        except OSError as exc:
            self.end(s, _why(exc))
            return
        s.mask = want

    def to_tunnel(self, s: _Splice, data: memoryview | bytes) -> bool:
        """Queue `data` on the stream; False (the rest held, or the splice ended) if not
        all of it fit the window."""
        try:
            sent = s.stream.send_nowait(data)
        except (StreamResetError, trio.ClosedResourceError) as exc:
            self.end(s, _why(exc))
            return False
        s.to_tunnel += sent
        if sent < len(data):
            s.held = memoryview(data)[sent:]
            return False
        return True

    def flush(self, s: _Splice) -> None:
        """Write what waits for the socket; shut its write side once a FIN waits behind.
        Several buffers go in one sendmsg (a read's frames, or what waited)."""
        out = s.out
        assert out is not None
        stream = s.stream
        sock = s.sock
        try:
            while out:
                count = len(out)
                if count == 1:
                    sent = sock.send(out[0])
                elif count <= _IOV_MAX:
                    sent = sock.sendmsg(out)
                else:
                    count = _IOV_MAX
                    sent = sock.sendmsg(itertools.islice(out, _IOV_MAX))
                s.to_socket += sent
                if s.free:
                    free = min(sent, s.free)
                    s.free -= free
                    if sent > free:
                        stream.consumed(sent - free)
                else:
                    stream.consumed(sent)
                # Drop what went; a buffer the socket took part of (or none of) keeps
                # the rest, and the socket is full.
                while count:
                    size = len(out[0])
                    if sent < size:
                        if sent:
                            out[0] = memoryview(out[0])[sent:]
                        return
                    out.popleft()
                    sent -= size
                    count -= 1
        except BlockingIOError:
            return
        except OSError as exc:
            self.end(s, _why(exc))
            return
        finally:
            if not s.ended and out:
                self.update(s)
        s.out = None
        if s.eof_pending:
            self.shut_write(s)
        else:
            self.update(s)

    def shut_write(self, s: _Splice) -> None:
        """The tunnel's FIN reached the socket's turn: half-close it."""
        s.eof_pending = False
        try:
            s.sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            self.end(s, _why(exc))
            return
        s.writing = False
        if not s.reading:
            self.end(s, None)
        else:
            self.update(s)

    def read(self, s: _Splice, hup: int = 0) -> None:
        """One read of the socket into the stream; `hup` (EPOLLRDHUP: the peer has shut
        its side) and a read that took all that waited: the EOF is read now as well."""
        # Into the shared buffer, then a copy of what came: recv(CHUNK) allocates CHUNK
        # each time, above glibc's mmap threshold (an mmap and a munmap per read, 15 µs
        # for a 100-byte read, and page faults for a full one).
        while True:
            try:
                size = s.sock.recv_into(_READ_BUFFER)
            except BlockingIOError:
                return
            except OSError as exc:
                self.end(s, _why(exc))
                return
            if not size:
                break
            data = _READ_VIEW[:size].tobytes()
            if not self.to_tunnel(s, data):
                self.update(s)
                return
            if size == CHUNK:
                self._full_read = True
                return
            if not hup:
                return
            hup = 0  # one more read at most: the EOF, which the peer's FIN put last
        s.reading = False
        try:
            s.stream.send_eof_nowait()
        except (StreamResetError, trio.ClosedResourceError) as exc:
            self.end(s, _why(exc))
            return
        if not s.writing:
            self.end(s, None)
        else:
            self.update(s)

    def end(self, s: _Splice, error: str | None) -> None:
        """End a splice once: an error resets both ends, else the socket is closed (its
        FIN) and the stream closed as aclose() does; then `on_end`."""
        if s.ended:
            return
        if type(s.dial) is _Open:  # ended while its OPEN waits (reset, connection's end)
            self.open_failed(s, StreamFailed(p.StreamReason.UNREACHABLE,
                                             error or "closed before the answer"))
            return
        s.ended = True
        if s.dial is not None:  # ended while connecting (a reset, the connection's end)
            s.dial.answered()
            s.dial = None
        if self._splices.get(s.fd) is s:
            del self._splices[s.fd]
        if s.owner is not None:
            s.owner._splices.discard(s)
        stream = s.stream
        stream.attach_sink(None)
        if s.out:
            # Credit of data that will never be passed on goes back all the same.
            size = sum(map(len, s.out)) - s.free
            if size > 0:
                stream.consumed(size)
        s.out = None
        s.held = None
        if error is not None:
            try:
                s.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            except OSError:
                pass
        # Closing its only descriptor takes the socket out of the epoll set too.
        s.sock.close()
        # Within a round the loop sends the round's output itself at its end: no
        # writer wake-up for what this queues (the FIN just queued, if any, rides along).
        stream.abort_now(p.StreamReason.CANCELLED, "closed by the local side",
                         wake=not self._in_round)
        try:
            s.on_end(SpliceEnd(s.to_socket, s.to_tunnel, error))
        except Exception as exc:  # a bad callback must not end the others
            _log.error("splice end callback failed", stream=stream.stream_id,
                       target=str(stream.target), error=repr(exc))

    # ---- the task

    async def _run(self) -> None:
        epoll = self._epoll
        splices = self._splices
        carrier = self._carrier
        try:
            while True:
                # Always a yield point (other tasks run between rounds). After a round
                # that filled a read, more is likely there: a checkpoint, then our own
                # look (one epoll_wait), and trio's wait only if nothing was: a wait per
                # round re-arms trio's one-shot registration of the epoll descriptor (an
                # epoll_ctl) and takes a trip through its I/O dispatch.
                events = None
                if self._full_read:
                    self._full_read = False
                    await trio.lowlevel.checkpoint()
                    events = epoll.poll(0, _MAX_EVENTS)
                if not events:
                    await trio.lowlevel.wait_readable(epoll.fileno())
                    events = epoll.poll(0, _MAX_EVENTS)
                self._in_round = True
                for fd, flags in events:
                    s = splices.get(fd)
                    if s is None:
                        continue
                    if s.dial is not None:
                        if type(s.dial) is _Open:  # the client reset before the answer
                            self.open_failed(s, StreamFailed(
                                p.StreamReason.CANCELLED,
                                "the client went away before the node answered"))
                        else:
                            self.connected(s)
                        continue
                    if s.out and flags & ~_IN:  # writable, or an error to learn of
                        self.flush(s)
                    # Not for writability alone: a read then finds nothing (EAGAIN),
                    # a system call and an exception per write a full socket let go.
                    if not s.ended and s.mask & _IN and flags & ~_OUT:
                        self.read(s, flags & _RDHUP)
                self._in_round = False
                # Output for the tunnel, the whole round's: written from here when the
                # transport takes it at once (no writer wake-up), and wait while behind.
                await carrier.send_queued(now=True)
        except TunnelClosedError:
            pass
        except Exception as exc:
            # In the connection's nursery: a bug here costs these splices, not the tunnel.
            _log.error("splice loop failed", splices=len(splices), error=repr(exc))
        finally:
            self._in_round = False
            self._forget()
            for s in list(splices.values()):
                self.end(s, "tunnel connection ended")
            epoll.close()
            self._deadlines.clear()
            if self._timer is not None:
                self._timer.cancel()

    async def _expire_dials(self) -> None:
        """Refuse the dials whose deadline passed (TIMEOUT, as `connect_tcp` says it).
        One cancel scope at a time, whose deadline is the earliest pending dial's (a dial
        with an earlier one moves it; none pending: no deadline): a wake-up per deadline
        that comes, never one per dial."""
        deadlines = self._deadlines
        try:
            while not self.ended:
                while deadlines and deadlines[0][2].splice is None:
                    heapq.heappop(deadlines)  # answered already
                with trio.CancelScope(deadline=deadlines[0][0] if deadlines
                                      else math.inf) as self._timer:
                    await trio.sleep_forever()
                self._timer = None
                now = trio.current_time()
                while deadlines and deadlines[0][0] <= now:
                    heapq.heappop(deadlines)[2].expire(self)
                self._carrier.flush()
        finally:
            self._timer = None
            self._timer_started = False

    def _forget(self) -> None:
        """Out of the registry: it holds the connection strongly through this loop, so
        a loop left there would keep its connection alive forever."""
        self.ended = True
        if _LOOPS.get(self._carrier) is self:
            del _LOOPS[self._carrier]
