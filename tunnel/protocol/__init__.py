"""The tunnel protocol core, sans-IO: bytes in, events out; method calls in, bytes out.

In the style of h11 and h2 there is no socket, no trio and no clock in here. The trio
endpoints (tunnel/endpoint.py) feed received bytes to `Connection.receive_data()`, act on
the events it returns, call methods such as `open_stream()` or `send_data()`, and write
whatever `data_to_send()` returns to the transport. Every decision about framing, stream
states, flow control and limits is made here, so it is all tested without sockets.

The package is split by concern; this module re-exports the public API, so callers write
`from tunnel import protocol as p` and `p.Connection`:

- errors.py: the exception tree and the reason codes carried in frames
- wire.py: the frame format, the values frames carry, and each payload's codec
- events.py: the events `receive_data()` returns
- state.py: the stream life cycle as one declarative transition table
- reassembly.py: completing a frame split across reads, without copying the stream
- flow.py: the connection's receive credit and the budget that bounds unread data
- connection.py: `Connection`, the state machine: what our side does, what the peer's
  bytes do
"""

from tunnel.protocol.connection import Connection, ConnectionStats
from tunnel.protocol.errors import (
    ConnectionClosedError,
    ConnectionDraining,
    DatagramsUnsupported,
    ErrorCode,
    FlowControlBlocked,
    LocalProtocolError,
    ProtocolError,
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
from tunnel.protocol.state import (
    STREAM_TRANSITIONS,
    ConnectionState,
    StreamEvent,
    StreamState,
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
    IDENTITY_HELD_SERVERS,
    IDENTITY_REPLICAS,
    IDENTITY_SERVER,
    MAGIC,
    MAX_DATAGRAM,
    MAX_HELD_SERVERS,
    MAX_HOST_LENGTH,
    MAX_MESSAGE_BYTES,
    MAX_REPLICAS,
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
    held_servers,
    server_replicas,
    with_held_servers,
)

__all__ = [
    "FEATURE_DATAGRAM",
    "FEATURE_RETRY_AFTER",
    "FLAG_ACK",
    "FLAG_FIN",
    "FLAG_RETRY_AFTER",
    "HANDSHAKE_FRAME_LIMIT",
    "HEADER",
    "HEADER_SIZE",
    "IDENTITY_HELD_SERVERS",
    "IDENTITY_REPLICAS",
    "IDENTITY_SERVER",
    "MAGIC",
    "MAX_DATAGRAM",
    "MAX_HELD_SERVERS",
    "MAX_HOST_LENGTH",
    "MAX_MESSAGE_BYTES",
    "MAX_REPLICAS",
    "MAX_RETRY_AFTER",
    "MAX_VERSION",
    "MAX_WINDOW",
    "MIN_VERSION",
    "PING_PAYLOAD_SIZE",
    "STREAM_TRANSITIONS",
    "Connection",
    "ConnectionClosedError",
    "ConnectionDraining",
    "ConnectionState",
    "ConnectionStats",
    "ConnectionTerminated",
    "DataReceived",
    "DatagramReceived",
    "DatagramsUnsupported",
    "ErrorCode",
    "Event",
    "FlowControlBlocked",
    "FrameType",
    "GoAwayReceived",
    "HandshakeCompleted",
    "Hello",
    "HelloReceived",
    "LocalProtocolError",
    "PingAcked",
    "ProtocolError",
    "RemoteProtocolError",
    "Role",
    "Settings",
    "StreamAccepted",
    "StreamClosedError",
    "StreamEnded",
    "StreamEvent",
    "StreamLimitReached",
    "StreamOpened",
    "StreamReason",
    "StreamRefused",
    "StreamReset",
    "StreamState",
    "Target",
    "WindowUpdated",
    "held_servers",
    "server_replicas",
    "with_held_servers",
]
