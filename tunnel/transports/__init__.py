"""How tunnel bytes travel between an agent and a server: the `Transport` interface and
its implementations, a TLS (or plain TCP) byte stream and WebSocket binary messages.

- `base`: the interface — `Transport`, its errors, `PeerInfo`, `Endpoint`.
- `tls`: `TLSStream` (TLS over a socket, built for bulk transfer) and error phrasing.
- `stream`: `StreamTransport` and the stream-owning base every transport shares; native
  exceptions (trio, OSError, ssl) are mapped there, once, into `TransportError`.
- `websocket`: the WebSocket codecs over sans-IO cores and `WebSocketTransport`.
- `handshake`: the WebSocket opening handshake, client and server.
  (Both WebSocket modules load on first use of their names: an agent or server on tls://
  never imports the WebSocket libraries.)

Dialing and accepting (endpoint URL → transport) are tunnel.dial and tunnel.accept.
"""

from typing import TYPE_CHECKING, Any

from tunnel.transports.base import (
    MAX_HANDSHAKE_SIZE,
    MAX_MESSAGE_SIZE,
    STREAM_RECEIVE_SIZE,
    WEBSOCKET_IMPLS,
    WEBSOCKET_RECEIVE_SIZE,
    DialError,
    Endpoint,
    PeerInfo,
    Transport,
    TransportClosed,
    TransportError,
    WebSocketHandshakeError,
    WebSocketImpl,
)
from tunnel.transports.streamtransport import CLOSE_TIMEOUT, StreamTransport, socket_of
from tunnel.transports.tls import TLS_RECORD_SIZE, TLSStream, describe_error, is_tls_error

if TYPE_CHECKING:
    from tunnel.transports.handshake import websocket_accept, websocket_connect
    from tunnel.transports.websocket import WebSocketTransport

# The WebSocket transport and handshake load the WebSocket libraries (~3 MiB): only for
# ws:// and wss:// endpoints, on first use of these names.
_LAZY = {"websocket_accept": "handshake", "websocket_connect": "handshake",
         "WebSocketTransport": "websocket"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


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
