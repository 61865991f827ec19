"""The trio shell around the protocol core: one `TunnelConnection` per transport.

A connection is a nursery: a reader task feeds received bytes to the core and acts on its
events, a writer task writes what the core queued, a keepalive task pings. Streams are
`TunnelStream` objects (trio HalfCloseableStreams) whose tasks live either in the
connection's nursery (streams the peer opened, handed to the stream handler) or in the
caller's (streams we opened). When the connection ends every stream is reset, so nothing
waits on a dead connection.

The streams live in stream.py and reach their connection only through the public
methods of `StreamCarrier` (declared there, implemented here); the connection delivers
to them through their public `*_received` methods. The errors live in errors.py (their
names importable from here too, as every caller always has), the HELLO exchange that
opens the connection in handshake.py.

Backpressure is explicit everywhere: a stream's sender waits for flow-control credit and
for the outgoing buffer to drain; the reader stops reading while the outgoing buffer holds
more than stream data alone can queue (the peer's connection window), so a peer that
floods us with frames needing answers (PING, refused OPENs) is slowed to the pace at which
it reads our answers, and two peers busy sending to each other never both stop reading.
"""

from __future__ import annotations

import itertools
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
import trio.lowlevel

from tunnel import handshake
from tunnel import protocol as p
from tunnel.errors import (
    AuthenticationFailed,
    HandshakeError,
    HandshakeRefused,
    StreamRefusedError,
    StreamResetError,
    TunnelClosedError,
    TunnelError,
)
from tunnel.limits import OpenRateLimiter
from tunnel.log import StructuredLogger, get_logger
from tunnel.stream import (
    IncomingStream,
    OpenAnswer,
    StreamHandler,
    StreamTaker,
    TunnelStream,
)
from tunnel.transports import PeerInfo, Transport, TransportError

# Stream senders wait while this much of our own output is queued.
OUTGOING_HIGH_WATER = 1024 * 1024
# The writer, and a task that sends its round's output itself (`_send_now`, `flush`),
# write at most this much synchronously (send_nowait): a splice loop round's 256 KiB read
# (tunnel.spliceloop.CHUNK) in its DATA frames, so a single bulk stream's rounds go out
# from the loop's own task, with no writer wake-up and none of the async send's lock and
# socket checkpoints (three scheduler rounds per write). TLSStream encrypts that much in
# one piece on its async path too, and keeps what the socket did not take without a
# copy. More goes through the transport's send, which encrypts and writes it piece by
# piece: one unbounded synchronous write encrypted all of it at once (up to the 1 MiB
# high-water mark) and copied what the socket did not take (more bulk CPU per GB).
_NOWAIT_MAX = 260 * 1024
# Output from this size on goes to the transport as the frames' pieces (a TLS transport
# encrypts them where they lie: no join of a bulk round's 256 KiB); smaller output is
# joined, one C call where the pieces' Python loop cost a request/response more.
_PIECES_FROM = 64 * 1024
# The reader stops reading only beyond what stream data alone can queue (the peer's
# connection window, capped here): a reader that stopped for stream data while its
# writer is blocked on the peer, whose reader does the same, would deadlock both. Past
# it, the output is answers to the peer's frames (PINGs, refusals): a flood.
_READER_WINDOW_CAP = 64 * 1024 * 1024


@dataclass
class EndpointSettings:
    protocol: p.Settings = field(default_factory=p.Settings)
    handshake_timeout: float = 10.0
    ping_interval: float = 15.0
    ping_timeout: float = 10.0
    open_timeout: float = 15.0
    # Streams the peer may open per second (burst = 2x): beyond it, OVERLOADED refusals.
    open_rate: float = 2000.0
    receive_chunk: int = 256 * 1024
    # The writer's synchronous send (see TunnelConnection._writer); False: always the
    # transport's async send (its locks and checkpoints), as before.
    send_fast_path: bool = True
    # Called with each keepalive round trip, in seconds (a metrics histogram): once per
    # ping_interval per connection, never per frame.
    on_rtt: Callable[[float], None] | None = None


@dataclass
class ConnectionInfo:
    """A snapshot for the debug socket and metrics."""

    peer: str
    identity: dict[str, str]
    connected_at: float  # wall clock
    rtt_seconds: float | None
    streams_open: int
    bytes_in: int
    bytes_out: int
    draining: bool


class TunnelConnection:
    """A protocol core on a transport. Call `dial_handshake()` (agent) or
    `accept_handshake()` (server), then `run()` in a nursery; open streams with
    `open_stream()` from any task while it runs."""

    def __init__(self, transport: Transport, role: p.Role,
                 settings: EndpointSettings | None = None,
                 stream_handler: StreamHandler | None = None,
                 log: StructuredLogger | None = None, *,
                 take_stream: StreamTaker | None = None) -> None:
        self.transport = transport
        self.role = role
        self.settings = settings or EndpointSettings()
        self._core = p.Connection(role, self.settings.protocol)
        self._handler = stream_handler
        # Looks at each stream the peer opens before a handler task is made for it.
        self._take_stream = take_stream
        self.log = log or get_logger("tunnel.endpoint", peer=transport.peer.address)
        self.identity: dict[str, str] = {}
        self.connected_at = time.time()
        self.rtt: float | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.end_reason: TunnelClosedError | None = None
        self._streams: dict[int, TunnelStream] = {}
        self._pending_opens: dict[int, OpenAnswer] = {}
        self._window_waiters: set[TunnelStream] = set()
        self._writer_wakeup = trio.Event()
        # send_nowait() left bytes in the transport: the writer's next send takes them.
        self._transport_pending = False
        # The reader is dispatching one read's events: output they queue is sent once,
        # after the loop, instead of per event.
        self._dispatching = False
        # Streams the reader delivered data or datagrams to in this read: their sinks may
        # hold them back to send together (tunnel/udp.py's SocketFlow, with UDP GSO; a
        # splice, in one sendmsg), told by `delivered()` when the read's events are done.
        self._fed: list[TunnelStream] = []
        self._fast_path = self.settings.send_fast_path
        # Set whenever the writer takes the core's queued output: senders waiting for
        # the outgoing buffer to fall below the high-water mark wake up on it.
        self._space = trio.Event()
        self._pings: dict[bytes, float] = {}
        self._ping_acked = trio.Event()
        self._streams_changed = trio.Event()
        self._ping_counter = itertools.count(1)
        self._open_limiter = OpenRateLimiter(self.settings.open_rate,
                                             burst=max(1.0, 2 * self.settings.open_rate))
        self._nursery: trio.Nursery | None = None
        self._finished = trio.Event()
        self.goaway_received = trio.Event()
        self._on_goaway_message = ""
        # Events that arrived in the same read as the handshake's answer (the peer may
        # send frames right after its HELLO): dispatched when run() starts.
        self._early_events: list[p.Event] = []

    # ------------------------------------------------------------------ properties

    @property
    def peer(self) -> PeerInfo:
        return self.transport.peer

    @property
    def is_open(self) -> bool:
        return self._core.is_open and self.end_reason is None

    @property
    def is_draining(self) -> bool:
        return self._core.is_draining

    @property
    def stats(self) -> p.ConnectionStats:
        return self._core.stats

    def info(self) -> ConnectionInfo:
        return ConnectionInfo(
            peer=self.peer.address, identity=dict(self.identity),
            connected_at=self.connected_at, rtt_seconds=self.rtt,
            streams_open=len(self._streams) + len(self._pending_opens),
            bytes_in=self.bytes_in, bytes_out=self.bytes_out, draining=self.is_draining,
        )

    def open_streams(self) -> list[tuple[TunnelStream, bool]]:
        """The streams open now (a copy, for debug views), each with whether its OPEN still
        waits for an answer: the peer's, or this side's handler, still dialing its target."""
        pending = self._pending_opens
        state = self._core.stream_state
        return [(s, s.stream_id in pending or state(s.stream_id) is p.StreamState.OPEN_RECEIVED)
                for s in self._streams.values()]

    # ------------------------------------------------------------------ handshake

    async def dial_handshake(self, hello: p.Hello) -> p.Hello:
        """Dialer: send our HELLO, wait for the acceptor's. Raises HandshakeError."""
        done = await self._handshake(lambda channel: handshake.dial_handshake(
            channel, hello, within=self.settings.handshake_timeout))
        self._early_events = done.early_events
        return done.hello

    async def accept_handshake(self, authenticate: handshake.Vetter) -> p.Hello:
        """Acceptor: read the dialer's HELLO, let `authenticate` vet it and return our
        HELLO (or raise HandshakeRefused, e.g. AuthenticationFailed), answer. Returns the
        dialer's HELLO."""
        done = await self._handshake(lambda channel: handshake.accept_handshake(
            channel, authenticate, within=self.settings.handshake_timeout))
        return done.hello

    async def _handshake(self, run: Callable[[handshake.HandshakeChannel],
                                             Awaitable[handshake.Handshaken]]
                         ) -> handshake.Handshaken:
        channel = handshake.HandshakeChannel(self._core, self.transport)
        try:
            done = await run(channel)
        finally:
            self.bytes_in += channel.bytes_in
            self.bytes_out += channel.bytes_out
        self.identity = dict(done.hello.identity)
        return done

    def limit_peer_streams(self, max_streams: int) -> None:
        """While vetting the peer's HELLO (accept_handshake's `authenticate`): allow it at
        most `max_streams` open streams, fewer than the settings say; our HELLO says so."""
        self._core.limit_remote_streams(max_streams)

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the connection until it ends; every stream is reset then. Returns
        normally however it ended; `end_reason` says why."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                if self.settings.ping_interval > 0:
                    nursery.start_soon(self._keepalive)
                task_status.started()
                early, self._early_events = self._early_events, []
                for event in early:
                    self._dispatch(event)
                if self._fed:
                    self._delivered()
                if early:
                    self._wake_writer()
                if self.end_reason is None and not self._core.is_closed:
                    await self._reader()
                else:
                    await self._final_flush()
                nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            self._end_all_streams()
            self._finished.set()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self.transport.aclose()

    async def wait_finished(self) -> None:
        await self._finished.wait()

    def _end(self, message: str, code: p.ErrorCode) -> None:
        if self.end_reason is None:
            self.end_reason = TunnelClosedError(message, code)
        self._space.set()

    async def _reader(self) -> None:
        core = self._core
        high_water = OUTGOING_HIGH_WATER + min(core.remote_settings.connection_window,
                                               _READER_WINDOW_CAP)
        while True:
            try:
                # A view the transport may reuse: the core copies what it keeps, and
                # nothing awaits before it is done with it.
                data = await self.transport.receive_view()
            except TransportError as exc:
                self._end(f"transport failed: {exc}", p.ErrorCode.INTERNAL_ERROR)
                return
            self.bytes_in += len(data)
            # DATA payloads lent as views of `data`: the sinks write them out or copy
            # them by the end of `_delivered()`; a stream's buffer copies at once.
            events = core.receive_data(data, lend=True)
            self._dispatching = True
            try:
                for event in events:
                    self._dispatch(event)
                if self._fed:
                    self._delivered()
            finally:
                self._dispatching = False
                events.clear()  # no view of the buffer outlives the dispatch
            if core.outgoing_size and not self._send_now():
                self._wake_writer()
            if self.end_reason is not None or core.is_closed:
                await self._final_flush()
                return
            await self._wait_for_space(high_water)

    def _send_queued_nowait(self, size: int) -> bool:
        """transport.send_nowait() of the core's queued output (`size` bytes): joined
        when small, as its pieces from _PIECES_FROM on."""
        if size < _PIECES_FROM:
            return self.transport.send_nowait(self._core.data_to_send())
        return self.transport.send_pieces_nowait(self._core.pieces_to_send())

    def _delivered(self) -> None:
        """The sinks fed in this read send what they held back, at once."""
        fed, self._fed = self._fed, []
        for stream in fed:
            stream.delivered()

    def _dispatch(self, event: p.Event) -> None:
        if isinstance(event, p.DatagramReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.bytes_received += len(event.data)
                stream.datagram_received(event.data)
                fed = self._fed
                if not fed or fed[-1] is not stream:  # once per run of one flow's
                    fed.append(stream)
        elif isinstance(event, p.DataReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.data_received(event.data)
                fed = self._fed
                if not fed or fed[-1] is not stream:  # once per run of one stream's
                    fed.append(stream)
            else:
                self._core.acknowledge_received_data(event.stream_id, len(event.data))
        elif isinstance(event, p.WindowUpdated):
            if event.stream_id == 0:
                waiters, self._window_waiters = self._window_waiters, set()
                for stream in waiters:
                    stream.window_opened()
            else:
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    self._window_waiters.discard(stream)
                    stream.window_opened()
        elif isinstance(event, p.StreamEnded):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.eof_received()
        elif isinstance(event, p.StreamOpened):
            self._on_stream_opened(event)
        elif isinstance(event, p.StreamAccepted | p.StreamRefused):
            pending = self._pending_opens.pop(event.stream_id, None)
            if pending is not None:
                pending.resolve(event)
        elif isinstance(event, p.StreamReset):
            stream = self._streams.pop(event.stream_id, None)
            if stream is not None:
                stream.reset_received(event.reason, event.message)
                self._streams_changed.set()
        elif isinstance(event, p.PingAcked):
            sent = self._pings.pop(event.payload, None)
            if sent is not None:
                self.rtt = trio.current_time() - sent
                self._ping_acked.set()
                if self.settings.on_rtt is not None:
                    self.settings.on_rtt(self.rtt)
        elif isinstance(event, p.GoAwayReceived):
            self._on_goaway_message = event.message
            self.log.info("peer is draining the connection", reason=event.message)
            self.goaway_received.set()
        elif isinstance(event, p.ConnectionTerminated):
            who = "peer" if event.by_peer else "local"
            self._end(event.message, event.code)
            level = self.log.info if event.code in (
                p.ErrorCode.NO_ERROR, p.ErrorCode.SHUTTING_DOWN) else self.log.warning
            level("tunnel connection ended", by=who, code=event.code.name.lower(),
                  reason=event.message)

    def _on_stream_opened(self, event: p.StreamOpened) -> None:
        if not self._core.is_open:
            return  # a later frame of the same read ended the connection: nothing to answer
        stream = TunnelStream(self, event.stream_id, event.target, event.metadata)
        if self._handler is None or self._nursery is None:
            self._core.refuse_stream(event.stream_id, p.StreamReason.REFUSED,
                                     "this side accepts no streams")
            return
        if not self._open_limiter.allow(trio.current_time()):
            self._core.refuse_stream(event.stream_id, p.StreamReason.OVERLOADED,
                                     "stream open rate limit")
            return
        self._streams[event.stream_id] = stream
        incoming = IncomingStream(self, stream)
        if self._take_stream is not None:
            try:
                if self._take_stream(incoming):
                    return  # answered, or taken by an owner that needs no task
            except Exception as exc:
                # A bug here must cost one stream, never the connection's reader.
                self.log.error("stream taker failed", stream=event.stream_id,
                               target=str(event.target), error=repr(exc), exc_info=True)
                if not incoming.answered:
                    incoming.refuse_now(p.StreamReason.INTERNAL, "handler failed")
                return
        self._nursery.start_soon(self._run_handler, incoming)

    async def _run_handler(self, incoming: IncomingStream) -> None:
        assert self._handler is not None
        try:
            await self._handler(incoming)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            # The stream or the connection went away under the handler: routine.
            self.log.debug("stream ended abruptly", stream=incoming.stream.stream_id,
                           target=str(incoming.target), reason=str(exc))
        except Exception as exc:
            # A bug in a handler must cost one stream, never the whole connection.
            self.log.error("stream handler failed", stream=incoming.stream.stream_id,
                           target=str(incoming.target), error=repr(exc), exc_info=True)
        finally:
            if not incoming.answered and self._core.has_stream(incoming.stream.stream_id):
                self._core.refuse_stream(incoming.stream.stream_id, p.StreamReason.INTERNAL,
                                         "handler did not answer")
                self._wake_writer()
            if not incoming.handed_over:
                with trio.CancelScope(shield=True):
                    await incoming.stream.aclose()

    async def _writer(self) -> None:
        """Send what the core queued, one write per wake-up: the writer runs after the
        tasks that were ready when it was woken, so what they all queued goes out at once.

        The fast path (EndpointSettings.send_fast_path): when the transport can take the
        bytes now (`send_nowait`: nothing left over, no send in progress), the writer
        writes them synchronously, without the transport's and TLS layer's locks and
        their checkpoints: one task step per wake-up instead of four. What the socket
        does not take stays in the transport, whole, and the next send (awaited, as
        before) sends it first. Batching, fairness and flow control are the queued
        path's: same writer, same queue, same windows. Only up to `_NOWAIT_MAX` bytes:
        the request/response case, not bulk.

        Why not let the stream task that queued output send it itself while the writer
        idles: one stream's round trip gets a little cheaper, but many concurrent
        streams' get much dearer (their writes fall to a few frames each), and it has to
        read trio's private run queue (scripts/benchlib/micro.py --tls measures both)."""
        core = self._core
        while True:
            size = core.outgoing_size
            if not size and not self._transport_pending:
                self._writer_wakeup = trio.Event()
                await self._writer_wakeup.wait()
                continue
            self._space.set()
            if (size and self._fast_path and size <= _NOWAIT_MAX
                    and not self._transport_pending and self.transport.can_send_nowait()):
                # No lock, no checkpoint: one task step per wake-up instead of four.
                self.bytes_out += size
                if not self._send_queued_nowait(size):
                    self._transport_pending = True
                continue
            # From _PIECES_FROM on unjoined: a TLS transport encrypts the frames where
            # they lie (see TLSStream.send_pieces), no fresh buffer of it all per send.
            self._transport_pending = False
            try:
                if size < _PIECES_FROM:
                    await self.transport.send(core.data_to_send())
                else:
                    await self.transport.send_pieces(core.pieces_to_send())
            except TransportError as exc:
                self._end(f"transport failed while sending: {exc}", p.ErrorCode.INTERNAL_ERROR)
                # Wake the reader's world: closing the transport makes receive() fail.
                await self.transport.aclose()
                return
            self.bytes_out += size

    async def _final_flush(self) -> None:
        """Send what the core queued last (a GOAWAY explaining a protocol error)."""
        data = self._core.data_to_send()
        if data or self._transport_pending:
            self._transport_pending = False
            with trio.move_on_after(1):
                try:
                    await self.transport.send(data)
                    self.bytes_out += len(data)
                except TransportError:
                    pass

    def _send_now(self) -> bool:
        """Write what the core queued in the calling task, as the writer's fast path does,
        if the transport takes it now: no wake-up of the writer, one task switch fewer.
        For the tasks that gather a whole round's output before they flush (the reader
        after a read's events, the splice loop after a round over its sockets), not for
        a stream's own task: many streams writing a few frames each cost more than one
        writer batching them (see `_writer`). False, with nothing taken, otherwise."""
        size = self._core.outgoing_size
        if (not size or size > _NOWAIT_MAX or not self._fast_path or self._transport_pending
                or self._dispatching or not self.transport.can_send_nowait()):
            return False
        self._space.set()
        self.bytes_out += size
        if not self._send_queued_nowait(size):
            self._transport_pending = True  # the rest waits in the transport: the writer's
            self._wake_writer()
        return True

    def _wake_writer(self) -> None:
        """Get the core's queued output moving: wake the writer, which runs after the
        tasks ready now, so what they queue meanwhile goes out in one write."""
        if self._dispatching:
            return  # the reader sends once, after its loop
        if not self._core.outgoing_size and not self._transport_pending:
            return  # nothing to write (a reset of a stream already gone): no wake-up
        wakeup = self._writer_wakeup
        if not wakeup.is_set():
            wakeup.set()

    async def _wait_for_space(self, high_water: int = OUTGOING_HIGH_WATER) -> None:
        # A shaped transport (shaping.py) takes less at a time: what waits here queues
        # before a PING's answer, which must not wait seconds behind a slow node's bulk.
        limit = self.transport.send_high_water
        if limit is not None and limit < high_water:
            high_water = limit
        while self._core.outgoing_size > high_water and self.end_reason is None:
            if self._space.is_set():
                self._space = trio.Event()
            await self._space.wait()

    async def _keepalive(self) -> None:
        while True:
            payload = struct.pack("!Q", next(self._ping_counter))
            self._pings = {payload: trio.current_time()}  # only the newest matters
            self._ping_acked = trio.Event()
            try:
                self._core.ping(payload)
            except p.LocalProtocolError:
                return
            self._wake_writer()
            # The answer rides behind whatever the peer sent before it: on a lossy path a
            # bulk transfer's send buffer delays it by seconds (measured: 20 % loss, a
            # download through the tunnel, PONG later than 3 s, the tunnel and the transfer
            # cut). Bytes arriving prove the peer alive, so each window that saw some
            # extends the wait. So does the peer's TCP acknowledging our segments while
            # some still wait: on a lossy path our own bytes, the PING among them, sit in
            # TCP's retransmission queue for longer than the timeout (its timer doubles
            # with each lost attempt), and a peer cannot answer what it has not received
            # (tunnel/transports/tcpstate.py). A window with neither means the peer or
            # the path is dead: a dead path acknowledges nothing.
            timeout = self.settings.ping_timeout
            wait = timeout
            while payload in self._pings:
                received = self.bytes_in
                with trio.move_on_after(wait):
                    await self._ping_acked.wait()
                if payload not in self._pings:
                    break
                if self.bytes_in != received:
                    wait = timeout
                    continue
                since_ack = self.transport.unacknowledged_wait()
                if since_ack is None or since_ack >= timeout:
                    break
                wait = timeout - since_ack
            if payload in self._pings:
                message = f"no PING answer within {self.settings.ping_timeout}s"
                self.log.warning("peer is unresponsive, closing", reason=message)
                self._core.close(p.ErrorCode.KEEPALIVE_TIMEOUT, message)
                self._end(message, p.ErrorCode.KEEPALIVE_TIMEOUT)
                await self._final_flush()
                await self.transport.aclose()
                return
            await trio.sleep(self.settings.ping_interval)

    def _end_all_streams(self) -> None:
        reason = self.end_reason or TunnelClosedError("connection closed")
        message = f"tunnel connection ended: {reason}"
        for stream in list(self._streams.values()):
            stream.reset_received(p.StreamReason.CANCELLED, message)
        self._streams.clear()
        for pending in list(self._pending_opens.values()):
            pending.fail(reason)
        self._pending_opens.clear()
        self._streams_changed.set()

    # ------------------------------------------------------------------ local API

    async def open_stream(self, target: p.Target,
                          metadata: dict[str, str] | None = None) -> TunnelStream:
        """Open a stream to `target` on the peer. Raises StreamRefusedError (refused,
        unreachable, timeout, forbidden, overloaded, draining) or TunnelClosedError."""
        pending = _PendingOpen()
        stream = self.open_stream_nowait(target, metadata, pending)
        stream_id = stream.stream_id
        try:
            await self.send_queued()
            with trio.move_on_after(self.settings.open_timeout) as scope:
                result = await pending.wait()
            if scope.cancelled_caught:
                raise StreamRefusedError(p.StreamReason.TIMEOUT,
                                         f"no answer to OPEN {target} in time")
            if isinstance(result, p.StreamRefused):
                raise StreamRefusedError(result.reason, result.message)
            return stream
        except BaseException:
            self._pending_opens.pop(stream_id, None)
            if self._streams.pop(stream_id, None) is not None and self.end_reason is None:
                stream.mark_closed()
                self._core.reset_stream(stream_id, p.StreamReason.CANCELLED, "open abandoned")
                self._wake_writer()
            raise

    def open_stream_nowait(self, target: p.Target, metadata: dict[str, str] | None,
                           answer: OpenAnswer) -> TunnelStream:
        """open_stream() for an owner that is not a task (a TCP mapping's accept loop,
        tunnel/spliceloop.py `open_in_loop`): the OPEN is queued (the caller gets it
        moving, `send_queued` or `flush`) and the stream returned at once; `answer` hears
        the peer's ACCEPT or REFUSE from the reader, or `fail` when the connection ends
        first. No timeout here: the owner's (it aborts the stream, `abort_now`, which
        takes the open off the books). Raises as open_stream() does before waiting."""
        if self.end_reason is not None or not self._core.is_open:
            raise self.end_reason or TunnelClosedError("connection not open")
        try:
            stream_id = self._core.open_stream(target, metadata)
        except p.DatagramsUnsupported as exc:
            raise StreamRefusedError(p.StreamReason.UNREACHABLE, str(exc)) from None
        except p.StreamLimitReached as exc:
            raise StreamRefusedError(p.StreamReason.OVERLOADED, str(exc)) from None
        except p.ConnectionDraining as exc:
            raise StreamRefusedError(p.StreamReason.DRAINING, str(exc)) from None
        stream = TunnelStream(self, stream_id, target, dict(metadata or {}))
        self._pending_opens[stream_id] = answer
        self._streams[stream_id] = stream
        return stream

    def goaway(self, message: str = "draining") -> None:
        """Drain: the peer opens no new streams here; running streams finish."""
        self._core.goaway(message)
        self._wake_writer()

    async def aclose(self, code: p.ErrorCode = p.ErrorCode.NO_ERROR, message: str = "") -> None:
        """End the connection now, telling the peer why."""
        if self.end_reason is None:
            self._core.close(code, message)
            self._end(message or "closed", code)
            with trio.CancelScope(shield=True):
                await self._final_flush()
                await self.transport.aclose()

    async def wait_idle(self) -> None:
        """Wait until no streams are open (used when draining)."""
        while self._streams or self._pending_opens:
            self._streams_changed = trio.Event()
            await self._streams_changed.wait()

    # ------------------------------------------------------------------ for its streams
    # The connection's side of tunnel.stream.StreamCarrier: what its streams (and splice's
    # direct sink) call. Not for users: a stream's own methods are the API.

    def send_some(self, stream_id: int, data: memoryview) -> int:
        window = self._core.send_window(stream_id)
        if window <= 0:
            return 0
        chunk = data[:window]
        self._core.send_data(stream_id, chunk)
        return len(chunk)

    def send_datagram(self, stream_id: int, data: bytes | memoryview, *,
                      wake: bool = True) -> str | None:
        if self.end_reason is not None or not self._core.is_open:
            return "closed"
        try:
            dropped = self._core.send_datagram(stream_id, data)
        except p.StreamClosedError:
            return "closed"
        if dropped is None and wake:
            self._wake_writer()
        return dropped

    def flush(self) -> None:
        if self._dispatching:
            return  # the reader sends once, after its loop
        if not self._core.outgoing_size and not self._transport_pending:
            return
        if (self._fast_path and not self._transport_pending and self.end_reason is None
                and 0 < self._core.outgoing_size <= _NOWAIT_MAX
                and self.transport.can_send_nowait()):
            # The writer's fast path, in the calling task: the writer is idle (no send
            # in progress), so taking everything queued keeps the order of the bytes.
            size = self._core.outgoing_size
            self._space.set()
            self.bytes_out += size
            if self._send_queued_nowait(size):
                return
            self._transport_pending = True
        self._wake_writer()

    def wait_for_window(self, stream: TunnelStream) -> bool:
        if not self._core.has_stream(stream.stream_id):
            return False
        self._window_waiters.add(stream)
        return True

    def end_stream(self, stream_id: int) -> None:
        self._core.end_stream(stream_id)

    def accept_stream(self, stream_id: int) -> None:
        self._core.accept_stream(stream_id)

    def refuse_stream(self, stream_id: int, reason: p.StreamReason, message: str) -> None:
        self._core.refuse_stream(stream_id, reason, message)

    def reset_stream(self, stream_id: int, reason: p.StreamReason, message: str, *,
                     wake: bool = True) -> None:
        self._core.reset_stream(stream_id, reason, message)
        if wake:
            self._wake_writer()

    def acknowledge(self, stream_id: int, size: int) -> None:
        if self._core.is_closed:
            return
        self._core.acknowledge_received_data(stream_id, size)
        if self._core.outgoing_size:
            self._wake_writer()

    def forget(self, stream: TunnelStream) -> None:
        if self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]
            # An open abandoned before its answer (open_stream_nowait's owner gave up).
            self._pending_opens.pop(stream.stream_id, None)
            self._streams_changed.set()
        self._window_waiters.discard(stream)

    async def send_queued(self, *, now: bool = False) -> None:
        """After a local action queued output: wake the writer (with `now`, write it in
        this task if the transport takes it at once: see `_send_now`), and wait if we are
        producing faster than the transport takes it."""
        if self.end_reason is not None:
            raise self.end_reason
        if not (now and self._send_now()):
            self._wake_writer()
        await self._wait_for_space()
        if self.end_reason is not None:
            raise self.end_reason

    def start_task(self, async_fn: Callable[[], Awaitable[None]]) -> bool:
        if self._nursery is None:
            return False
        self._nursery.start_soon(async_fn)
        return True


class _PendingOpen:
    def __init__(self) -> None:
        self._event = trio.Event()
        self._result: p.StreamAccepted | p.StreamRefused | None = None
        self._error: BaseException | None = None

    def resolve(self, result: p.StreamAccepted | p.StreamRefused) -> None:
        self._result = result
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def wait(self) -> p.StreamAccepted | p.StreamRefused:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


__all__ = [
    "AuthenticationFailed",
    "ConnectionInfo",
    "EndpointSettings",
    "HandshakeError",
    "HandshakeRefused",
    "IncomingStream",
    "StreamHandler",
    "StreamRefusedError",
    "StreamResetError",
    "TunnelClosedError",
    "TunnelConnection",
    "TunnelError",
    "TunnelStream",
]
