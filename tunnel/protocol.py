"""The tunnel protocol core, sans-IO: bytes in, events out; method calls in, bytes out.

In the style of h11 and h2 there is no socket, no trio and no clock in here. The trio
endpoints (tunnel/endpoint.py) feed received bytes to `Connection.receive_data()`, act on
the events it returns, call methods such as `open_stream()` or `send_data()`, and write
whatever `data_to_send()` returns to the transport. Every decision about framing, stream
states, flow control and limits is made here, so it is all tested without sockets.

Wire format: every frame is a 9-byte header followed by its payload::

    +-----------------------+--------+--------+--------------------------------+
    | payload length (24)   | type(8)| flags(8)| stream id (32)                 |
    +-----------------------+--------+--------+--------------------------------+

Frames: HELLO (handshake, stream 0), OPEN / ACCEPT / REFUSE (stream set-up), DATA (with
the FIN flag for half-close), WINDOW (credit; stream 0 is the connection), RST (abort one
stream), PING (with ACK), GOAWAY (drain or terminate the connection).

Streams can be opened by either side: odd ids by the dialing side, even ids by the
accepting side, always increasing. Flow control is per stream (credit the peer may send
on that stream) plus a connection window; the receiver returns connection credit as soon
as data is buffered, until the unread data of the whole connection passes a budget. So one
stream whose reader stalls holds at most its own window and never stalls its siblings,
while the memory a peer can make us hold stays bounded by the budget plus the connection
window.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any

# The protocol versions this implementation speaks; the handshake picks the highest
# version both sides support.
MIN_VERSION = 1
MAX_VERSION = 1

MAGIC = b"nodeagent"
HEADER = struct.Struct("!IBI")  # (length << 8 | type), flags, stream id
HEADER_SIZE = HEADER.size  # 9
MAX_WINDOW = 2**31 - 1
# Before the peer's HELLO tells us its limits, frames must fit this.
HANDSHAKE_FRAME_LIMIT = 16 * 1024
MAX_MESSAGE_BYTES = 1024  # REFUSE / RST / GOAWAY human-readable messages
MAX_HOST_LENGTH = 253
PING_PAYLOAD_SIZE = 8


class FrameType(enum.IntEnum):
    HELLO = 0
    OPEN = 1
    ACCEPT = 2
    REFUSE = 3
    DATA = 4
    WINDOW = 5
    RST = 6
    PING = 7
    GOAWAY = 8


FLAG_FIN = 0x1  # DATA: the sender will send no more on this stream
FLAG_ACK = 0x1  # PING: this is the answer


class StreamReason(enum.IntEnum):
    """Why a stream was refused or reset. Carried on the wire; never renumber."""

    REFUSED = 1  # the target actively refused (connection refused)
    UNREACHABLE = 2  # no route to the target, node not connected, DNS failure
    TIMEOUT = 3  # dialing the target timed out
    FORBIDDEN = 4  # policy does not allow this target
    OVERLOADED = 5  # too many streams or opens too fast; retry later
    CANCELLED = 6  # the opener gave up, or the local side closed early
    PROTOCOL_ERROR = 7
    INTERNAL = 8
    DRAINING = 9  # the connection is going away; retry on another connection

    @classmethod
    def from_wire(cls, value: int) -> StreamReason:
        try:
            return cls(value)
        except ValueError:
            # A newer peer may know reasons we do not; treat them as a generic failure
            # instead of killing the connection over a label.
            return cls.INTERNAL


class ErrorCode(enum.IntEnum):
    """Why a connection ends. Carried in GOAWAY; never renumber."""

    NO_ERROR = 0  # graceful: drain and close
    PROTOCOL_ERROR = 1
    FLOW_CONTROL_ERROR = 2
    FRAME_SIZE_ERROR = 3
    UNAUTHORIZED = 4
    UNSUPPORTED_VERSION = 5
    REPLACED = 6  # another connection registered the same node
    SHUTTING_DOWN = 7
    INTERNAL_ERROR = 8
    KEEPALIVE_TIMEOUT = 9
    LIMIT_EXCEEDED = 10

    @classmethod
    def from_wire(cls, value: int) -> ErrorCode:
        try:
            return cls(value)
        except ValueError:
            return cls.INTERNAL_ERROR


class Role(enum.Enum):
    DIALER = "dialer"  # the agent: opens the transport, sends HELLO first, odd stream ids
    ACCEPTOR = "acceptor"  # the server: even stream ids


# ---------------------------------------------------------------------------- errors


class ProtocolError(Exception):
    """Base of all protocol errors."""


class LocalProtocolError(ProtocolError):
    """Our own code asked for something the protocol does not allow right now."""


class StreamClosedError(LocalProtocolError):
    """The stream is gone (reset, refused or finished); typically a race with the peer."""

    def __init__(self, stream_id: int) -> None:
        super().__init__(f"stream {stream_id} is closed")
        self.stream_id = stream_id


class FlowControlBlocked(LocalProtocolError):
    """More data than the peer's window allows; wait for a WindowUpdated event."""


class StreamLimitReached(LocalProtocolError):
    """The peer's max_streams is reached; open again when a stream has ended."""


class ConnectionDraining(LocalProtocolError):
    """A GOAWAY was sent or received: no new streams on this connection."""


class ConnectionClosedError(LocalProtocolError):
    """The connection has terminated."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; the connection is terminated with `code`."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------ data types


@dataclass(frozen=True, slots=True)
class Settings:
    """Limits one side announces about itself in its HELLO; the peer must respect them."""

    max_frame_size: int = 64 * 1024  # largest payload we accept
    initial_stream_window: int = 1024 * 1024  # credit the peer gets on each new stream
    connection_window: int = 8 * 1024 * 1024  # credit the peer gets for the connection
    max_streams: int = 10_000  # streams the peer may have open towards us at once
    max_open_size: int = 8 * 1024  # largest OPEN payload (target + metadata) we accept

    def validate(self) -> None:
        """Raise ValueError if any value is outside what the protocol allows."""
        if not 16 * 1024 <= self.max_frame_size <= 16 * 1024 * 1024 - 1:
            raise ValueError(f"max_frame_size {self.max_frame_size} not in [16 KiB, 16 MiB)")
        if not 1 <= self.initial_stream_window <= MAX_WINDOW:
            raise ValueError(f"initial_stream_window {self.initial_stream_window} out of range")
        if not 1 <= self.connection_window <= MAX_WINDOW:
            raise ValueError(f"connection_window {self.connection_window} out of range")
        if not 1 <= self.max_streams <= 2**24:
            raise ValueError(f"max_streams {self.max_streams} out of range")
        if not 512 <= self.max_open_size <= HANDSHAKE_FRAME_LIMIT:
            raise ValueError(f"max_open_size {self.max_open_size} not in [512, 16 KiB]")

    def to_json(self) -> dict[str, int]:
        return {
            "max_frame_size": self.max_frame_size,
            "initial_stream_window": self.initial_stream_window,
            "connection_window": self.connection_window,
            "max_streams": self.max_streams,
            "max_open_size": self.max_open_size,
        }

    @classmethod
    def from_json(cls, doc: Any) -> Settings:
        if not isinstance(doc, dict):
            raise ValueError("settings must be an object")
        values: dict[str, int] = {}
        for name in cls().to_json():
            if name in doc:
                value = doc[name]
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"setting {name} must be an integer")
                values[name] = value
        settings = cls(**values)
        settings.validate()
        return settings


@dataclass(frozen=True, slots=True)
class Hello:
    """The handshake: versions spoken, limits, who we are, optional features."""

    settings: Settings = field(default_factory=Settings)
    # Who is speaking: e.g. {"node": "edge-1", "token": "...", "agent_version": "0.1.0"}.
    # The acceptor decides whether to believe it (token, or the mTLS certificate).
    identity: dict[str, str] = field(default_factory=dict)
    features: tuple[str, ...] = ()
    min_version: int = MIN_VERSION
    max_version: int = MAX_VERSION

    def encode(self) -> bytes:
        body = json.dumps(
            {"settings": self.settings.to_json(), "identity": self.identity,
             "features": list(self.features)},
            separators=(",", ":"),
        ).encode()
        return MAGIC + struct.pack("!HH", self.min_version, self.max_version) + body

    @classmethod
    def decode(cls, payload: bytes) -> Hello:
        """Parse a HELLO payload; raises RemoteProtocolError with the right code."""
        if not payload.startswith(MAGIC) or len(payload) < len(MAGIC) + 4:
            raise RemoteProtocolError("peer does not speak the nodeagent tunnel protocol")
        min_v, max_v = struct.unpack_from("!HH", payload, len(MAGIC))
        try:
            doc = json.loads(payload[len(MAGIC) + 4:])
        except (ValueError, UnicodeDecodeError) as exc:
            raise RemoteProtocolError(f"HELLO body is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise RemoteProtocolError("HELLO body must be a JSON object")
        try:
            settings = Settings.from_json(doc.get("settings", {}))
        except ValueError as exc:
            raise RemoteProtocolError(f"HELLO settings invalid: {exc}") from None
        identity = doc.get("identity", {})
        if not isinstance(identity, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in identity.items()
        ):
            raise RemoteProtocolError("HELLO identity must map strings to strings")
        features = doc.get("features", [])
        if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
            raise RemoteProtocolError("HELLO features must be a list of strings")
        return cls(settings=settings, identity=identity, features=tuple(features),
                   min_version=min_v, max_version=max_v)


@dataclass(frozen=True, slots=True)
class Target:
    """What a stream connects to on the far side."""

    host: str
    port: int
    protocol: str = "tcp"  # "tcp" | "udp"

    def validate(self) -> None:
        if self.protocol not in ("tcp", "udp"):
            raise ValueError(f"protocol must be tcp or udp, not {self.protocol!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range 1-65535")
        if not self.host or len(self.host) > MAX_HOST_LENGTH:
            raise ValueError("host must be 1-253 characters")
        if any(c.isspace() or not c.isprintable() for c in self.host):
            raise ValueError("host contains whitespace or control characters")

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.protocol}://{host}:{self.port}"


def _encode_open(target: Target, metadata: dict[str, str]) -> bytes:
    return json.dumps(
        {"proto": target.protocol, "host": target.host, "port": target.port, "meta": metadata},
        separators=(",", ":"),
    ).encode()


def _decode_open(payload: bytes) -> tuple[Target, dict[str, str]]:
    try:
        doc = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RemoteProtocolError(f"OPEN payload is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise RemoteProtocolError("OPEN payload must be a JSON object")
    host, port, proto = doc.get("host"), doc.get("port"), doc.get("proto", "tcp")
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) \
            or not isinstance(proto, str):
        raise RemoteProtocolError("OPEN needs string host, integer port, string proto")
    target = Target(host=host, port=port, protocol=proto)
    try:
        target.validate()
    except ValueError as exc:
        raise RemoteProtocolError(f"OPEN target invalid: {exc}") from None
    meta = doc.get("meta", {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise RemoteProtocolError("OPEN meta must map strings to strings")
    return target, meta


def _encode_reason(reason: int, message: str) -> bytes:
    return bytes([reason]) + message.encode()[:MAX_MESSAGE_BYTES]


def _decode_text(payload: bytes) -> str:
    return payload[:MAX_MESSAGE_BYTES].decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------- events


class Event:
    """Base class of everything `receive_data()` returns."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class HelloReceived(Event):
    """Acceptor only: the dialer introduced itself. Answer with `accept_handshake()` or
    `close(ErrorCode.UNAUTHORIZED, ...)`."""

    hello: Hello


@dataclass(frozen=True, slots=True)
class HandshakeCompleted(Event):
    """Dialer only: the acceptor answered; streams may be opened now."""

    hello: Hello
    version: int


@dataclass(frozen=True, slots=True)
class StreamOpened(Event):
    """The peer wants a stream to `target`. Answer with `accept_stream()` or
    `refuse_stream()`."""

    stream_id: int
    target: Target
    metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class StreamAccepted(Event):
    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamRefused(Event):
    stream_id: int
    reason: StreamReason
    message: str


@dataclass(frozen=True, slots=True)
class DataReceived(Event):
    """Payload for a stream. Call `acknowledge_received_data()` once it is consumed."""

    stream_id: int
    data: bytes


@dataclass(frozen=True, slots=True)
class StreamEnded(Event):
    """The peer half-closed the stream (FIN): it will send no more data."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamReset(Event):
    stream_id: int
    reason: StreamReason
    message: str


@dataclass(frozen=True, slots=True)
class WindowUpdated(Event):
    """More send credit on stream_id (0: the whole connection)."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class PingAcked(Event):
    payload: bytes


@dataclass(frozen=True, slots=True)
class GoAwayReceived(Event):
    """The peer is draining: streams above last_stream_id that we opened were refused;
    open no more streams on this connection."""

    last_stream_id: int
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class ConnectionTerminated(Event):
    """The connection is over. by_peer: the peer ended it (or vanished); otherwise we
    ended it because the peer broke the protocol (a GOAWAY with `code` was queued)."""

    code: ErrorCode
    message: str
    by_peer: bool


# ----------------------------------------------------------------------- connection


class _State(enum.Enum):
    HANDSHAKE = "handshake"
    OPEN = "open"
    CLOSED = "closed"


class _StreamState(enum.Enum):
    OPENING = "opening"  # OPEN sent or received, no answer yet
    OPEN = "open"


@dataclass(slots=True)
class _Stream:
    id: int
    local: bool  # opened by this side
    state: _StreamState
    send_window: int
    recv_window: int
    local_fin: bool = False
    remote_fin: bool = False
    pending_credit: int = 0  # consumed bytes not yet returned to the peer as WINDOW


class _StreamTable(dict[int, _Stream]):
    """The live streams by id, keeping count of the locally opened ones so that the
    stream limits are checked in O(1) however many streams are open."""

    __slots__ = ("local",)

    def __init__(self) -> None:
        super().__init__()
        self.local = 0

    def __setitem__(self, key: int, stream: _Stream) -> None:
        old = super().get(key)
        if old is not None and old.local:
            self.local -= 1
        super().__setitem__(key, stream)
        if stream.local:
            self.local += 1

    def __delitem__(self, key: int) -> None:
        if super().__getitem__(key).local:
            self.local -= 1
        super().__delitem__(key)

    def pop(self, key: int, default: Any = None) -> Any:
        stream = super().pop(key, default)
        if isinstance(stream, _Stream) and stream.local:
            self.local -= 1
        return stream

    def clear(self) -> None:
        super().clear()
        self.local = 0


@dataclass(slots=True)
class ConnectionStats:
    """Counters for metrics; the endpoint exports them."""

    frames_received: int = 0
    frames_sent: int = 0
    streams_opened_local: int = 0
    streams_opened_remote: int = 0
    streams_refused_over_limit: int = 0
    streams_refused_draining: int = 0


class Connection:
    """One side of one tunnel connection."""

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
        self.state = _State.HANDSHAKE
        self.version: int | None = None
        self.remote_hello: Hello | None = None
        self.stats = ConnectionStats()

        self._streams = _StreamTable()
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
        self._terminated_event: ConnectionTerminated | None = None

    # ---------------------------------------------------------------- introspection

    @property
    def is_open(self) -> bool:
        return self.state is _State.OPEN

    @property
    def is_closed(self) -> bool:
        return self.state is _State.CLOSED

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

    def send_window(self, stream_id: int) -> int:
        """How many bytes send_data() accepts for this stream right now."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.state is not _StreamState.OPEN or stream.local_fin:
            return 0
        return min(stream.send_window, self._conn_send_window)

    def can_open_stream(self) -> bool:
        return (
            self.state is _State.OPEN
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
        if self.state is _State.CLOSED:
            raise ConnectionClosedError("connection closed")
        self._send_hello(hello)
        self.state = _State.OPEN

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
        payload = _encode_open(target, metadata or {})
        if len(payload) > self.remote_settings.max_open_size:
            raise LocalProtocolError(
                f"OPEN of {len(payload)} bytes exceeds the peer's limit "
                f"{self.remote_settings.max_open_size}")
        stream_id = self._next_local_id
        self._next_local_id += 2
        self._streams[stream_id] = _Stream(
            id=stream_id, local=True, state=_StreamState.OPENING,
            send_window=self.remote_settings.initial_stream_window,
            recv_window=self.local_settings.initial_stream_window,
        )
        self.stats.streams_opened_local += 1
        self._emit(FrameType.OPEN, 0, stream_id, payload)
        return stream_id

    def accept_stream(self, stream_id: int) -> None:
        stream = self._remote_opening(stream_id)
        stream.state = _StreamState.OPEN
        self._emit(FrameType.ACCEPT, 0, stream_id)

    def refuse_stream(self, stream_id: int, reason: StreamReason, message: str = "") -> None:
        self._remote_opening(stream_id)
        del self._streams[stream_id]
        self._emit(FrameType.REFUSE, 0, stream_id, _encode_reason(reason, message))

    def _remote_opening(self, stream_id: int) -> _Stream:
        self._require_open()
        stream = self._streams.get(stream_id)
        if stream is None:
            raise StreamClosedError(stream_id)
        if stream.local or stream.state is not _StreamState.OPENING:
            raise LocalProtocolError(f"stream {stream_id} is not awaiting an answer")
        return stream

    def send_data(self, stream_id: int, data: bytes | bytearray | memoryview,
                  end_stream: bool = False) -> None:
        """Queue data (split into frames as needed). len(data) must be within
        send_window(stream_id); wait for WindowUpdated otherwise."""
        self._require_open()
        stream = self._streams.get(stream_id)
        if stream is None:
            raise StreamClosedError(stream_id)
        if stream.state is not _StreamState.OPEN:
            raise LocalProtocolError(f"stream {stream_id} is not accepted yet")
        if stream.local_fin:
            raise LocalProtocolError(f"stream {stream_id} already sent FIN")
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
        if end_stream:
            self._local_fin(stream)

    def end_stream(self, stream_id: int) -> None:
        """Half-close: we send no more data on this stream (FIN)."""
        self.send_data(stream_id, b"", end_stream=True)

    def reset_stream(self, stream_id: int, reason: StreamReason = StreamReason.CANCELLED,
                     message: str = "") -> None:
        """Abort a stream in both directions. A no-op for a stream already gone."""
        if self.state is _State.CLOSED:
            return
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        self._emit(FrameType.RST, 0, stream_id, _encode_reason(reason, message))

    def acknowledge_received_data(self, stream_id: int, size: int) -> None:
        """The app consumed `size` bytes of this stream: return credit to the peer."""
        if size <= 0:
            return
        if size > self._unacked_total:
            raise LocalProtocolError("acknowledged more than was received")
        self._unacked_total -= size
        stream = self._streams.get(stream_id)
        if stream is not None and not stream.remote_fin:
            stream.pending_credit += size
            if stream.pending_credit >= self.local_settings.initial_stream_window // 2:
                self._emit(FrameType.WINDOW, 0, stream_id,
                           struct.pack("!I", stream.pending_credit))
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
        if self.state is _State.CLOSED or self._goaway_sent:
            return
        self._goaway_sent = True
        self._goaway_last_id = self._highest_remote_id
        self._emit(FrameType.GOAWAY, 0, 0,
                   struct.pack("!IB", self._goaway_last_id, code) + message.encode()[:1024])

    def close(self, code: ErrorCode = ErrorCode.NO_ERROR, message: str = "") -> None:
        """End the connection now: GOAWAY with `code`, every stream is gone."""
        if self.state is _State.CLOSED:
            return
        # A terminating GOAWAY uses a non-zero code even for a plain close so that the
        # peer does not mistake it for a drain.
        wire_code = ErrorCode.SHUTTING_DOWN if code is ErrorCode.NO_ERROR else code
        self._emit(FrameType.GOAWAY, 0, 0,
                   struct.pack("!IB", self._highest_remote_id, wire_code)
                   + message.encode()[:1024])
        self._goaway_sent = True
        self._enter_closed()

    def _enter_closed(self) -> None:
        self.state = _State.CLOSED
        self._streams.clear()
        self._inbuf = bytearray()

    def _require_open(self) -> None:
        if self.state is _State.CLOSED:
            raise ConnectionClosedError("connection closed")
        if self.state is not _State.OPEN:
            raise LocalProtocolError("handshake not complete")

    def _count_streams(self, *, local: bool) -> int:
        local_count = self._streams.local
        return local_count if local else len(self._streams) - local_count

    def _local_fin(self, stream: _Stream) -> None:
        stream.local_fin = True
        if stream.remote_fin:
            del self._streams[stream.id]

    # ---------------------------------------------------------------- input

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes from the transport; b"" means the transport reached EOF."""
        if self.state is _State.CLOSED:
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
                   struct.pack("!IB", self._highest_remote_id, exc.code)
                   + message.encode()[:1024])
        self._goaway_sent = True
        self._enter_closed()
        events.append(ConnectionTerminated(exc.code, message, by_peer=False))

    def _handle_frame(self, ftype: int, flags: int, stream_id: int, payload: memoryview,
                      events: list[Event]) -> None:
        if self.state is _State.HANDSHAKE:
            self._handle_handshake_frame(ftype, stream_id, payload, events)
            return
        if ftype == FrameType.DATA:
            self._on_data(flags, stream_id, payload, events)
        elif ftype == FrameType.WINDOW:
            self._on_window(stream_id, payload, events)
        elif ftype == FrameType.OPEN:
            self._on_open(stream_id, payload, events)
        elif ftype == FrameType.ACCEPT:
            self._on_answer(stream_id, None, payload, events)
        elif ftype == FrameType.REFUSE:
            self._on_answer(stream_id, FrameType.REFUSE, payload, events)
        elif ftype == FrameType.RST:
            self._on_rst(stream_id, payload, events)
        elif ftype == FrameType.PING:
            self._on_ping(flags, stream_id, payload, events)
        elif ftype == FrameType.GOAWAY:
            self._on_goaway(stream_id, payload, events)
        elif ftype == FrameType.HELLO:
            raise RemoteProtocolError("HELLO after the handshake")
        else:
            raise RemoteProtocolError(f"unknown frame type 0x{ftype:02x}")

    def _handle_handshake_frame(self, ftype: int, stream_id: int, payload: memoryview,
                                events: list[Event]) -> None:
        if ftype == FrameType.GOAWAY and self.role is Role.DIALER:
            # The acceptor refused us (bad token, version) before the handshake finished.
            self._on_goaway(stream_id, payload, events)
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
            self.state = _State.OPEN
            events.append(HandshakeCompleted(hello, version))
        else:
            events.append(HelloReceived(hello))

    def _check_stream_id(self, stream_id: int) -> None:
        if stream_id == 0:
            raise RemoteProtocolError("stream frame on stream 0")

    def _is_closed_id(self, stream_id: int) -> bool:
        """True for an id that belonged to a stream that has ended (frames for it may
        still be in flight and are ignored); False for one that never existed."""
        locally_initiated = (stream_id % 2 == 1) == (self.role is Role.DIALER)
        if locally_initiated:
            return stream_id < self._next_local_id
        return stream_id <= self._highest_remote_id

    def _lookup(self, stream_id: int, frame: str) -> _Stream | None:
        self._check_stream_id(stream_id)
        stream = self._streams.get(stream_id)
        if stream is None and not self._is_closed_id(stream_id):
            raise RemoteProtocolError(f"{frame} for stream {stream_id}, which was never opened")
        return stream

    def _on_open(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        self._check_stream_id(stream_id)
        remote_parity = 0 if self.role is Role.DIALER else 1
        if stream_id % 2 != remote_parity:
            raise RemoteProtocolError(f"OPEN with stream id {stream_id} of the wrong parity")
        if stream_id <= self._highest_remote_id:
            raise RemoteProtocolError(
                f"OPEN reuses stream id {stream_id} (ids must increase)")
        if len(payload) > self.local_settings.max_open_size:
            raise RemoteProtocolError(
                f"OPEN of {len(payload)} bytes exceeds the limit "
                f"{self.local_settings.max_open_size}", ErrorCode.LIMIT_EXCEEDED)
        target, meta = _decode_open(bytes(payload))
        self._highest_remote_id = stream_id
        if self.is_draining:
            self.stats.streams_refused_draining += 1
            self._emit(FrameType.REFUSE, 0, stream_id,
                       _encode_reason(StreamReason.DRAINING, "connection is draining"))
            return
        if self._count_streams(local=False) >= self.local_settings.max_streams:
            self.stats.streams_refused_over_limit += 1
            self._emit(FrameType.REFUSE, 0, stream_id, _encode_reason(
                StreamReason.OVERLOADED,
                f"too many streams (limit {self.local_settings.max_streams})"))
            return
        self._streams[stream_id] = _Stream(
            id=stream_id, local=False, state=_StreamState.OPENING,
            send_window=self.remote_settings.initial_stream_window,
            recv_window=self.local_settings.initial_stream_window,
        )
        self.stats.streams_opened_remote += 1
        events.append(StreamOpened(stream_id, target, meta))

    def _on_answer(self, stream_id: int, ftype: FrameType | None, payload: memoryview,
                   events: list[Event]) -> None:
        stream = self._lookup(stream_id, "ACCEPT/REFUSE")
        if stream is None:
            return  # we reset it while it was opening
        if not stream.local or stream.state is not _StreamState.OPENING:
            raise RemoteProtocolError(f"ACCEPT/REFUSE for stream {stream_id} not awaiting one")
        if ftype is FrameType.REFUSE:
            if len(payload) < 1:
                raise RemoteProtocolError("REFUSE without a reason")
            del self._streams[stream_id]
            events.append(StreamRefused(stream_id, StreamReason.from_wire(payload[0]),
                                        _decode_text(bytes(payload[1:]))))
        else:
            if len(payload):
                raise RemoteProtocolError("ACCEPT carries no payload")
            stream.state = _StreamState.OPEN
            events.append(StreamAccepted(stream_id))

    def _on_data(self, flags: int, stream_id: int, payload: memoryview,
                 events: list[Event]) -> None:
        size = len(payload)
        self._check_stream_id(stream_id)
        if size > self._conn_recv_window:
            raise RemoteProtocolError(
                f"DATA of {size} bytes exceeds the connection window {self._conn_recv_window}",
                ErrorCode.FLOW_CONTROL_ERROR)
        self._conn_recv_window -= size
        self._conn_credit_owed += size
        stream = self._lookup(stream_id, "DATA")
        if stream is None:
            return  # reset by us while data was in flight: dropped, credit returned
        if stream.state is not _StreamState.OPEN:
            raise RemoteProtocolError(f"DATA on stream {stream_id} before it was accepted")
        if stream.remote_fin:
            raise RemoteProtocolError(f"DATA on stream {stream_id} after FIN")
        if size > stream.recv_window:
            raise RemoteProtocolError(
                f"DATA of {size} bytes exceeds stream {stream_id}'s window {stream.recv_window}",
                ErrorCode.FLOW_CONTROL_ERROR)
        stream.recv_window -= size
        if size:
            self._unacked_total += size
            events.append(DataReceived(stream_id, bytes(payload)))
        if flags & FLAG_FIN:
            stream.remote_fin = True
            events.append(StreamEnded(stream_id))
            if stream.local_fin:
                del self._streams[stream_id]

    def _on_window(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        if len(payload) != 4:
            raise RemoteProtocolError("WINDOW payload must be 4 bytes")
        (increment,) = struct.unpack("!I", payload)
        if increment == 0:
            raise RemoteProtocolError("WINDOW increment of 0")
        if stream_id == 0:
            self._conn_send_window += increment
            if self._conn_send_window > MAX_WINDOW:
                raise RemoteProtocolError("connection window overflow",
                                          ErrorCode.FLOW_CONTROL_ERROR)
            events.append(WindowUpdated(0))
            return
        stream = self._lookup(stream_id, "WINDOW")
        if stream is None:
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            raise RemoteProtocolError(f"stream {stream_id} window overflow",
                                      ErrorCode.FLOW_CONTROL_ERROR)
        events.append(WindowUpdated(stream_id))

    def _on_rst(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        if len(payload) < 1:
            raise RemoteProtocolError("RST without a reason")
        stream = self._lookup(stream_id, "RST")
        if stream is None:
            return
        del self._streams[stream_id]
        events.append(StreamReset(stream_id, StreamReason.from_wire(payload[0]),
                                  _decode_text(bytes(payload[1:]))))

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

    def _on_goaway(self, stream_id: int, payload: memoryview, events: list[Event]) -> None:
        if stream_id != 0:
            raise RemoteProtocolError("GOAWAY must be on stream 0")
        if len(payload) < 5:
            raise RemoteProtocolError("GOAWAY payload too short")
        last_id, code = struct.unpack_from("!IB", payload)
        error = ErrorCode.from_wire(code)
        message = _decode_text(bytes(payload[5:]))
        if error is not ErrorCode.NO_ERROR:
            self._enter_closed()
            events.append(ConnectionTerminated(error, message, by_peer=True))
            return
        self._goaway_received = True
        events.append(GoAwayReceived(last_id, error, message))
        # Streams we opened that the peer will never process count as refused, so the
        # caller can retry them on another connection.
        for sid in sorted(self._streams):
            stream = self._streams[sid]
            if stream.local and sid > last_id:
                del self._streams[sid]
                events.append(StreamRefused(sid, StreamReason.DRAINING,
                                            "peer is draining: " + message))

    def _maybe_return_connection_credit(self) -> None:
        """Return connection credit for buffered data while unread data stays within the
        budget; beyond it, credit is returned only as the app reads."""
        if self.state is not _State.OPEN or self._conn_credit_owed == 0:
            return
        held = min(self._conn_credit_owed, max(0, self._unacked_total - self.receive_budget))
        returnable = self._conn_credit_owed - held
        if returnable >= self.local_settings.connection_window // 4 or (
            returnable > 0 and self._conn_recv_window < self.local_settings.connection_window // 2
        ):
            self._emit(FrameType.WINDOW, 0, 0, struct.pack("!I", returnable))
            self._conn_credit_owed -= returnable
            self._conn_recv_window += returnable
