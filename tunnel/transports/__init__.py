"""How tunnel bytes travel between an agent and a server: the `Transport` interface and
its implementations, a TLS (or plain TCP) byte stream and WebSocket binary messages.

- `base`: the interface — `Transport`, its errors, `PeerInfo`, `Endpoint`.
- `tls`: `TLSStream` (TLS over a socket, built for bulk transfer) and error phrasing.
- `stream`: `StreamTransport` and the stream-owning base every transport shares; native
  exceptions (trio, OSError, ssl) are mapped there, once, into `TransportError`.
- `websocket`: the WebSocket codecs over sans-IO cores and `WebSocketTransport`.
- `handshake`: the WebSocket opening handshake, client and server.

Dialing and listening (endpoint URL → transport) is tunnel.dial.
"""

from tunnel.transports.base import (
    STREAM_RECEIVE_SIZE,
    DialError,
    Endpoint,
    PeerInfo,
    Transport,
    TransportClosed,
    TransportError,
)
from tunnel.transports.handshake import (
    MAX_HANDSHAKE_SIZE,
    WebSocketHandshakeError,
    websocket_accept,
    websocket_connect,
)
from tunnel.transports.stream import CLOSE_TIMEOUT, StreamTransport, socket_of
from tunnel.transports.tls import TLS_RECORD_SIZE, TLSStream, describe_error, is_tls_error
from tunnel.transports.websocket import (
    MAX_MESSAGE_SIZE,
    WEBSOCKET_IMPLS,
    WEBSOCKET_RECEIVE_SIZE,
    WebSocketImpl,
    WebSocketTransport,
)

__all__ = [
    "CLOSE_TIMEOUT",
    "MAX_HANDSHAKE_SIZE",
    "MAX_MESSAGE_SIZE",
    "STREAM_RECEIVE_SIZE",
    "TLS_RECORD_SIZE",
    "WEBSOCKET_IMPLS",
    "WEBSOCKET_RECEIVE_SIZE",
    "DialError",
    "Endpoint",
    "PeerInfo",
    "StreamTransport",
    "TLSStream",
    "Transport",
    "TransportClosed",
    "TransportError",
    "WebSocketHandshakeError",
    "WebSocketImpl",
    "WebSocketTransport",
    "describe_error",
    "is_tls_error",
    "socket_of",
    "websocket_accept",
    "websocket_connect",
]
