"""The receiving half of a `Connection`, and the state both halves share.

`ReceivingConnection` owns the state of one side of one tunnel connection (settings,
windows, the live streams, the output queue) and everything the peer's bytes drive:
reassembling frames from the byte stream without copying it, the handshake, and the
effect of each received frame, checked against the stream table in state.py. Flow
control on receive lives here too: the receiver returns connection credit as soon as
data is buffered, until the unread data of the whole connection passes a budget, so one
stream whose reader stalls holds at most its own window and never stalls its siblings,
while the memory a peer can make us hold stays bounded by the budget plus the window.

`Connection` (connection.py) subclasses it with the local actions; nothing else should.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunnel.protocol.errors import (
    ConnectionClosedError,
    ErrorCode,
    LocalProtocolError,
    RemoteProtocolError,
    StreamReason,
)
from tunnel.protocol.events import (
    ConnectionTerminated,
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
from tunnel.protocol.state import (
    STREAM_TRANSITIONS,
    TRANSITIONS_BY_EVENT,
    ConnectionState,
    StreamEvent,
    StreamRecord,
    StreamState,
    StreamTable,
    next_stream_state,
)
from tunnel.protocol.wire import (
    FLAG_ACK,
    FLAG_FIN,
    HANDSHAKE_FRAME_LIMIT,
    HEADER,
    HEADER_SIZE,
    MAX_VERSION,
    MAX_WINDOW,
    MIN_VERSION,
    PING_PAYLOAD_SIZE,
    FrameType,
    Hello,
    Role,
    Settings,
    decode_goaway,
    decode_open,
    decode_reason,
    decode_window,
    encode_goaway,
    encode_reason,
    encode_window,
)

# The hot path's columns of the stream table (see state.py), looked up once per frame.
_ON_RECV_DATA = TRANSITIONS_BY_EVENT[StreamEvent.RECV_DATA]
_ON_RECV_FIN = TRANSITIONS_BY_EVENT[StreamEvent.RECV_FIN]
_ON_SEND_DATA = TRANSITIONS_BY_EVENT[StreamEvent.SEND_DATA]
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


class ReceivingConnection:
    """A connection's state, and everything the peer's bytes do to it. `Connection`
    adds what our side does; use that."""

    def __init__(
        self,
        role: Role,
        settings: Settings | None = None,
        *,
        receive_budget: int | None = None,
    ) -> None:
        self.role = role
        self.local_settings = settings or Settings()
        self.local_settings.validate()
        # Until the peer's HELLO arrives we assume the protocol's default limits.
        self.remote_settings = Settings()
        # Unread data (received, delivered, not yet acknowledged) we accept before we
        # stop returning connection credit: the bound on what a peer can make us buffer.
        self.receive_budget = (
            receive_budget if receive_budget is not None
            else 3 * self.local_settings.connection_window
        )
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
        self._conn_recv_window = self.local_settings.connection_window
        self._unacked_total = 0  # bytes delivered to the app, not yet acknowledged
        self._conn_credit_owed = 0  # bytes received, not yet returned as connection credit

        self._inbuf = bytearray()
        self._out: list[bytes | memoryview] = []
        self._out_size = 0

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
        return self._unacked_total

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
            del self._streams[stream.id]
        else:
            stream.state = state

    # ---------------------------------------------------------------- input

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes from the transport; b"" means the transport reached EOF."""
        if self.state is ConnectionState.CLOSED:
            return []
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
                pos = self._complete_pending(data)
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

    def _complete_pending(self, data: bytes) -> int:
        """Move bytes from `data` into the partial frame in `_inbuf` until that frame is
        complete. Returns how many bytes of `data` it took, or -1 when `data` ran out
        first (then all of it is in `_inbuf`)."""
        inbuf = self._inbuf
        size = len(data)
        pos = 0
        with memoryview(data) as view:
            if len(inbuf) < HEADER_SIZE:
                pos = min(HEADER_SIZE - len(inbuf), size)
                inbuf += view[:pos]
                if len(inbuf) < HEADER_SIZE:
                    return -1
            length = int.from_bytes(inbuf[:3], "big")
            limit = self._frame_limit()
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

    def _parse(self, buf: bytes | bytearray, offset: int, events: list[Event]) -> int:
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
            raise _unexpected(event, state, stream_id)
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
        if size > self._conn_recv_window:
            raise RemoteProtocolError(
                f"DATA of {size} bytes exceeds the connection window {self._conn_recv_window}",
                ErrorCode.FLOW_CONTROL_ERROR)
        self._conn_recv_window -= size
        self._conn_credit_owed += size
        fin = flags & FLAG_FIN
        stream = self._streams.get(stream_id)
        current = stream.state if stream is not None else self._idle_or_closed(stream_id)
        state = (_ON_RECV_FIN if fin else _ON_RECV_DATA).get(current)
        if state is None:
            raise _unexpected(StreamEvent.RECV_FIN if fin else StreamEvent.RECV_DATA,
                              current, stream_id)
        if stream is None:
            return  # reset by us while data was in flight: dropped, credit returned
        if size > stream.recv_window:
            raise RemoteProtocolError(
                f"DATA of {size} bytes exceeds stream {stream_id}'s window {stream.recv_window}",
                ErrorCode.FLOW_CONTROL_ERROR)
        stream.recv_window -= size
        if size:
            self._unacked_total += size
            events.append(DataReceived(stream_id, bytes(payload)))
        if fin:
            events.append(StreamEnded(stream_id))
            if state is _CLOSED:
                del self._streams[stream_id]
                return
        stream.state = state

    def _on_window(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        increment = decode_window(payload)
        if stream_id == 0:
            self._conn_send_window += increment
            if self._conn_send_window > MAX_WINDOW:
                raise RemoteProtocolError("connection window overflow",
                                          ErrorCode.FLOW_CONTROL_ERROR)
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
        """Return connection credit for buffered data while unread data stays within the
        budget; beyond it, credit is returned only as the app reads."""
        if self.state is not ConnectionState.OPEN or self._conn_credit_owed == 0:
            return
        held = min(self._conn_credit_owed, max(0, self._unacked_total - self.receive_budget))
        returnable = self._conn_credit_owed - held
        if returnable >= self.local_settings.connection_window // 4 or (
            returnable > 0 and self._conn_recv_window < self.local_settings.connection_window // 2
        ):
            self._emit(FrameType.WINDOW, 0, 0, encode_window(returnable))
            self._conn_credit_owed -= returnable
            self._conn_recv_window += returnable


_FRAME_NAMES = {
    StreamEvent.RECV_OPEN: "OPEN",
    StreamEvent.RECV_ACCEPT: "ACCEPT/REFUSE",
    StreamEvent.RECV_REFUSE: "ACCEPT/REFUSE",
    StreamEvent.RECV_DATA: "DATA",
    StreamEvent.RECV_FIN: "DATA",
    StreamEvent.RECV_WINDOW: "WINDOW",
    StreamEvent.RECV_RST: "RST",
}


def _unexpected(event: StreamEvent, state: StreamState, stream_id: int) -> RemoteProtocolError:
    """The protocol error for a received frame the stream table does not allow."""
    frame = _FRAME_NAMES[event]
    if state is StreamState.IDLE:
        return RemoteProtocolError(f"{frame} for stream {stream_id}, which was never opened")
    if event is StreamEvent.RECV_OPEN:
        return RemoteProtocolError(f"OPEN reuses stream id {stream_id} (ids must increase)")
    if frame == "DATA":
        if state is StreamState.HALF_CLOSED_REMOTE:
            return RemoteProtocolError(f"DATA on stream {stream_id} after FIN")
        return RemoteProtocolError(f"DATA on stream {stream_id} before it was accepted")
    return RemoteProtocolError(f"{frame} for stream {stream_id} not awaiting one")
