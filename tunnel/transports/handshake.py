"""The WebSocket opening handshake (the HTTP upgrade) on an open stream, client and server.

Owns `websocket_connect`, `websocket_accept` and `WebSocketHandshakeError`. Each side on
each core (websockets, wsproto) is a small sans-IO `_Upgrade`: the peer's bytes in, bytes
to send out, the connection's codec once done. One read loop (`_read_peer_half`) drives
all four, with one size limit and one mapping of network errors. The caller applies the
timeout and closes the stream on failure.
"""

from __future__ import annotations

import abc
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

from tunnel.transports.base import (
    MAX_HANDSHAKE_SIZE,
    PeerInfo,
    WebSocketHandshakeError,
)
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
    upgrade: _Upgrade
    if impl == "websockets":
        scheme = "wss" if secure else "ws"
        upgrade = _WebsocketsClient(f"{scheme}://{host_header}{path}", path, headers,
                                    max_message_size)
    else:
        upgrade = _WsprotoClient(host_header, path, headers, max_message_size)
    await _send_handshake_bytes(stream, upgrade.take_output())
    await _read_peer_half(stream, upgrade,
                          closed="server closed the connection during the HTTP upgrade")
    return WebSocketTransport(stream, upgrade.codec(), peer, impl=impl,
                              max_message_size=max_message_size)


async def websocket_accept(
    stream: trio.abc.Stream, *, impl: WebSocketImpl, path: str, peer: PeerInfo,
    max_message_size: int = MAX_MESSAGE_SIZE,
) -> WebSocketTransport:
    """Server side of the upgrade: read the request, answer 404 unless its path is
    `path`, else 101. The returned transport's PeerInfo carries the request headers
    (lower-case names). Raises WebSocketHandshakeError (after answering, when an answer
    makes sense)."""
    upgrade: _ServerUpgrade
    if impl == "websockets":
        upgrade = _WebsocketsServer(max_message_size)
    else:
        upgrade = _WsprotoServer(max_message_size)
    await _read_peer_half(
        stream, upgrade,
        closed="client closed the connection before finishing the upgrade request")
    error = upgrade.answer(_path_only(path))
    await _send_handshake_bytes(stream, upgrade.take_output())
    if error is not None:
        raise error
    full_peer = PeerInfo(address=peer.address, certificate_der=peer.certificate_der,
                         headers=upgrade.headers())
    return WebSocketTransport(stream, upgrade.codec(), full_peer, impl=impl,
                              max_message_size=max_message_size)


# ------------------------------------------------------------------------- the I/O


async def _read_peer_half(stream: trio.abc.Stream, upgrade: _Upgrade, *, closed: str) -> None:
    """Read until the peer's request (or response) is complete. What the upgrade queued
    to answer a bad one is sent before its error is raised; `closed` is the message for
    an EOF before the end."""
    received = 0
    while True:
        data = await _receive_handshake_bytes(stream, received)
        received += len(data)
        try:
            done = upgrade.receive(data)
        except WebSocketHandshakeError:
            await _send_handshake_bytes(stream, upgrade.take_output())
            raise
        if done:
            return
        if not data:
            await _send_handshake_bytes(stream, upgrade.take_output())
            raise WebSocketHandshakeError(closed, reason="closed")


async def _receive_handshake_bytes(stream: trio.abc.Stream, received: int) -> bytes:
    if received > MAX_HANDSHAKE_SIZE:
        raise WebSocketHandshakeError(
            f"HTTP upgrade larger than {MAX_HANDSHAKE_SIZE} bytes", reason="http")
    try:
        data = await stream.receive_some(16 * 1024)
    except (trio.BrokenResourceError, OSError, ssl.SSLError) as exc:
        raise _connection_failed(exc) from exc
    return bytes(data)


async def _send_handshake_bytes(stream: trio.abc.Stream, data: bytes) -> None:
    if not data:
        return
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, OSError, ssl.SSLError) as exc:
        raise _connection_failed(exc) from exc


def _connection_failed(exc: BaseException) -> WebSocketHandshakeError:
    return WebSocketHandshakeError(
        f"connection failed during the HTTP upgrade: {describe_error(exc)}",
        reason="tls" if is_tls_error(exc) else "closed")


def _path_only(target: str) -> str:
    return target.split("?", 1)[0] or "/"


# ------------------------------------------------------------- one side on one core


class _Upgrade(abc.ABC):
    """One side of the opening handshake on a sans-IO WebSocket core. Whatever it wants
    sent (a request, an answer, a refusal before it raises) waits in `take_output()`."""

    def __init__(self) -> None:
        self._output: list[bytes] = []

    def take_output(self) -> bytes:
        data = b"".join(self._output)
        self._output.clear()
        return data

    @abc.abstractmethod
    def receive(self, data: bytes) -> bool:
        """Bytes from the peer (b"" = EOF). True once its request or response is
        complete; raises WebSocketHandshakeError if it is not acceptable."""

    @abc.abstractmethod
    def codec(self) -> WebSocketCodec:
        """The connection after the upgrade, with what arrived along with its end."""


class _ServerUpgrade(_Upgrade):
    """The server side: once the request is in, answer it."""

    def answer(self, path: str) -> WebSocketHandshakeError | None:
        """Queue the answer: 404 unless the request is for `path`, else 101. Returns the
        error to raise once the answer is sent, if the upgrade did not happen."""
        requested = _path_only(self.target())
        if requested != path:
            self._reject_not_found(requested)
            return WebSocketHandshakeError(f"upgrade request for unknown path {requested}",
                                           status=404)
        return self._accept()

    @abc.abstractmethod
    def target(self) -> str:
        """The request's target (path and query)."""

    @abc.abstractmethod
    def headers(self) -> tuple[tuple[str, str], ...]:
        """The request's headers, lower-case names, Host included."""

    @abc.abstractmethod
    def _reject_not_found(self, path: str) -> None: ...

    @abc.abstractmethod
    def _accept(self) -> WebSocketHandshakeError | None: ...


def _feed_websockets(proto: websockets.protocol.Protocol,
                     data: bytes) -> list[websockets.protocol.Event]:
    if data:
        proto.receive_data(data)
    else:
        proto.receive_eof()
    return proto.events_received()


def _no_request() -> RuntimeError:
    return RuntimeError("the upgrade request has not been received")


class _WebsocketsClient(_Upgrade):
    def __init__(self, uri: str, path: str, headers: Sequence[tuple[str, str]],
                 max_message_size: int) -> None:
        super().__init__()
        self._path = path
        self._proto = websockets.client.ClientProtocol(websockets.uri.parse_uri(uri),
                                                       max_size=max_message_size)
        request = self._proto.connect()
        for name, value in headers:
            request.headers[name] = value
        self._proto.send_request(request)
        self._output.extend(self._proto.data_to_send())
        self._rest: list[websockets.protocol.Event] = []

    def receive(self, data: bytes) -> bool:
        proto = self._proto
        events = _feed_websockets(proto, data)
        exc = proto.handshake_exc
        if exc is not None:
            if isinstance(exc, websockets.exceptions.InvalidStatus):
                status = exc.response.status_code
                raise WebSocketHandshakeError(
                    f"server answered HTTP {status} {exc.response.reason_phrase} "
                    f"to the WebSocket upgrade for {self._path}", status=status)
            raise WebSocketHandshakeError(f"invalid WebSocket upgrade response: {exc}")
        response = next((e for e in events if isinstance(e, websockets.http11.Response)),
                        None)
        if response is None:
            return False
        self._rest = events[events.index(response) + 1:]
        return True

    def codec(self) -> WebSocketCodec:
        return WebsocketsCodec(self._proto, self._rest)


class _WsprotoClient(_Upgrade):
    def __init__(self, host_header: str, path: str, headers: Sequence[tuple[str, str]],
                 max_message_size: int) -> None:
        super().__init__()
        self._path = path
        self._max_message_size = max_message_size
        self._ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        extra = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]
        try:
            self._output.append(self._ws.send(wsproto.events.Request(
                host=host_header, target=path, extra_headers=extra)))
        except wsproto.utilities.LocalProtocolError as exc:
            raise WebSocketHandshakeError(f"cannot build the upgrade request: {exc}") from exc

    def receive(self, data: bytes) -> bool:
        try:
            self._ws.receive_data(data or None)
            for event in self._ws.events():
                # Stop at the answer: later events stay queued in wsproto for the codec.
                if isinstance(event, wsproto.events.AcceptConnection):
                    return True
                if isinstance(event, wsproto.events.RejectConnection):
                    raise WebSocketHandshakeError(
                        f"server answered HTTP {event.status_code} to the WebSocket "
                        f"upgrade for {self._path}", status=event.status_code)
        except wsproto.utilities.RemoteProtocolError as exc:
            raise WebSocketHandshakeError(
                f"invalid WebSocket upgrade response: {exc}") from exc
        return False

    def codec(self) -> WebSocketCodec:
        return WsprotoCodec(self._ws, self._max_message_size)


class _WebsocketsServer(_ServerUpgrade):
    def __init__(self, max_message_size: int) -> None:
        super().__init__()
        self._proto = websockets.server.ServerProtocol(max_size=max_message_size)
        self._request: websockets.http11.Request | None = None
        self._rest: list[websockets.protocol.Event] = []

    def receive(self, data: bytes) -> bool:
        proto = self._proto
        events = _feed_websockets(proto, data)
        request = next((e for e in events if isinstance(e, websockets.http11.Request)), None)
        if request is None:
            if proto.handshake_exc is not None or not data:
                self._output.extend(proto.data_to_send())  # websockets' 400, if any
            if proto.handshake_exc is not None:
                raise WebSocketHandshakeError(
                    f"invalid HTTP upgrade request: {proto.handshake_exc}")
            return False
        self._request = request
        self._rest = events[events.index(request) + 1:]
        return True

    def _got(self) -> websockets.http11.Request:
        if self._request is None:
            raise _no_request()
        return self._request

    def target(self) -> str:
        return self._got().path

    def headers(self) -> tuple[tuple[str, str], ...]:
        return tuple((k.lower(), v) for k, v in self._got().headers.raw_items())

    def _reject_not_found(self, path: str) -> None:
        response = self._proto.reject(404, f"No WebSocket endpoint at {path}\n")
        self._proto.send_response(response)
        self._output.extend(self._proto.data_to_send())

    def _accept(self) -> WebSocketHandshakeError | None:
        response = self._proto.accept(self._got())
        self._proto.send_response(response)
        self._output.extend(self._proto.data_to_send())
        if response.status_code != 101:
            return WebSocketHandshakeError(
                f"invalid WebSocket upgrade request: {self._proto.handshake_exc}",
                status=response.status_code)
        return None

    def codec(self) -> WebSocketCodec:
        return WebsocketsCodec(self._proto, self._rest)


class _WsprotoServer(_ServerUpgrade):
    def __init__(self, max_message_size: int) -> None:
        super().__init__()
        self._max_message_size = max_message_size
        self._ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
        self._request: wsproto.events.Request | None = None

    def receive(self, data: bytes) -> bool:
        ws = self._ws
        try:
            ws.receive_data(data or None)
            for event in ws.events():
                if isinstance(event, wsproto.events.Request):
                    self._request = event
                    return True
        except wsproto.utilities.RemoteProtocolError as exc:
            hint = exc.event_hint
            if isinstance(hint, wsproto.events.RejectConnection):
                with contextlib.suppress(wsproto.utilities.LocalProtocolError):
                    self._output.append(ws.send(hint))
            raise WebSocketHandshakeError(f"invalid HTTP upgrade request: {exc}") from exc
        return False

    def _got(self) -> wsproto.events.Request:
        if self._request is None:
            raise _no_request()
        return self._request

    def target(self) -> str:
        return self._got().target

    def headers(self) -> tuple[tuple[str, str], ...]:
        request = self._got()
        # wsproto leaves out Host and the extension/subprotocol headers; put Host back
        # so PeerInfo.headers looks the same whichever core parsed the request.
        return (("host", request.host), *(
            (bytes(k).decode("latin-1").lower(), bytes(v).decode("latin-1"))
            for k, v in request.extra_headers))

    def _reject_not_found(self, path: str) -> None:
        body = f"No WebSocket endpoint at {path}\n".encode()
        ws = self._ws
        self._output.append(ws.send(wsproto.events.RejectConnection(
            status_code=404, has_body=True,
            headers=[(b"content-type", b"text/plain; charset=utf-8"),
                     (b"content-length", str(len(body)).encode()),
                     (b"connection", b"close")])))
        self._output.append(ws.send(wsproto.events.RejectData(data=body)))

    def _accept(self) -> WebSocketHandshakeError | None:
        self._output.append(self._ws.send(wsproto.events.AcceptConnection()))
        return None

    def codec(self) -> WebSocketCodec:
        return WsprotoCodec(self._ws, self._max_message_size)
