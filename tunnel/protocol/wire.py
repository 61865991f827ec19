"""The wire format: frame header, frame types, and the codec of each frame's payload.

Every frame is a 9-byte header followed by its payload::

    +-----------------------+--------+--------+--------------------------------+
    | payload length (24)   | type(8)| flags(8)| stream id (32)                 |
    +-----------------------+--------+--------+--------------------------------+

Frames: HELLO (handshake, stream 0), OPEN / ACCEPT / REFUSE (stream set-up), DATA (with
the FIN flag for half-close), WINDOW (credit; stream 0 is the connection), RST (abort one
stream), PING (with ACK), GOAWAY (drain or terminate the connection; a handshake refusal
may carry a retry-after with FLAG_RETRY_AFTER, to dialers that announce the feature),
DATAGRAM (one whole UDP datagram on a flow: a stream whose OPEN names a udp target; only
between peers that both announce FEATURE_DATAGRAM; see docs/udp.md).

This module owns the bytes: constants and limits of the format, the values that travel in
frames (`Settings`, `Hello`, `Target`) and the encode/decode functions of each payload.
Decoders raise `RemoteProtocolError` with the code the connection answers with. What a
frame means in a given state is not decided here (see state.py and connection.py).
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tunnel.protocol.errors import ErrorCode, RemoteProtocolError, StreamReason

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

_GOAWAY_HEAD = struct.Struct("!IB")  # last stream id, error code
_RETRY_AFTER = struct.Struct("!I")  # milliseconds, with FLAG_RETRY_AFTER
_WINDOW = struct.Struct("!I")  # increment


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
    DATAGRAM = 9


FLAG_FIN = 0x1  # DATA: the sender will send no more on this stream
FLAG_ACK = 0x1  # PING: this is the answer
# GOAWAY: a retry-after (u32, milliseconds) follows the code, before the message. Only
# sent to a dialer whose HELLO announced FEATURE_RETRY_AFTER: an older peer ignores the
# flags of a GOAWAY and would read those four bytes as the start of the message.
FLAG_RETRY_AFTER = 0x2
FEATURE_RETRY_AFTER = "retry-after"
MAX_RETRY_AFTER = 3600.0  # seconds: longer is a mistake, not a policy

# Flows (UDP) in DATAGRAM frames. A peer that does not announce the feature would end the
# connection on the unknown frame type, so no flow is opened towards it.
FEATURE_DATAGRAM = "datagram"
# The largest UDP payload (IPv6 without jumbograms: 65,535 - 8; IPv4's is 65,507). It fits
# the default max_frame_size (64 KiB); a peer announcing less gets smaller ones only.
MAX_DATAGRAM = 65_527

# Several server replicas (identity keys; an older peer ignores keys it does not know).
# The acceptor's HELLO: who it is and how many replicas serve the same public address, so
# a dialer knows how many distinct servers to hold a tunnel to.
IDENTITY_SERVER = "server"
IDENTITY_REPLICAS = "replicas"
# The dialer's HELLO: the server ids it already holds a tunnel to (comma-separated); an
# acceptor named there refuses with ALREADY_CONNECTED instead of replacing that tunnel.
IDENTITY_HELD_SERVERS = "held_servers"
MAX_REPLICAS = 64
MAX_HELD_SERVERS = 64


def server_replicas(identity: dict[str, str]) -> int | None:
    """The replica count an acceptor announced; None when absent or not a number in
    1..MAX_REPLICAS (an older server, or a bad value: the dialer then holds one)."""
    raw = identity.get(IDENTITY_REPLICAS)
    if raw is None or not raw.isdigit():
        return None
    value = int(raw)
    return value if 1 <= value <= MAX_REPLICAS else None


def held_servers(identity: dict[str, str]) -> frozenset[str]:
    """The server ids a dialer said it holds (at most MAX_HELD_SERVERS; empty ids
    dropped)."""
    raw = identity.get(IDENTITY_HELD_SERVERS, "")
    return frozenset(s for s in raw.split(",")[:MAX_HELD_SERVERS] if s)


def with_held_servers(identity: dict[str, str], servers: Iterable[str]) -> dict[str, str]:
    """`identity` plus the held server ids (none: the key is left out)."""
    held = sorted({s for s in servers if s and "," not in s})[:MAX_HELD_SERVERS]
    out = {k: v for k, v in identity.items() if k != IDENTITY_HELD_SERVERS}
    if held:
        out[IDENTITY_HELD_SERVERS] = ",".join(held)
    return out


class Role(enum.Enum):
    DIALER = "dialer"  # the agent: opens the transport, sends HELLO first, odd stream ids
    ACCEPTOR = "acceptor"  # the server: even stream ids


@dataclass(frozen=True, slots=True)
class Settings:
    """Limits one side announces about itself in its HELLO; the peer must respect them."""

    max_frame_size: int = 64 * 1024  # largest payload we accept
    initial_stream_window: int = 2 * 1024 * 1024  # credit the peer gets on each new stream
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
        # Every whitespace character but the ASCII space is non-printable (Unicode's
        # Separator and Other categories), so this is "any whitespace or control
        # character" without a Python step per character (tests/tunnel/test_protocol.py).
        if not self.host.isprintable() or " " in self.host:
            raise ValueError("host contains whitespace or control characters")

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.protocol}://{host}:{self.port}"


# ------------------------------------------------------------------ payload codecs


def encode_open(target: Target, metadata: dict[str, str]) -> bytes:
    return json.dumps(
        {"proto": target.protocol, "host": target.host, "port": target.port, "meta": metadata},
        separators=(",", ":"),
    ).encode()


def decode_open(payload: bytes) -> tuple[Target, dict[str, str]]:
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


def encode_reason(reason: int, message: str) -> bytes:
    """REFUSE and RST payload: one reason byte, then a UTF-8 message."""
    return bytes([reason]) + message.encode()[:MAX_MESSAGE_BYTES]


def decode_reason(payload: memoryview, frame: str) -> tuple[StreamReason, str]:
    if len(payload) < 1:
        raise RemoteProtocolError(f"{frame} without a reason")
    return StreamReason.from_wire(payload[0]), decode_text(bytes(payload[1:]))


def decode_text(payload: bytes) -> str:
    return payload[:MAX_MESSAGE_BYTES].decode("utf-8", errors="replace")


def encode_window(increment: int) -> bytes:
    return _WINDOW.pack(increment)


def decode_window(payload: memoryview) -> int:
    if len(payload) != 4:
        raise RemoteProtocolError("WINDOW payload must be 4 bytes")
    (increment,) = _WINDOW.unpack(payload)
    if increment == 0:
        raise RemoteProtocolError("WINDOW increment of 0")
    return int(increment)


def encode_goaway(last_stream_id: int, code: int, message: str,
                  retry_after: float | None = None) -> bytes:
    """GOAWAY payload; with `retry_after` (seconds) the frame must carry FLAG_RETRY_AFTER."""
    head = _GOAWAY_HEAD.pack(last_stream_id, code)
    if retry_after is not None:
        head += _RETRY_AFTER.pack(round(retry_after * 1000))
    return head + message.encode()[:MAX_MESSAGE_BYTES]


def decode_goaway(payload: memoryview, flags: int = 0,
                  ) -> tuple[int, ErrorCode, str, float | None]:
    """(last stream id, code, message, retry-after in seconds or None)."""
    if len(payload) < _GOAWAY_HEAD.size:
        raise RemoteProtocolError("GOAWAY payload too short")
    last_id, code = _GOAWAY_HEAD.unpack_from(payload)
    offset = _GOAWAY_HEAD.size
    retry_after: float | None = None
    if flags & FLAG_RETRY_AFTER:
        if len(payload) < offset + _RETRY_AFTER.size:
            raise RemoteProtocolError("GOAWAY with FLAG_RETRY_AFTER but no retry-after")
        (millis,) = _RETRY_AFTER.unpack_from(payload, offset)
        offset += _RETRY_AFTER.size
        # Clamped, not refused: a peer's mistake must not make us wait an hour.
        retry_after = min(millis / 1000, MAX_RETRY_AFTER)
    return last_id, ErrorCode.from_wire(code), decode_text(bytes(payload[offset:])), retry_after
