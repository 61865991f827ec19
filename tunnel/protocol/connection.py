"""`Connection`: one side of one tunnel connection, sans-IO.

The trio endpoints (tunnel/endpoint.py) feed received bytes to `receive_data()`, act on
the events it returns, call methods such as `open_stream()` or `send_data()`, and write
whatever `data_to_send()` returns to the transport. No socket, no trio, no clock.

This module owns the local actions: the handshake from our side, opening, answering,
sending on, half-closing and resetting streams, returning credit for data the app has
read, PING, GOAWAY and close. Every stream action is checked against the stream table
in state.py. The shared state and the receive path are in receiving.py.
"""

from __future__ import annotations

from tunnel.protocol.errors import (
    ConnectionClosedError,
    ConnectionDraining,
    ErrorCode,
    FlowControlBlocked,
    LocalProtocolError,
    StreamClosedError,
    StreamLimitReached,
    StreamReason,
)
from tunnel.protocol.receiving import ReceivingConnection
from tunnel.protocol.state import (
    STREAM_TRANSITIONS,
    TRANSITIONS_BY_EVENT,
    ConnectionState,
    StreamEvent,
    StreamRecord,
    StreamState,
    next_stream_state,
)
from tunnel.protocol.wire import (
    FEATURE_RETRY_AFTER,
    FLAG_FIN,
    FLAG_RETRY_AFTER,
    HANDSHAKE_FRAME_LIMIT,
    MAX_RETRY_AFTER,
    PING_PAYLOAD_SIZE,
    FrameType,
    Hello,
    Role,
    Target,
    encode_goaway,
    encode_open,
    encode_reason,
    encode_window,
)

# The hot path's columns of the stream table (see state.py), looked up once per frame.
_ON_SEND_DATA = TRANSITIONS_BY_EVENT[StreamEvent.SEND_DATA]
_ON_SEND_FIN = TRANSITIONS_BY_EVENT[StreamEvent.SEND_FIN]
_ON_SEND_WINDOW = TRANSITIONS_BY_EVENT[StreamEvent.SEND_WINDOW]
_CLOSED = StreamState.CLOSED


class Connection(ReceivingConnection):
    """One side of one tunnel connection. Streams can be opened by either side: odd ids
    by the dialing side, even ids by the accepting side, always increasing."""

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
        if hello.settings != self.local_settings:
            hello = Hello(settings=self.local_settings, identity=hello.identity,
                          features=hello.features, min_version=hello.min_version,
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
            recv_window=self.local_settings.initial_stream_window,
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
            del self._streams[stream_id]
        else:
            stream.state = state

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
        if size > self._unacked_total:
            raise LocalProtocolError("acknowledged more than was received")
        self._unacked_total -= size
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

