"""Dialing and listening: endpoint URLs → connected, handshaken `Transport`s.

`dial()` is what an agent calls (TCP connect with SO_MARK, TLS, WebSocket upgrade, all
inside one timeout; failures become `DialError` with a short reason). `serve()` is what
the server runs: it accepts connections, does each one's TLS/WebSocket handshake inside a
timeout (a client that says nothing costs one socket for that long, never a listener),
and hands every transport to the caller's handler in a nursery it owns.
"""

from __future__ import annotations

import errno
import ipaddress
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import trio

from tunnel.listeners import open_tcp_listeners
from tunnel.log import RateLimitedLog, get_logger
from tunnel.tcp import SO_MARK, DialFailed, connect_tcp, format_address
from tunnel.transports import (
    MAX_MESSAGE_SIZE,
    STREAM_RECEIVE_SIZE,
    WEBSOCKET_IMPLS,
    DialError,
    Endpoint,
    PeerInfo,
    StreamTransport,
    TLSStream,
    Transport,
    WebSocketHandshakeError,
    WebSocketImpl,
    describe_error,
    is_tls_error,
)

__all__ = [
    "DEFAULT_WEBSOCKET_IMPL",
    "SO_MARK",
    "dial",
    "format_address",
    "parse_endpoint",
    "serve",
]

log = get_logger("tunnel.dial")
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


# Picked by measurement (scripts/bench_websocket.py, 512 MiB in 64 KiB messages, best of
# 3, CPU per MiB of the busier end): over wss, websockets' core uploads (client → server,
# what agents mostly do) 2.1x faster than wsproto (377 vs 182 MB/s; wsproto masks in
# pure Python) and downloads about as fast (396 vs 373 MB/s); raw TLS did 407 / 495.
DEFAULT_WEBSOCKET_IMPL: WebSocketImpl = "websockets"

WebSocketImplChoice = Literal["auto", "websockets", "wsproto"]

_SCHEMES = ("tls", "tcp", "wss", "ws")
_DEFAULT_PORTS = {"tls": 443, "wss": 443, "ws": 80}


def parse_endpoint(url: str) -> Endpoint:
    """`tls://host:port`, `tcp://host:port`, `wss://host[:port]/path`, `ws://...`.

    IPv6 literals go in brackets. Default ports: 443 for tls and wss, 80 for ws; tcp needs
    one. Raises ValueError saying what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("endpoint URL is empty; expected e.g. tls://tunnel.example.com:443")
    url = url.strip()
    if "://" not in url:
        raise ValueError(f"{url!r}: missing scheme; expected tls://, tcp://, wss:// or ws://")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        if "[" in url:
            raise ValueError(f"{url!r}: the address in brackets is not an IPv6 address "
                             f"({exc})") from None
        raise ValueError(f"{url!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"{url!r}: unsupported scheme {parts.scheme!r}; "
                         "use tls://, tcp://, wss:// or ws://")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{url!r}: credentials in the URL are not supported; "
                         "use a token or a client certificate")
    if parts.fragment:
        raise ValueError(f"{url!r}: a fragment (#...) has no meaning here")
    netloc = parts.netloc
    host = parts.hostname
    if netloc.count(":") > 1 and not netloc.startswith("["):
        raise ValueError(f"{url!r}: put IPv6 addresses in brackets, e.g. "
                         f"{scheme}://[::1]:443")
    if not host:
        raise ValueError(f"{url!r}: no host")
    if netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"{url!r}: {host!r} in brackets is not an IPv6 address") from None
    elif host.count(":") or not _valid_hostname(host):
        hint = "; put IPv6 addresses in brackets: [::1]" if ":" in host else ""
        raise ValueError(f"{url!r}: invalid host {host!r}{hint}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r}: invalid port; expected a number in 0-65535") from None
    if port is None:
        if scheme not in _DEFAULT_PORTS:
            raise ValueError(f"{url!r}: tcp:// needs a port, e.g. tcp://{netloc}:7000")
        port = _DEFAULT_PORTS[scheme]
    path = parts.path or "/"
    if scheme in ("tls", "tcp"):
        if path != "/" or parts.query:
            raise ValueError(f"{url!r}: {scheme}:// endpoints take no path or query")
        path = "/"
    elif parts.query:
        path = f"{path}?{parts.query}"
    return Endpoint(scheme=scheme, host=host, port=port, path=path)


def _valid_hostname(host: str) -> bool:
    if len(host) > 253:
        return False
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789-._")
    return all(label and set(label.lower()) <= allowed
               for label in host.rstrip(".").split("."))


def _choose_impl(choice: str) -> WebSocketImpl:
    if choice == "auto":
        return DEFAULT_WEBSOCKET_IMPL
    for impl in WEBSOCKET_IMPLS:
        if choice == impl:
            return impl
    raise ValueError(f"unknown websocket_impl {choice!r}; "
                     f"use 'auto' or one of {', '.join(WEBSOCKET_IMPLS)}")


def _as_endpoint(endpoint: Endpoint | str) -> Endpoint:
    return parse_endpoint(endpoint) if isinstance(endpoint, str) else endpoint


# --------------------------------------------------------------------------------- dial


async def dial(
    endpoint: Endpoint | str, *,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    connect_timeout: float = 10.0,
    socket_mark: int | None = None,
    headers: Sequence[tuple[str, str]] = (),
    websocket_impl: str = "auto",
    max_message_size: int = MAX_MESSAGE_SIZE,
    tcp_timeout: float | None = None,
) -> Transport:
    """Connect to `endpoint` and return a ready transport.

    TCP connect, TLS handshake and WebSocket upgrade all happen within `connect_timeout`;
    `tcp_timeout`, if given, bounds the TCP connect alone (a dial to a host that drops
    SYNs gives up then, instead of waiting for the kernel's SYN retries at 1, 3, 7 s).
    `socket_mark` sets SO_MARK on the socket before it connects. `headers` go on the
    WebSocket upgrade request (e.g. `("Authorization", "Bearer ...")`). TLS endpoints use
    `ssl_context`, or the system's trust store if None.

    Raises DialError with `reason` one of: dns, refused, unreachable, timeout, reset (the
    connection cut during the TLS handshake), tls (TLS itself failed: certificate, alert),
    http, unavailable (the upgrade answered 502/503/504: a proxy without a live server),
    closed, mark.
    """
    endpoint = _as_endpoint(endpoint)
    impl = _choose_impl(websocket_impl)
    if ssl_context is not None and not endpoint.uses_tls:
        raise ValueError(f"{endpoint}: ssl_context given for an endpoint without TLS")
    if endpoint.uses_tls and ssl_context is None:
        ssl_context = ssl.create_default_context()
        ssl_context.minimum_version = ssl.TLSVersion.TLSv1_2
        # A cut connection must not read as a clean end (see nodeagent.pki._harden).
        ssl_context.options &= ~ssl.OP_IGNORE_UNEXPECTED_EOF
    try:
        with trio.fail_after(connect_timeout):
            return await _dial(endpoint, ssl_context=ssl_context,
                               server_hostname=server_hostname, socket_mark=socket_mark,
                               headers=headers, impl=impl, max_message_size=max_message_size,
                               tcp_timeout=tcp_timeout)
    except trio.TooSlowError:
        raise DialError(f"{endpoint}: no connection within {connect_timeout:g}s",
                        "timeout") from None


async def _dial(endpoint: Endpoint, *, ssl_context: ssl.SSLContext | None,
                server_hostname: str | None, socket_mark: int | None,
                headers: Sequence[tuple[str, str]], impl: WebSocketImpl,
                max_message_size: int, tcp_timeout: float | None) -> Transport:
    started = trio.current_time()
    connected: trio.SocketStream | None = None
    with trio.move_on_after(tcp_timeout if tcp_timeout is not None else float("inf")):
        connected = await _connect_tcp(endpoint, socket_mark)
    if connected is None:
        raise DialError(f"{endpoint}: no TCP connection within {tcp_timeout:g}s", "timeout")
    sock_stream = connected
    connect_rtt = trio.current_time() - started
    stream: trio.abc.Stream = sock_stream
    try:
        address = format_address(sock_stream.socket.getpeername())
        certificate: bytes | None = None
        initial = b""
        if ssl_context is not None:
            ssl_stream = TLSStream(sock_stream, ssl_context,
                                   server_hostname=server_hostname or endpoint.host)
            stream = ssl_stream
            try:
                await ssl_stream.do_handshake()
            except trio.BrokenResourceError as exc:
                raise _tls_dial_error(endpoint, exc) from None
            if ssl_context.verify_mode != ssl.CERT_NONE:
                certificate = ssl_stream.getpeercert(binary_form=True)
            if not endpoint.is_websocket and ssl_stream.version() == "TLSv1.3":
                initial = await _confirm_tls13(endpoint, ssl_stream, connect_rtt)
        peer = PeerInfo(address=address, certificate_der=certificate)
        if not endpoint.is_websocket:
            return StreamTransport(stream, peer, initial=initial)
        from tunnel.transports.handshake import websocket_connect  # ws only: see transports
        try:
            return await websocket_connect(
                stream, impl=impl, host=endpoint.host, port=endpoint.port,
                path=endpoint.path, secure=endpoint.uses_tls, peer=peer, headers=headers,
                max_message_size=max_message_size)
        except WebSocketHandshakeError as exc:
            reason = "unavailable" if exc.status in (502, 503, 504) else exc.reason
            raise DialError(f"{endpoint}: {exc}", reason) from None
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise


def _tls_dial_error(endpoint: Endpoint, exc: BaseException) -> DialError:
    if is_tls_error(exc):
        return DialError(f"{endpoint}: TLS handshake failed: {describe_error(exc)}", "tls")
    return DialError(f"{endpoint}: connection lost during the TLS handshake: "
                     f"{describe_error(exc)}", "reset")


async def _connect_tcp(endpoint: Endpoint, socket_mark: int | None) -> trio.SocketStream:
    # dial() holds one deadline over TCP, TLS and the upgrade: no timeout of our own here.
    try:
        return await connect_tcp(endpoint.host, endpoint.port, connect_timeout=None,
                                 mark=socket_mark)
    except DialFailed as exc:
        if exc.cause == "mark":
            raise DialError(f"{exc.message} on the tunnel socket", "mark") from None
        if exc.cause == "dns":
            raise DialError(f"{endpoint}: {exc.message}", "dns") from None
        if exc.cause == "refused" and all(isinstance(e, ConnectionRefusedError)
                                          for _, e in exc.attempts):
            refused = ", ".join(address for address, _ in exc.attempts)
            raise DialError(f"{endpoint}: connection refused by {refused}", "refused") from None
        details = "; ".join(f"{a}: {describe_error(e)}" for a, e in exc.attempts)
        raise DialError(f"{endpoint}: cannot connect: {details}", "unreachable") from None


async def _confirm_tls13(endpoint: Endpoint, stream: TLSStream, connect_rtt: float) -> bytes:
    """In TLS 1.3 the client finishes its handshake before the server has checked the
    client's certificate; a rejection (missing, wrong CA, expired) arrives as an alert
    afterwards. Wait for the server's first post-handshake flight (session tickets, or
    that alert) so a rejected certificate is a DialError here, not a broken transport
    later. A server that sends nothing costs at most a few RTTs. Returns application data
    that arrived meanwhile."""
    reads = 0

    def on_receive() -> None:
        nonlocal reads
        reads += 1
        if reads >= 2:  # TLS processed the first flight without error and wants more
            scope.cancel()

    data: bytes | bytearray = b""
    with trio.move_on_after(max(0.5, 4 * connect_rtt)) as scope:
        stream.on_receive = on_receive
        try:
            data = await stream.receive_some(STREAM_RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if is_tls_error(exc):
                raise DialError(f"{endpoint}: server rejected the TLS session: "
                                f"{describe_error(exc)}", "tls") from None
            raise DialError(f"{endpoint}: server closed the connection after the TLS "
                            f"handshake: {describe_error(exc)}", "closed") from None
        finally:
            stream.on_receive = None
    if not scope.cancelled_caught and not data:
        raise DialError(f"{endpoint}: server closed the connection after the TLS handshake",
                        "closed")
    return bytes(data)


# -------------------------------------------------------------------------------- serve


async def serve(
    endpoint: Endpoint | str,
    handler: Callable[[Transport], Awaitable[None]], *,
    ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
    handshake_timeout: float = 10.0,
    websocket_impl: str = "auto",
    max_message_size: int = MAX_MESSAGE_SIZE,
    stop_accepting: trio.Event | None = None,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[list[Endpoint]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on `endpoint` until cancelled, calling `handler(transport)` for each
    connection that completes its handshakes; the transport is closed when the handler
    returns. Reports the bound endpoints (real ports, for port 0) via task_status.

    `ssl_context` may be a callable giving the context for each new connection: a
    certificate reloaded from its files applies to the next handshake, and connections
    already up keep theirs.

    When `stop_accepting` is set the listening sockets close (new connections are refused
    by the kernel, so they go to another process or replica) while the connections
    already accepted carry on; serve() returns once they have all ended.

    Each connection's TLS handshake and WebSocket upgrade must finish within
    `handshake_timeout`. A failed handshake is logged (logger "tunnel.dial", with peer and
    reason; at most one line per reason a minute, with a count: anyone can cause them)
    and costs only that connection; so does a handler that raises.

    `reuse_port`: other processes may listen on the same address (a server's workers;
    tunnel/listeners.py)."""
    endpoint = _as_endpoint(endpoint)
    impl = _choose_impl(websocket_impl)
    if endpoint.uses_tls and ssl_context is None:
        raise ValueError(f"{endpoint}: a TLS endpoint needs an ssl_context (certificate)")
    if ssl_context is not None and not endpoint.uses_tls:
        raise ValueError(f"{endpoint}: ssl_context given for an endpoint without TLS")
    host = None if endpoint.host in ("", "*") else endpoint.host
    listeners = await open_tcp_listeners(endpoint.port, host=host, reuse_port=reuse_port)
    bound = [Endpoint(endpoint.scheme, str(lst.socket.getsockname()[0]),
                      int(lst.socket.getsockname()[1]), endpoint.path) for lst in listeners]

    failures = RateLimitedLog(log, period=60.0, burst=5)

    async def accept(stream: trio.SocketStream) -> None:
        await _serve_connection(stream, endpoint, handler, ssl_context=ssl_context,
                                handshake_timeout=handshake_timeout, impl=impl,
                                max_message_size=max_message_size, failures=failures)

    async with trio.open_nursery() as connections:
        try:
            async with trio.open_nursery() as accepting:
                for listener in listeners:
                    accepting.start_soon(_accept_loop, listener, connections, accept,
                                         failures)
                log.info("listening", endpoint=str(endpoint),
                         bound=", ".join(str(b) for b in bound))
                task_status.started(bound)
                if stop_accepting is not None:
                    await stop_accepting.wait()
                    accepting.cancel_scope.cancel()
        finally:
            for listener in listeners:
                with trio.CancelScope(shield=True):
                    await listener.aclose()
        log.info("stopped accepting", endpoint=str(endpoint))


async def _accept_loop(listener: trio.SocketListener, nursery: trio.Nursery,
                       accept: Callable[[trio.SocketStream], Awaitable[None]],
                       failures: RateLimitedLog) -> None:
    """trio.serve_listeners' loop, with the listener closed by our caller (not here)."""
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                failures.warning("accept", "out of file descriptors; accept paused",
                                       error=str(exc))
                await trio.sleep(0.1)
                continue
            raise
        nursery.start_soon(accept, stream)


async def _serve_connection(
    stream: trio.SocketStream, endpoint: Endpoint,
    handler: Callable[[Transport], Awaitable[None]], *,
    ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None,
    handshake_timeout: float, impl: WebSocketImpl, max_message_size: int,
    failures: RateLimitedLog,
) -> None:
    try:
        peer_address = format_address(stream.socket.getpeername())
    except OSError:  # already gone
        await trio.aclose_forcefully(stream)
        return
    transport: Transport | None = None
    reason, message = "", ""
    context = ssl_context() if callable(ssl_context) else ssl_context
    with trio.move_on_after(handshake_timeout) as scope:
        try:
            transport = await _accept(stream, endpoint, peer_address, ssl_context=context,
                                      impl=impl, max_message_size=max_message_size)
        except _HandshakeFailed as exc:
            reason, message = exc.reason, str(exc)
        except Exception as exc:
            # A bug in handshake handling must cost one connection, not the listener.
            log.error("handshake crashed", peer=peer_address, error=repr(exc), exc_info=True)
            reason, message = "internal", repr(exc)
    if transport is None:
        if scope.cancelled_caught:
            reason = "timeout"
            message = f"no complete handshake within {handshake_timeout:g}s"
        # The transport's own handshake (TLS, WebSocket upgrade): whoever can reach the
        # port can fail one, so five lines per reason a minute, then a count.
        failures.warning(reason, "handshake failed", peer=peer_address,
                               endpoint=str(endpoint), reason=reason, error=message)
        await trio.aclose_forcefully(stream)
        return
    try:
        await handler(transport)
    except Exception as exc:
        # One connection's bug must not take the listener down.
        log.error("connection handler failed", peer=peer_address, error=repr(exc),
                  exc_info=True)
    finally:
        with trio.CancelScope(shield=True):
            await transport.aclose()


class _HandshakeFailed(Exception):
    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


async def _accept(stream: trio.SocketStream, endpoint: Endpoint, peer_address: str, *,
                  ssl_context: ssl.SSLContext | None, impl: WebSocketImpl,
                  max_message_size: int) -> Transport:
    inner: trio.abc.Stream = stream
    certificate: bytes | None = None
    try:
        if ssl_context is not None:
            ssl_stream = TLSStream(stream, ssl_context, server_side=True)
            inner = ssl_stream
            try:
                await ssl_stream.do_handshake()
            except trio.BrokenResourceError as exc:
                raise _HandshakeFailed(f"TLS handshake failed: {describe_error(exc)}",
                                       "tls") from None
            if ssl_context.verify_mode != ssl.CERT_NONE:
                certificate = ssl_stream.getpeercert(binary_form=True)
        peer = PeerInfo(address=peer_address, certificate_der=certificate)
        if not endpoint.is_websocket:
            return StreamTransport(inner, peer)
        from tunnel.transports.handshake import websocket_accept  # ws only: see transports
        try:
            return await websocket_accept(inner, impl=impl, path=endpoint.path, peer=peer,
                                          max_message_size=max_message_size)
        except WebSocketHandshakeError as exc:
            reason = "not_found" if exc.status == 404 else exc.reason
            raise _HandshakeFailed(str(exc), reason) from None
    except BaseException:
        await trio.aclose_forcefully(inner)
        raise
