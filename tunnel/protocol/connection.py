"""`Connection`: one side of one tunnel connection, sans-IO.

The trio endpoints (tunnel/endpoint.py) feed received bytes to `receive_data()`, act on
the events it returns, call methods such as `open_stream()` or `send_data()`, and write
whatever `data_to_send()` returns to the transport. No socket, no trio, no clock.

This module owns a connection's state (settings, windows, the live streams, the output
queue) and every change to it: what our side does (the handshake from our side; opening,
answering, sending on, half-closing and resetting streams; returning credit for data the
app has read; PING, GOAWAY, close) and what the peer's bytes do (the handshake, and the
effect of each received frame). Every stream change, sent or received, is checked
against the stream table in state.py.

It is longer than most modules here because it is one state machine: every method reads
and writes the same few fields, and splitting it by direction (as it once was, by
inheritance) only hid that. What stands apart is elsewhere: the frame format (wire.py),
completing split frames (reassembly.py), the connection's receive credit (flow.py), the
stream table (state.py).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field, replace

from tunnel.protocol.errors import (
    ConnectionClosedError,
    ConnectionDraining,
    DatagramsUnsupported,
    ErrorCode,
    FlowControlBlocked,
    LocalProtocolError,
    RemoteProtocolError,
    StreamClosedError,
    StreamLimitReached,
    StreamReason,
)
from tunnel.protocol.events import (
    ConnectionTerminated,
    DatagramReceived,
    DataReceived,
    Event,
    GoAwayReceived,
    HandshakeCompleted,
    HelloReceived,
    PingAcked,
    StreamAccepted,
    StreamEnded,
    StreamOpened,
    StreamRefused,
    StreamReset,
    WindowUpdated,
)
from tunnel.protocol.flow import ReceiveCredit
from tunnel.protocol.reassembly import complete_pending
from tunnel.protocol.state import (
    STREAM_TRANSITIONS,
    TRANSITIONS_BY_EVENT,
    ConnectionState,
    StreamEvent,
    StreamRecord,
    StreamState,
    StreamTable,
    next_stream_state,
    unexpected_frame,
)
from tunnel.protocol.wire import (
    FEATURE_DATAGRAM,
    FEATURE_RETRY_AFTER,
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RETRY_AFTER,
    HANDSHAKE_FRAME_LIMIT,
    HEADER,
    HEADER_SIZE,
    MAX_DATAGRAM,
    MAX_RETRY_AFTER,
    MAX_VERSION,
    MAX_WINDOW,
    MIN_VERSION,
    PING_PAYLOAD_SIZE,
    FrameType,
    Hello,
    Role,
    Settings,
    Target,
    decode_goaway,
    decode_open,
    decode_reason,
    decode_window,
    encode_goaway,
    encode_open,
    encode_reason,
    encode_window,
)

# The hot path's columns of the stream table (see state.py), looked up once per frame.
_ON_RECV_DATA = TRANSITIONS_BY_EVENT[StreamEvent.RECV_DATA]
_ON_RECV_FIN = TRANSITIONS_BY_EVENT[StreamEvent.RECV_FIN]
_ON_SEND_DATA = TRANSITIONS_BY_EVENT[StreamEvent.SEND_DATA]
_ON_SEND_FIN = TRANSITIONS_BY_EVENT[StreamEvent.SEND_FIN]
_ON_SEND_WINDOW = TRANSITIONS_BY_EVENT[StreamEvent.SEND_WINDOW]
_ON_SEND_DATAGRAM = TRANSITIONS_BY_EVENT[StreamEvent.SEND_DATAGRAM]

# Datagrams a flow may hold while the connection has no credit for them (per flow, and
# for the whole connection): beyond, `send_datagram()` drops and counts. One full-size
# datagram always fits a flow's queue.
DATAGRAM_QUEUE_PER_FLOW = 256 * 1024
DATAGRAM_QUEUE_TOTAL = 4 * 1024 * 1024
_CLOSED = StreamState.CLOSED


@dataclass(slots=True)
class ConnectionStats:
    """Counters for metrics; the endpoint exports them."""

    frames_received: int = 0
    frames_sent: int = 0
    streams_opened_local: int = 0
    streams_opened_remote: int = 0
    streams_refused_over_limit: int = 0
    streams_refused_draining: int = 0
    datagrams_sent: int = 0
    datagrams_received: int = 0
    # Datagrams send_datagram() dropped, by reason: too_large, queue_full, congested.
    datagrams_dropped: Counter[str] = field(default_factory=Counter)


class Connection:
    """One side of one tunnel connection. Streams can be opened by either side: odd ids
    by the dialing side, even ids by the accepting side, always increasing."""

    def __init__(
        self,
        role: Role,
        settings: Settings | None = None,
        *,
        receive_budget: int | None = None,
        datagram_queue_per_flow: int = DATAGRAM_QUEUE_PER_FLOW,
        datagram_queue_total: int = DATAGRAM_QUEUE_TOTAL,
    ) -> None:
        self.role = role
        self.local_settings = settings or Settings()
        self.local_settings.validate()
        # Until the peer's HELLO arrives we assume the protocol's default limits.
        self.remote_settings = Settings()
        self.state = ConnectionState.HANDSHAKE
        self.version: int | None = None
        self.remote_hello: Hello | None = None
        self.stats = ConnectionStats()

        self._streams = StreamTable()
        self._next_local_id = 1 if role is Role.DIALER else 2
        self._highest_remote_id = 0
        self._hello_sent = False
        self._goaway_sent = False
        self._goaway_received = False
        self._goaway_last_id = 0  # last peer-opened id we promised to handle

        self._conn_send_window = self.remote_settings.connection_window
        # Unread data (received, delivered, not yet acknowledged) we accept before we
        # stop returning connection credit: the bound on what a peer can make us buffer.
        self._credit = ReceiveCredit(
            full_window=self.local_settings.connection_window,
            budget=(receive_budget if receive_budget is not None
                    else 3 * self.local_settings.connection_window),
        )

        self._inbuf = bytearray()
        # receive_data(lend=True) is under way: DATA payloads are handed out as views.
        self._lend = False
        self._out: list[bytes | memoryview] = []
        self._out_size = 0

        # Flows with queued datagrams, served round robin as connection credit returns:
        # one flow's burst waits behind one datagram of each other flow, not all of it.
        self._datagram_ready: deque[StreamRecord] = deque()
        self._datagram_queued = 0
        self.datagram_queue_per_flow = datagram_queue_per_flow
        self.datagram_queue_total = datagram_queue_total

    # ---------------------------------------------------------------- introspection

    @property
    def is_open(self) -> bool:
        return self.state is ConnectionState.OPEN

    @property
    def is_closed(self) -> bool:
        return self.state is ConnectionState.CLOSED

    @property
    def is_draining(self) -> bool:
        return self._goaway_sent or self._goaway_received

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def unacked_bytes(self) -> int:
        return self._credit.unacked

    @property
    def receive_budget(self) -> int:
        return self._credit.budget

    @property
    def outgoing_size(self) -> int:
        """Bytes queued by the core that the transport has not taken yet."""
        return self._out_size

    def stream_ids(self) -> list[int]:
        return list(self._streams)

    def has_stream(self, stream_id: int) -> bool:
        return stream_id in self._streams

    def stream_state(self, stream_id: int) -> StreamState:
        """Where the stream is in its life cycle (the rows of state.STREAM_TRANSITIONS)."""
        stream = self._streams.get(stream_id)
        return stream.state if stream is not None else self._idle_or_closed(stream_id)

    def send_window(self, stream_id: int) -> int:
        """How many bytes send_data() accepts for this stream right now."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.state not in _ON_SEND_DATA:
            return 0
        return min(stream.send_window, self._conn_send_window)

    @property
    def peer_carries_datagrams(self) -> bool:
        """Whether the peer announced FEATURE_DATAGRAM (flows may be opened to it)."""
        hello = self.remote_hello
        return hello is not None and FEATURE_DATAGRAM in hello.features

    @property
    def datagrams_queued(self) -> int:
        """Bytes of datagrams waiting for connection credit, all flows together."""
        return self._datagram_queued

    def can_open_stream(self) -> bool:
        return (
            self.state is ConnectionState.OPEN
            and not self.is_draining
            and self._count_streams(local=True) < self.remote_settings.max_streams
        )

    # ---------------------------------------------------------------- output

    def data_to_send(self) -> bytes:
        """Everything queued for the transport; empty if nothing is."""
        if not self._out:
            return b""
        data = bytes(self._out[0]) if len(self._out) == 1 else b"".join(self._out)
        self._out.clear()
        self._out_size = 0
        return data

    def pieces_to_send(self) -> list[bytes | memoryview]:
        """`data_to_send()` unjoined: the queued frames' headers and payloads in order
        (payloads may be views of the buffers given to `send_data`), for a transport
        that writes them without the join (TLSStream encrypts them in place). The list
        is the caller's; empty if nothing is queued."""
        out = self._out
        if not out:
            return []
        self._out = []
        self._out_size = 0
        return out

    def _emit(self, ftype: FrameType, flags: int, stream_id: int,
              payload: bytes | memoryview = b"") -> None:
        self._out.append(HEADER.pack(len(payload) << 8 | ftype, flags, stream_id))
        if payload:
            self._out.append(payload)
        self._out_size += HEADER_SIZE + len(payload)
        self.stats.frames_sent += 1

    def _enter_closed(self) -> None:
        self.state = ConnectionState.CLOSED
        self._streams.clear()
        self._inbuf = bytearray()
        self._datagram_ready.clear()
        self._datagram_queued = 0

    def _require_open(self) -> None:
        if self.state is ConnectionState.CLOSED:
            raise ConnectionClosedError("connection closed")
        if self.state is not ConnectionState.OPEN:
            raise LocalProtocolError("handshake not complete")

    def _count_streams(self, *, local: bool) -> int:
        local_count = self._streams.local
        return local_count if local else len(self._streams) - local_count

    def _set_state(self, stream: StreamRecord, state: StreamState) -> None:
        if state is _CLOSED:
            self._forget(stream)
        else:
            stream.state = state

    def _forget(self, stream: StreamRecord) -> None:
        """The stream is closed: drop its record and any datagrams it still queued."""
        del self._streams[stream.id]
        if stream.queue is not None:
            self._datagram_queued -= stream.queued_bytes
            stream.queue = None
            stream.queued_bytes = 0

    # ---------------------------------------------------------------- local actions

    def start(self, hello: Hello) -> None:
        """Dialer: queue our HELLO. The acceptor calls accept_handshake() instead."""
        if self.role is not Role.DIALER or self._hello_sent:
            raise LocalProtocolError("start() is for the dialer, once")
        self._send_hello(hello)

    def accept_handshake(self, hello: Hello) -> None:
        """Acceptor: the dialer's HELLO is acceptable; answer with ours. Streams may
        flow from now on."""
        if self.role is not Role.ACCEPTOR or self.remote_hello is None or self._hello_sent:
            raise LocalProtocolError("accept_handshake() answers a HelloReceived, once")
        if self.state is ConnectionState.CLOSED:
            raise ConnectionClosedError("connection closed")
        self._send_hello(hello)
        self.state = ConnectionState.OPEN

    def limit_remote_streams(self, max_streams: int) -> None:
        """Before our HELLO: let the peer have at most `max_streams` streams open towards
        us on this connection, fewer than the settings it was made with (a connection
        trusted less, e.g. an anonymous one, gets fewer). Our HELLO announces it; an OPEN
        beyond it is refused as OVERLOADED."""
        if self._hello_sent:
            raise LocalProtocolError("limit_remote_streams() goes before our HELLO")
        if not 1 <= max_streams <= self.local_settings.max_streams:
            raise LocalProtocolError(f"max_streams {max_streams} not in "
                                     f"[1, {self.local_settings.max_streams}]")
        self.local_settings = replace(self.local_settings, max_streams=max_streams)

    def refuse_handshake(self, code: ErrorCode, message: str,
                         retry_after: float | None = None) -> None:
        """Acceptor: refuse the dialer's HELLO (instead of accept_handshake()) and end the
        connection. `retry_after` (seconds) tells the dialer when to come back: as a field
        if its HELLO announced FEATURE_RETRY_AFTER, else only in the message's words."""
        if self.role is not Role.ACCEPTOR or self.remote_hello is None or self._hello_sent:
            raise LocalProtocolError("refuse_handshake() answers a HelloReceived, once")
        if code is ErrorCode.NO_ERROR:
            raise LocalProtocolError("a refusal needs an error code")
        if self.state is ConnectionState.CLOSED:
            return
        flags = 0
        if retry_after is not None:
            if not 0 <= retry_after <= MAX_RETRY_AFTER:
                raise LocalProtocolError(f"retry_after {retry_after} not in "
                                         f"[0, {MAX_RETRY_AFTER:g}] seconds")
            if FEATURE_RETRY_AFTER in self.remote_hello.features:
                flags = FLAG_RETRY_AFTER
            else:
                message = f"{message} (retry after {retry_after:.1f}s)"
                retry_after = None
        self._emit(FrameType.GOAWAY, flags, 0, encode_goaway(0, code, message, retry_after))
        self._goaway_sent = True
        self._enter_closed()

    def _send_hello(self, hello: Hello) -> None:
        # Every core carries flows; the feature tells the peer it may send DATAGRAM.
        features = hello.features if FEATURE_DATAGRAM in hello.features else (
            *hello.features, FEATURE_DATAGRAM)
        if hello.settings != self.local_settings or features != hello.features:
            hello = Hello(settings=self.local_settings, identity=hello.identity,
                          features=features, min_version=hello.min_version,
                          max_version=hello.max_version)
        payload = hello.encode()
        if len(payload) > HANDSHAKE_FRAME_LIMIT:
            raise LocalProtocolError("HELLO too large")
        self._emit(FrameType.HELLO, 0, 0, payload)
        self._hello_sent = True

    def open_stream(self, target: Target, metadata: dict[str, str] | None = None) -> int:
        """Queue an OPEN; returns the new stream id. Wait for StreamAccepted before
        sending data."""
        self._require_open()
        if self.is_draining:
            raise ConnectionDraining("connection is draining (GOAWAY)")
        if self._count_streams(local=True) >= self.remote_settings.max_streams:
            raise StreamLimitReached(
                f"peer allows {self.remote_settings.max_streams} concurrent streams")
        target.validate()
        flow = target.protocol == "udp"
        if flow and not self.peer_carries_datagrams:
            raise DatagramsUnsupported("the peer does not carry UDP (no datagram feature)")
        payload = encode_open(target, metadata or {})
        if len(payload) > self.remote_settings.max_open_size:
            raise LocalProtocolError(
                f"OPEN of {len(payload)} bytes exceeds the peer's limit "
                f"{self.remote_settings.max_open_size}")
        stream_id = self._next_local_id
        self._next_local_id += 2
        # A fresh id is IDLE by construction.
        state = STREAM_TRANSITIONS[StreamState.IDLE][StreamEvent.SEND_OPEN]
        self._streams[stream_id] = StreamRecord(
            id=stream_id, local=True, state=state,
            send_window=self.remote_settings.initial_stream_window,
            recv_window=self.local_settings.initial_stream_window, datagram=flow,
        )
        self.stats.streams_opened_local += 1
        self._emit(FrameType.OPEN, 0, stream_id, payload)
        return stream_id

    def accept_stream(self, stream_id: int) -> None:
        self._answer(stream_id, StreamEvent.SEND_ACCEPT)
        self._emit(FrameType.ACCEPT, 0, stream_id)

    def refuse_stream(self, stream_id: int, reason: StreamReason, message: str = "") -> None:
        self._answer(stream_id, StreamEvent.SEND_REFUSE)
        self._emit(FrameType.REFUSE, 0, stream_id, encode_reason(reason, message))

    def _answer(self, stream_id: int, event: StreamEvent) -> None:
        self._require_open()
        stream = self._streams.get(stream_id)
        if stream is None:
            raise StreamClosedError(stream_id)
        state = next_stream_state(stream.state, event)
        if state is None:
            raise LocalProtocolError(f"stream {stream_id} is not awaiting an answer")
        self._set_state(stream, state)

    def send_data(self, stream_id: int, data: bytes | bytearray | memoryview,
                  end_stream: bool = False) -> None:
        """Queue data (split into frames as needed). len(data) must be within
        send_window(stream_id); wait for WindowUpdated otherwise."""
        self._require_open()
        stream = self._streams.get(stream_id)
        if stream is None:
            raise StreamClosedError(stream_id)
        state = (_ON_SEND_FIN if end_stream else _ON_SEND_DATA).get(stream.state)
        if state is None:
            if stream.state is StreamState.HALF_CLOSED_LOCAL:
                raise LocalProtocolError(f"stream {stream_id} already sent FIN")
            raise LocalProtocolError(f"stream {stream_id} is not accepted yet")
        size = len(data)
        if size > stream.send_window or size > self._conn_send_window:
            raise FlowControlBlocked(
                f"{size} bytes exceed the window ({self.send_window(stream_id)})")
        stream.send_window -= size
        self._conn_send_window -= size
        max_frame = self.remote_settings.max_frame_size
        view = memoryview(data)
        # Immutable input (bytes) is queued as slices, copied once by data_to_send();
        # a mutable buffer is copied now, since the caller may reuse it.
        copy = not view.readonly
        offset = 0
        while True:
            chunk: bytes | memoryview = view[offset:offset + max_frame]
            if copy:
                chunk = bytes(chunk)
            offset += len(chunk)
            last = offset >= size
            self._emit(FrameType.DATA, FLAG_FIN if (last and end_stream) else 0,
                       stream_id, chunk)
            if last:
                break
        if state is _CLOSED:
            self._forget(stream)
        else:
            stream.state = state

    def send_datagram(self, stream_id: int, data: bytes | bytearray | memoryview,
                      ) -> str | None:
        """Queue one datagram on a flow; returns None, or why it was dropped (counted in
        stats.datagrams_dropped): "too_large" (beyond the peer's frame size), "queue_full"
        (this flow's queue), "congested" (every flow's queue together). It goes out at
        once while the connection has credit; otherwise it waits in its flow's queue,
        and the queues are served round robin as credit returns. Datagrams are not
        stream flow-controlled: the connection window alone bounds what is in flight."""
        self._require_open()
        stream = self._streams.get(stream_id)
        if stream is None:
            raise StreamClosedError(stream_id)
        if stream.state not in _ON_SEND_DATAGRAM:
            if stream.state is StreamState.HALF_CLOSED_LOCAL:
                raise LocalProtocolError(f"stream {stream_id} already sent FIN")
            raise LocalProtocolError(f"stream {stream_id} is not accepted yet")
        if not stream.datagram:
            raise LocalProtocolError(f"stream {stream_id} is not a flow (its target is tcp)")
        size = len(data)
        if size > MAX_DATAGRAM or size > self.remote_settings.max_frame_size:
            return self._drop_datagram("too_large")
        payload = bytes(data)  # a datagram is small: one copy, the caller may reuse data
        if stream.queue is None and size <= self._conn_send_window:
            self._emit_datagram(stream_id, payload)
            return None
        if stream.queued_bytes + size > self.datagram_queue_per_flow:
            return self._drop_datagram("queue_full")
        if self._datagram_queued + size > self.datagram_queue_total:
            return self._drop_datagram("congested")
        if stream.queue is None:
            stream.queue = deque()
            self._datagram_ready.append(stream)
        stream.queue.append(payload)
        stream.queued_bytes += size
        self._datagram_queued += size
        return None

    def _drop_datagram(self, reason: str) -> str:
        self.stats.datagrams_dropped[reason] += 1
        return reason

    def _emit_datagram(self, stream_id: int, payload: bytes) -> None:
        self._conn_send_window -= len(payload)
        self.stats.datagrams_sent += 1
        self._emit(FrameType.DATAGRAM, 0, stream_id, payload)

    def _flush_datagrams(self) -> None:
        """Send queued datagrams while the connection has credit, one per flow per round."""
        ready = self._datagram_ready
        while ready:
            stream = ready[0]
            queue = stream.queue
            if queue is None:  # closed since it queued (_forget emptied it)
                ready.popleft()
                continue
            if len(queue[0]) > self._conn_send_window:
                return
            ready.popleft()
            payload = queue.popleft()
            stream.queued_bytes -= len(payload)
            self._datagram_queued -= len(payload)
            self._emit_datagram(stream.id, payload)
            if queue:
                ready.append(stream)
            else:
                stream.queue = None

    def end_stream(self, stream_id: int) -> None:
        """Half-close: we send no more data on this stream (FIN)."""
        self.send_data(stream_id, b"", end_stream=True)

    def reset_stream(self, stream_id: int, reason: StreamReason = StreamReason.CANCELLED,
                     message: str = "") -> None:
        """Abort a stream in both directions. A no-op for a stream already gone."""
        if self.state is ConnectionState.CLOSED:
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        state = next_stream_state(stream.state, StreamEvent.SEND_RST)
        if state is None:
            return
        self._set_state(stream, state)
        self._emit(FrameType.RST, 0, stream_id, encode_reason(reason, message))

    def acknowledge_received_data(self, stream_id: int, size: int) -> None:
        """The app consumed `size` bytes of this stream: return credit to the peer."""
        if size <= 0:
            return
        self._credit.acknowledged(size)
        stream = self._streams.get(stream_id)
        if stream is not None and stream.state in _ON_SEND_WINDOW:
            stream.pending_credit += size
            if stream.pending_credit >= self.local_settings.initial_stream_window // 2:
                self._emit(FrameType.WINDOW, 0, stream_id,
                           encode_window(stream.pending_credit))
                stream.recv_window += stream.pending_credit
                stream.pending_credit = 0
        self._maybe_return_connection_credit()

    def ping(self, payload: bytes) -> None:
        """Queue a PING with an 8-byte payload; the peer answers with PingAcked."""
        if len(payload) != PING_PAYLOAD_SIZE:
            raise LocalProtocolError("PING payload must be 8 bytes")
        self._require_open()
        self._emit(FrameType.PING, 0, 0, payload)

    def goaway(self, message: str = "draining", code: ErrorCode = ErrorCode.NO_ERROR) -> None:
        """Start draining: the peer opens no new streams; running ones finish."""
        if self.state is ConnectionState.CLOSED or self._goaway_sent:
            return
        self._goaway_sent = True
        self._goaway_last_id = self._highest_remote_id
        self._emit(FrameType.GOAWAY, 0, 0, encode_goaway(self._goaway_last_id, code, message))

    def close(self, code: ErrorCode = ErrorCode.NO_ERROR, message: str = "") -> None:
        """End the connection now: GOAWAY with `code`, every stream is gone."""
        if self.state is ConnectionState.CLOSED:
            return
        # A terminating GOAWAY uses a non-zero code even for a plain close so that the
        # peer does not mistake it for a drain.
        wire_code = ErrorCode.SHUTTING_DOWN if code is ErrorCode.NO_ERROR else code
        self._emit(FrameType.GOAWAY, 0, 0,
                   encode_goaway(self._highest_remote_id, wire_code, message))
        self._goaway_sent = True
        self._enter_closed()

    # ---------------------------------------------------------------- input

    def receive_data(self, data: bytes | memoryview, *, lend: bool = False) -> list[Event]:
        """Feed bytes from the transport; b"" means the transport reached EOF. Keeps no
        reference to `data` once it returns (events carry copies): the caller may reuse
        its buffer. `lend`: a DataReceived's payload is a view of `data` (or of the
        reassembly buffer) instead of a copy, for a caller that is done with the events
        before it reuses `data` and copies what it keeps (the tunnel's reader hands the
        frames of a read to a socket in one write: no copy of a frame it writes whole)."""
        if self.state is ConnectionState.CLOSED:
            return []
        if lend:
            self._lend = True
            try:
                return self.receive_data(data)
            finally:
                self._lend = False
        events: list[Event] = []
        if not data:
            reason = "peer closed the connection"
            if self._inbuf:
                reason += f" in the middle of a frame ({len(self._inbuf)} bytes pending)"
            self._enter_closed()
            events.append(ConnectionTerminated(ErrorCode.NO_ERROR, reason, by_peer=True))
            return events
        try:
            pos = 0
            if self._inbuf:
                # Complete the pending partial frame with just the bytes it lacks, then
                # parse the rest of `data` in place: the stream is not copied through
                # the reassembly buffer.
                pos = complete_pending(self._inbuf, data, self._frame_limit())
                if pos < 0:
                    return events  # still partial: all of data went into the buffer
                self._parse(self._inbuf, 0, events)
                self._inbuf = bytearray()
            if pos < len(data) and not self.is_closed:
                offset = self._parse(data, pos, events)
                if offset < len(data) and not self.is_closed:
                    with memoryview(data) as view:
                        self._inbuf = bytearray(view[offset:])
        except RemoteProtocolError as exc:
            self._protocol_error(exc, events)
            return events
        if self.is_closed:
            return events
        self._maybe_return_connection_credit()
        return events

    def _frame_limit(self) -> int:
        return (self.local_settings.max_frame_size if self.remote_hello is not None
                else HANDSHAKE_FRAME_LIMIT)

    def _parse(self, buf: bytes | bytearray | memoryview, offset: int,
               events: list[Event]) -> int:
        """Handle every complete frame in buf[offset:]; returns where the first
        incomplete one starts."""
        end = len(buf)
        view = memoryview(buf)
        try:
            while end - offset >= HEADER_SIZE and not self.is_closed:
                word, flags, stream_id = HEADER.unpack_from(buf, offset)
                length = word >> 8
                if length > (limit := self._frame_limit()):
                    raise RemoteProtocolError(
                        f"frame of {length} bytes exceeds the limit of {limit}",
                        ErrorCode.FRAME_SIZE_ERROR)
                if end - offset < HEADER_SIZE + length:
                    break
                start = offset + HEADER_SIZE
                offset = start + length
                self.stats.frames_received += 1
                self._handle_frame(word & 0xFF, flags, stream_id, view[start:offset], events)
        finally:
            view.release()
        return offset

    def _protocol_error(self, exc: RemoteProtocolError, events: list[Event]) -> None:
        message = str(exc)
        self._emit(FrameType.GOAWAY, 0, 0,
                   encode_goaway(self._highest_remote_id, exc.code, message))
        self._goaway_sent = True
        self._enter_closed()
        events.append(ConnectionTerminated(exc.code, message, by_peer=False))

    def _handle_frame(self, ftype: int, flags: int, stream_id: int, payload: memoryview,
                      events: list[Event]) -> None:
        if self.state is ConnectionState.HANDSHAKE:
            self._handle_handshake_frame(ftype, flags, stream_id, payload, events)
            return
        if ftype == FrameType.DATA:
            self._on_data(flags, stream_id, payload, events)
        elif ftype == FrameType.WINDOW:
            self._on_window(stream_id, payload, events)
        elif ftype == FrameType.DATAGRAM:
            self._on_datagram(stream_id, payload, events)
        elif ftype == FrameType.OPEN:
            self._on_open(stream_id, payload, events)
        elif ftype == FrameType.ACCEPT:
            self._on_accept(stream_id, payload, events)
        elif ftype == FrameType.REFUSE:
            self._on_refuse(stream_id, payload, events)
        elif ftype == FrameType.RST:
            self._on_rst(stream_id, payload, events)
        elif ftype == FrameType.PING:
            self._on_ping(flags, stream_id, payload, events)
        elif ftype == FrameType.GOAWAY:
            self._on_goaway(flags, stream_id, payload, events)
        elif ftype == FrameType.HELLO:
            raise RemoteProtocolError("HELLO after the handshake")
        else:
            raise RemoteProtocolError(f"unknown frame type 0x{ftype:02x}")

    def _handle_handshake_frame(self, ftype: int, flags: int, stream_id: int,
                                payload: memoryview, events: list[Event]) -> None:
        if ftype == FrameType.GOAWAY and self.role is Role.DIALER:
            # The acceptor refused us (bad token, version, overloaded) before the
            # handshake finished.
            self._on_goaway(flags, stream_id, payload, events)
            return
        if self.remote_hello is not None:
            # Acceptor that has not answered yet: the dialer must wait for our HELLO.
            raise RemoteProtocolError("frame before the handshake completed")
        if ftype != FrameType.HELLO:
            raise RemoteProtocolError(
                f"expected HELLO, got frame type 0x{ftype:02x}: not a nodeagent tunnel peer?")
        if stream_id != 0:
            raise RemoteProtocolError("HELLO must be on stream 0")
        if self.role is Role.DIALER and not self._hello_sent:
            raise RemoteProtocolError("acceptor spoke first")
        hello = Hello.decode(bytes(payload))
        version = min(hello.max_version, MAX_VERSION)
        if version < max(hello.min_version, MIN_VERSION):
            raise RemoteProtocolError(
                f"peer speaks protocol versions {hello.min_version}-{hello.max_version}, "
                f"this side speaks {MIN_VERSION}-{MAX_VERSION}",
                ErrorCode.UNSUPPORTED_VERSION)
        self.version = version
        self.remote_hello = hello
        self.remote_settings = hello.settings
        self._conn_send_window = hello.settings.connection_window
        if self.role is Role.DIALER:
            self.state = ConnectionState.OPEN
            events.append(HandshakeCompleted(hello, version))
        else:
            events.append(HelloReceived(hello))

    def _check_stream_id(self, stream_id: int) -> None:
        if stream_id == 0:
            raise RemoteProtocolError("stream frame on stream 0")

    def _idle_or_closed(self, stream_id: int) -> StreamState:
        """The state of an id without a live stream: CLOSED if it belonged to a stream
        that has ended (frames for it may still be in flight), IDLE if it never existed."""
        locally_initiated = (stream_id % 2 == 1) == (self.role is Role.DIALER)
        if locally_initiated:
            used = stream_id < self._next_local_id
        else:
            used = stream_id <= self._highest_remote_id
        return StreamState.CLOSED if used else StreamState.IDLE

    def _received(self, stream_id: int, event: StreamEvent,
                  ) -> tuple[StreamRecord | None, StreamState]:
        """Check a received frame against the stream table: the live stream (None once
        it is closed: the frame is then dropped) and the state the frame leads to."""
        self._check_stream_id(stream_id)
        stream = self._streams.get(stream_id)
        state = stream.state if stream is not None else self._idle_or_closed(stream_id)
        following = next_stream_state(state, event)
        if following is None:
            raise unexpected_frame(event, state, stream_id)
        return stream, following

    def _on_open(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        self._check_stream_id(stream_id)
        remote_parity = 0 if self.role is Role.DIALER else 1
        if stream_id % 2 != remote_parity:
            raise RemoteProtocolError(f"OPEN with stream id {stream_id} of the wrong parity")
        _, state = self._received(stream_id, StreamEvent.RECV_OPEN)
        if len(payload) > self.local_settings.max_open_size:
            raise RemoteProtocolError(
                f"OPEN of {len(payload)} bytes exceeds the limit "
                f"{self.local_settings.max_open_size}", ErrorCode.LIMIT_EXCEEDED)
        target, meta = decode_open(bytes(payload))
        self._highest_remote_id = stream_id
        # Refusing at once takes the stream OPEN_RECEIVED -> CLOSED without a record.
        if self.is_draining:
            self.stats.streams_refused_draining += 1
            self._emit(FrameType.REFUSE, 0, stream_id,
                       encode_reason(StreamReason.DRAINING, "connection is draining"))
            return
        if self._count_streams(local=False) >= self.local_settings.max_streams:
            self.stats.streams_refused_over_limit += 1
            self._emit(FrameType.REFUSE, 0, stream_id, encode_reason(
                StreamReason.OVERLOADED,
                f"too many streams (limit {self.local_settings.max_streams})"))
            return
        self._streams[stream_id] = StreamRecord(
            id=stream_id, local=False, state=state,
            send_window=self.remote_settings.initial_stream_window,
            recv_window=self.local_settings.initial_stream_window,
            datagram=target.protocol == "udp",
        )
        self.stats.streams_opened_remote += 1
        events.append(StreamOpened(stream_id, target, meta))

    def _on_accept(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        stream, state = self._received(stream_id, StreamEvent.RECV_ACCEPT)
        if stream is None:
            return  # we reset it while it was opening
        if len(payload):
            raise RemoteProtocolError("ACCEPT carries no payload")
        self._set_state(stream, state)
        events.append(StreamAccepted(stream_id))

    def _on_refuse(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        stream, state = self._received(stream_id, StreamEvent.RECV_REFUSE)
        if stream is None:
            return  # we reset it while it was opening
        reason, message = decode_reason(payload, "REFUSE")
        self._set_state(stream, state)
        events.append(StreamRefused(stream_id, reason, message))

    def _on_data(self, flags: int, stream_id: int, payload: memoryview,
                 events: list[Event]) -> None:
        # The hot path: _received() inlined, the table row looked up directly.
        size = len(payload)
        self._check_stream_id(stream_id)
        self._credit.received(size)
        fin = flags & FLAG_FIN
        stream = self._streams.get(stream_id)
        current = stream.state if stream is not None else self._idle_or_closed(stream_id)
        state = (_ON_RECV_FIN if fin else _ON_RECV_DATA).get(current)
        if state is None:
            raise unexpected_frame(StreamEvent.RECV_FIN if fin else StreamEvent.RECV_DATA,
                              current, stream_id)
        if stream is None:
            return  # reset by us while data was in flight: dropped, credit returned
        if size > stream.recv_window:
            raise RemoteProtocolError(
                f"DATA of {size} bytes exceeds stream {stream_id}'s window {stream.recv_window}",
                ErrorCode.FLOW_CONTROL_ERROR)
        stream.recv_window -= size
        if size:
            self._credit.unacked += size
            events.append(DataReceived(stream_id, payload if self._lend else bytes(payload)))
        if fin:
            events.append(StreamEnded(stream_id))
            if state is _CLOSED:
                self._forget(stream)
                return
        stream.state = state

    def _on_datagram(self, stream_id: int, payload: memoryview,
                     events: list[Event]) -> None:
        self._check_stream_id(stream_id)
        # Connection credit, as DATA; owed back at once (never `unacked`): the app
        # delivers the datagram now or drops it, so it holds no memory a peer could grow.
        self._credit.received(len(payload))
        stream, _ = self._received(stream_id, StreamEvent.RECV_DATAGRAM)
        if stream is None:
            return  # reset by us while it was in flight
        if not stream.datagram:
            raise RemoteProtocolError(f"DATAGRAM on stream {stream_id}, which is not a flow")
        self.stats.datagrams_received += 1
        events.append(DatagramReceived(stream_id, bytes(payload)))

    def _on_window(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        increment = decode_window(payload)
        if stream_id == 0:
            self._conn_send_window += increment
            if self._conn_send_window > MAX_WINDOW:
                raise RemoteProtocolError("connection window overflow",
                                          ErrorCode.FLOW_CONTROL_ERROR)
            if self._datagram_ready:
                self._flush_datagrams()
            events.append(WindowUpdated(0))
            return
        stream, _ = self._received(stream_id, StreamEvent.RECV_WINDOW)
        if stream is None:
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            raise RemoteProtocolError(f"stream {stream_id} window overflow",
                                      ErrorCode.FLOW_CONTROL_ERROR)
        events.append(WindowUpdated(stream_id))

    def _on_rst(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        reason, message = decode_reason(payload, "RST")
        stream, state = self._received(stream_id, StreamEvent.RECV_RST)
        if stream is None:
            return
        self._set_state(stream, state)
        events.append(StreamReset(stream_id, reason, message))

    def _on_ping(self, flags: int, stream_id: int, payload: memoryview,
                 events: list[Event]) -> None:
        if stream_id != 0:
            raise RemoteProtocolError("PING must be on stream 0")
        if len(payload) != PING_PAYLOAD_SIZE:
            raise RemoteProtocolError("PING payload must be 8 bytes")
        if flags & FLAG_ACK:
            events.append(PingAcked(bytes(payload)))
        else:
            self._emit(FrameType.PING, FLAG_ACK, 0, bytes(payload))

    def _on_goaway(self, flags: int, stream_id: int, payload: memoryview,
                   events: list[Event]) -> None:
        if stream_id != 0:
            raise RemoteProtocolError("GOAWAY must be on stream 0")
        last_id, error, message, retry_after = decode_goaway(payload, flags)
        if error is not ErrorCode.NO_ERROR:
            self._enter_closed()
            events.append(ConnectionTerminated(error, message, by_peer=True,
                                               retry_after=retry_after))
            return
        self._goaway_received = True
        events.append(GoAwayReceived(last_id, error, message))
        # Streams we opened that the peer will never process count as refused, so the
        # caller can retry them on another connection.
        for sid in sorted(self._streams):
            stream = self._streams[sid]
            if stream.local and sid > last_id:
                # Every state a stream we opened can be in has a RECV_GOAWAY entry.
                self._set_state(stream, STREAM_TRANSITIONS[stream.state][StreamEvent.RECV_GOAWAY])
                events.append(StreamRefused(sid, StreamReason.DRAINING,
                                            "peer is draining: " + message))

    def _maybe_return_connection_credit(self) -> None:
        """Return connection credit as flow.ReceiveCredit allows (see there)."""
        credit = self._credit
        if credit.owed and self.state is ConnectionState.OPEN and (
                returnable := credit.take_returnable()):
            self._emit(FrameType.WINDOW, 0, 0, encode_window(returnable))
