"""What can go wrong, and the codes that say so on the wire.

Owns the exception tree of the protocol core (`ProtocolError` → `LocalProtocolError` for
our own misuse, `RemoteProtocolError` for a peer that broke the protocol, carrying the
GOAWAY code to answer with) and the two reason enums carried in frames: `StreamReason`
(REFUSE, RST) and `ErrorCode` (GOAWAY). Their numbers are wire format: never renumber.
"""

from __future__ import annotations

import enum


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
    # The acceptor admits no more handshakes right now; the GOAWAY may carry when to come
    # back (FLAG_RETRY_AFTER). An older peer reads it as INTERNAL_ERROR and backs off.
    OVERLOADED = 11
    # The dialer already holds a tunnel to this acceptor (a server replica it reached again
    # through a load balancer): refused before registration, so the held one stays. An
    # older peer reads it as INTERNAL_ERROR.
    ALREADY_CONNECTED = 12

    @classmethod
    def from_wire(cls, value: int) -> ErrorCode:
        try:
            return cls(value)
        except ValueError:
            return cls.INTERNAL_ERROR


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


class DatagramsUnsupported(LocalProtocolError):
    """The peer did not announce FEATURE_DATAGRAM: no flow (udp target) can be opened."""


class ConnectionDraining(LocalProtocolError):
    """A GOAWAY was sent or received: no new streams on this connection."""


class ConnectionClosedError(LocalProtocolError):
    """The connection has terminated."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; the connection is terminated with `code`."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code
