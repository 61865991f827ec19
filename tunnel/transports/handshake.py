"""The WebSocket opening handshake (the HTTP upgrade) on an open stream, client and server.

Owns `websocket_connect`, `websocket_accept` and `WebSocketHandshakeError`. The caller
applies the timeout and closes the stream on failure.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Sequence

import trio
import websockets.client
import websockets.exceptions
import websockets.http11
import websockets.protocol
import websockets.server
import websockets.uri
import wsproto
import wsproto.events
import wsproto.utilities

from tunnel.transports.base import PeerInfo, TransportError
from tunnel.transports.tls import describe_error, is_tls_error
from tunnel.transports.websocket import (
    MAX_MESSAGE_SIZE,
    WebSocketCodec,
    WebSocketImpl,
    WebsocketsCodec,
    WebSocketTransport,
    WsprotoCodec,
)

__all__ = [
    "MAX_HANDSHAKE_SIZE",
    "WebSocketHandshakeError",
    "websocket_accept",
    "websocket_connect",
]

# Largest HTTP upgrade request/response we read before giving up on a handshake.
MAX_HANDSHAKE_SIZE = 64 * 1024


class WebSocketHandshakeError(TransportError):
    """The HTTP upgrade failed. `status` is the HTTP status the server answered (client
    side) or that we answered (server side), if any; `reason` a short word for logs."""

    def __init__(self, message: str, reason: str = "http", status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


async def _receive_handshake_bytes(stream: trio.abc.Stream, received: int) -> bytes:
    if received > MAX_HANDSHAKE_SIZE:
        raise WebSocketHandshakeError(
            f"HTTP upgrade larger than {MAX_HANDSHAKE_SIZE} bytes", reason="http")
    try:
        data = await stream.receive_some(16 * 1024)
    except (trio.BrokenResourceError, OSError, ssl.SSLError) as exc:
        reason = "tls" if is_tls_error(exc) else "closed"
        raise WebSocketHandshakeError(
            f"connection failed during the HTTP upgrade: {describe_error(exc)}",
            reason=reason) from exc
    return bytes(data)


async def _send_handshake_bytes(stream: trio.abc.Stream, chunks: Sequence[bytes]) -> None:
    data = b"".join(chunks)
    if not data:
        return
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, OSError, ssl.SSLError) as exc:
        reason = "tls" if is_tls_error(exc) else "closed"
        raise WebSocketHandshakeError(
            f"connection failed during the HTTP upgrade: {describe_error(exc)}",
            reason=reason) from exc


async def websocket_connect(
    stream: trio.abc.Stream, *, impl: WebSocketImpl, host: str, port: int, path: str,
    secure: bool, peer: PeerInfo, headers: Sequence[tuple[str, str]] = (),
    max_message_size: int = MAX_MESSAGE_SIZE,
) -> WebSocketTransport:
    """Client side of the upgrade on an open stream (the caller applies the timeout and
    closes the stream on failure). Raises WebSocketHandshakeError."""
    default_port = 443 if secure else 80
    host_header = f"[{host}]" if ":" in host else host
    if port != default_port:
        host_header = f"{host_header}:{port}"
    codec: WebSocketCodec
    if impl == "websockets":
        scheme = "wss" if secure else "ws"
        uri = websockets.uri.parse_uri(f"{scheme}://{host_header}{path}")
        proto = websockets.client.ClientProtocol(uri, max_size=max_message_size)
        request = proto.connect()
        for name, value in headers:
            request.headers[name] = value
        proto.send_request(request)
        await _send_handshake_bytes(stream, proto.data_to_send())
        received = 0
        while True:
            data = await _receive_handshake_bytes(stream, received)
            received += len(data)
            if data:
                proto.receive_data(data)
            else:
                proto.receive_eof()
            events = proto.events_received()
            response = next((e for e in events if isinstance(e, websockets.http11.Response)),
                            None)
            if response is not None or proto.handshake_exc is not None:
                break
            if not data:
                raise WebSocketHandshakeError(
                    "server closed the connection during the HTTP upgrade", reason="closed")
        if proto.handshake_exc is not None:
            exc = proto.handshake_exc
            if isinstance(exc, websockets.exceptions.InvalidStatus):
                status = exc.response.status_code
                raise WebSocketHandshakeError(
                    f"server answered HTTP {status} {exc.response.reason_phrase} "
                    f"to the WebSocket upgrade for {path}", status=status)
            raise WebSocketHandshakeError(f"invalid WebSocket upgrade response: {exc}")
        rest = events[events.index(response) + 1:] if response is not None else []
        codec = WebsocketsCodec(proto, rest)
    else:
        ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        extra = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]
        try:
            out = ws.send(wsproto.events.Request(host=host_header, target=path,
                                                 extra_headers=extra))
        except wsproto.utilities.LocalProtocolError as exc:
            raise WebSocketHandshakeError(f"cannot build the upgrade request: {exc}") from exc
        await _send_handshake_bytes(stream, [out])
        received = 0
        accepted = False
        while not accepted:
            data = await _receive_handshake_bytes(stream, received)
            received += len(data)
            try:
                ws.receive_data(data or None)
                for event in ws.events():
                    if isinstance(event, wsproto.events.AcceptConnection):
                        accepted = True
                        break
                    if isinstance(event, wsproto.events.RejectConnection):
                        raise WebSocketHandshakeError(
                            f"server answered HTTP {event.status_code} to the WebSocket "
                            f"upgrade for {path}", status=event.status_code)
            except wsproto.utilities.RemoteProtocolError as exc:
                raise WebSocketHandshakeError(
                    f"invalid WebSocket upgrade response: {exc}") from exc
            if not accepted and not data:
                raise WebSocketHandshakeError(
                    "server closed the connection during the HTTP upgrade", reason="closed")
        codec = WsprotoCodec(ws, max_message_size)
    transport = WebSocketTransport(stream, codec, peer, impl=impl,
                                   max_message_size=max_message_size)
    return transport


def _path_only(target: str) -> str:
    return target.split("?", 1)[0] or "/"


async def websocket_accept(
    stream: trio.abc.Stream, *, impl: WebSocketImpl, path: str, peer: PeerInfo,
    max_message_size: int = MAX_MESSAGE_SIZE,
) -> WebSocketTransport:
    """Server side of the upgrade: read the request, answer 404 unless its path is
    `path`, else 101. The returned transport's PeerInfo carries the request headers
    (lower-case names). Raises WebSocketHandshakeError (after answering, when an answer
    makes sense)."""
    want = _path_only(path)
    codec: WebSocketCodec
    received = 0
    if impl == "websockets":
        proto = websockets.server.ServerProtocol(max_size=max_message_size)
        request: websockets.http11.Request | None = None
        while request is None:
            data = await _receive_handshake_bytes(stream, received)
            received += len(data)
            if data:
                proto.receive_data(data)
            else:
                proto.receive_eof()
            events = proto.events_received()
            request = next((e for e in events if isinstance(e, websockets.http11.Request)),
                           None)
            if request is None and (proto.handshake_exc is not None or not data):
                await _send_handshake_bytes(stream, proto.data_to_send())
                if proto.handshake_exc is not None:
                    raise WebSocketHandshakeError(
                        f"invalid HTTP upgrade request: {proto.handshake_exc}")
                raise WebSocketHandshakeError(
                    "client closed the connection before finishing the upgrade request",
                    reason="closed")
        if _path_only(request.path) != want:
            response = proto.reject(404, f"No WebSocket endpoint at {_path_only(request.path)}\n")
            proto.send_response(response)
            await _send_handshake_bytes(stream, proto.data_to_send())
            raise WebSocketHandshakeError(
                f"upgrade request for unknown path {_path_only(request.path)}", status=404)
        response = proto.accept(request)
        proto.send_response(response)
        await _send_handshake_bytes(stream, proto.data_to_send())
        if response.status_code != 101:
            raise WebSocketHandshakeError(
                f"invalid WebSocket upgrade request: {proto.handshake_exc}",
                status=response.status_code)
        header_items = tuple((k.lower(), v) for k, v in request.headers.raw_items())
        rest = events[events.index(request) + 1:]
        codec = WebsocketsCodec(proto, rest)
    else:
        ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
        ws_request: wsproto.events.Request | None = None
        while ws_request is None:
            data = await _receive_handshake_bytes(stream, received)
            received += len(data)
            try:
                ws.receive_data(data or None)
                for event in ws.events():
                    if isinstance(event, wsproto.events.Request):
                        ws_request = event
                        break
            except wsproto.utilities.RemoteProtocolError as exc:
                hint = exc.event_hint
                if isinstance(hint, wsproto.events.RejectConnection):
                    with contextlib.suppress(wsproto.utilities.LocalProtocolError):
                        await _send_handshake_bytes(stream, [ws.send(hint)])
                raise WebSocketHandshakeError(f"invalid HTTP upgrade request: {exc}") from exc
            if ws_request is None and not data:
                raise WebSocketHandshakeError(
                    "client closed the connection before finishing the upgrade request",
                    reason="closed")
        target = _path_only(ws_request.target)
        if target != want:
            body = f"No WebSocket endpoint at {target}\n".encode()
            out = ws.send(wsproto.events.RejectConnection(
                status_code=404, has_body=True,
                headers=[(b"content-type", b"text/plain; charset=utf-8"),
                         (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]))
            out += ws.send(wsproto.events.RejectData(data=body))
            await _send_handshake_bytes(stream, [out])
            raise WebSocketHandshakeError(f"upgrade request for unknown path {target}",
                                          status=404)
        await _send_handshake_bytes(stream, [ws.send(wsproto.events.AcceptConnection())])
        # wsproto leaves out Host and the extension/subprotocol headers; put Host back
        # so PeerInfo.headers looks the same whichever core parsed the request.
        header_items = (("host", ws_request.host), *(
            (bytes(k).decode("latin-1").lower(), bytes(v).decode("latin-1"))
            for k, v in ws_request.extra_headers))
        codec = WsprotoCodec(ws, max_message_size)
    full_peer = PeerInfo(address=peer.address, certificate_der=peer.certificate_der,
                         headers=header_items)
    transport = WebSocketTransport(stream, codec, full_peer, impl=impl,
                                   max_message_size=max_message_size)
    return transport
