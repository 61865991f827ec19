"""Dialing: an endpoint URL → a connected, handshaken `Transport`, what an agent does.

`dial()` runs the TCP connect (with SO_MARK), TLS and the WebSocket upgrade inside one
timeout and turns every failure into a `DialError` with a short reason a caller can act
on (retry, back off, report). Through a forward proxy (`proxy=`), the TCP connection goes
to the proxy and the proxy's handshake (tunnel.proxy, sans-IO) opens the stream to the
server inside the same deadline; TLS and the upgrade then run in that stream unchanged.
Accepting is accept.py; the URLs are urls.py.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

import trio

from tunnel.proxy import ProxyURL
from tunnel.tcp import SO_MARK, DialFailed, connect_tcp, format_address
from tunnel.transports import (
    MAX_MESSAGE_SIZE,
    STREAM_RECEIVE_SIZE,
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
from tunnel.urls import as_endpoint, choose_websocket_impl

__all__ = ["SO_MARK", "dial"]


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
    proxy: ProxyURL | None = None,
) -> Transport:
    """Connect to `endpoint` and return a ready transport.

    TCP connect, TLS handshake and WebSocket upgrade all happen within `connect_timeout`;
    `tcp_timeout`, if given, bounds the TCP connect alone (a dial to a host that drops
    SYNs gives up then, instead of waiting for the kernel's SYN retries at 1, 3, 7 s).
    `socket_mark` sets SO_MARK on the socket before it connects. `headers` go on the
    WebSocket upgrade request (e.g. `("Authorization", "Bearer ...")`). TLS endpoints use
    `ssl_context`, or the system's trust store if None. `proxy`: dial through this HTTP
    CONNECT or SOCKS5 proxy (tunnel.proxy.ProxyRules picks it for an endpoint).

    Raises DialError with `reason` one of: dns, refused, unreachable, timeout, reset (the
    connection cut during the TLS handshake), tls (TLS itself failed: certificate, alert),
    http, unavailable (the upgrade answered 502/503/504, or the proxy could not reach the
    server: a proxy without a live server), closed, mark, proxy_auth (the proxy refused
    or wants credentials), proxy (the proxy refused otherwise or is not one).
    """
    endpoint = as_endpoint(endpoint)
    impl = choose_websocket_impl(websocket_impl)
    if ssl_context is not None and not endpoint.uses_tls:
        raise ValueError(f"{endpoint}: ssl_context given for an endpoint without TLS")
    if endpoint.uses_tls and ssl_context is None:
        ssl_context = ssl.create_default_context()
        ssl_context.minimum_version = ssl.TLSVersion.TLSv1_2
        # A cut connection must not read as a clean end (see nodeagent.trust.tlscontext.harden).
        ssl_context.options &= ~ssl.OP_IGNORE_UNEXPECTED_EOF
    try:
        with trio.fail_after(connect_timeout):
            return await _dial(endpoint, ssl_context=ssl_context,
                               server_hostname=server_hostname, socket_mark=socket_mark,
                               headers=headers, impl=impl, max_message_size=max_message_size,
                               tcp_timeout=tcp_timeout, proxy=proxy)
    except trio.TooSlowError:
        raise DialError(f"{endpoint}: no connection within {connect_timeout:g}s",
                        "timeout") from None


async def _dial(endpoint: Endpoint, *, ssl_context: ssl.SSLContext | None,
                server_hostname: str | None, socket_mark: int | None,
                headers: Sequence[tuple[str, str]], impl: WebSocketImpl,
                max_message_size: int, tcp_timeout: float | None,
                proxy: ProxyURL | None) -> Transport:
    started = trio.current_time()
    connected: trio.SocketStream | None = None
    via = f" through proxy {proxy}" if proxy is not None else ""
    with trio.move_on_after(tcp_timeout if tcp_timeout is not None else float("inf")):
        connected = await _connect_tcp(endpoint, socket_mark, proxy)
    if connected is None:
        raise DialError(f"{endpoint}: no TCP connection{via} within {tcp_timeout:g}s",
                        "timeout")
    sock_stream = connected
    connect_rtt = trio.current_time() - started
    stream: trio.abc.Stream = sock_stream
    try:
        try:
            address = format_address(sock_stream.socket.getpeername())
        except OSError as exc:  # reset between connect() and here (a server closing)
            raise DialError(f"{endpoint}: the connection{via} closed at once: {exc}",
                            "reset") from None
        if proxy is not None:
            # The peer is the server as far as the tunnel is concerned; the socket's
            # address is the proxy's.
            await _proxy_handshake(endpoint, sock_stream, proxy)
            connect_rtt = trio.current_time() - started  # to the server, not the proxy
            address = f"{format_address((endpoint.host, endpoint.port))} via {proxy.address}"
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


async def _connect_tcp(endpoint: Endpoint, socket_mark: int | None,
                       proxy: ProxyURL | None) -> trio.SocketStream:
    # dial() holds one deadline over TCP, TLS and the upgrade: no timeout of our own here.
    host, port = (proxy.host, proxy.port) if proxy is not None else (endpoint.host,
                                                                       endpoint.port)
    # A proxy that cannot be reached is this node's network problem, said as such.
    where = f"{endpoint}: proxy {proxy}" if proxy is not None else f"{endpoint}"
    try:
        return await connect_tcp(host, port, connect_timeout=None, mark=socket_mark)
    except DialFailed as exc:
        if exc.cause == "mark":
            raise DialError(f"{exc.message} on the tunnel socket", "mark") from None
        if exc.cause == "dns":
            raise DialError(f"{where}: {exc.message}", "dns") from None
        if exc.cause == "refused" and all(isinstance(e, ConnectionRefusedError)
                                          for _, e in exc.attempts):
            refused = ", ".join(address for address, _ in exc.attempts)
            raise DialError(f"{where}: connection refused by {refused}", "refused") from None
        details = "; ".join(f"{a}: {describe_error(e)}" for a, e in exc.attempts)
        raise DialError(f"{where}: cannot connect: {details}", "unreachable") from None


# Bytes read at a time during a proxy handshake: its answers are small.
_PROXY_READ_SIZE = 4096


async def _proxy_handshake(endpoint: Endpoint, stream: trio.SocketStream,
                           proxy: ProxyURL) -> None:
    """Ask the proxy for a stream to the endpoint (tunnel.proxy's sans-IO handshake run
    over the socket); raises DialError with the proxy's reason."""
    # Through a proxy only: the SOCKS library loads when a dial first needs it.
    from tunnel.proxy.handshake import ProxyError, handshake_for

    handshake = handshake_for(proxy, endpoint.host, endpoint.port)
    try:
        while not handshake.done:
            if out := handshake.data_to_send():
                await stream.send_all(out)
            handshake.receive_data(await stream.receive_some(_PROXY_READ_SIZE))
    except ProxyError as exc:
        raise DialError(f"{endpoint}: {exc}", exc.reason) from None
    except (trio.BrokenResourceError, OSError) as exc:
        raise DialError(f"{endpoint}: proxy {proxy} cut the connection: "
                        f"{describe_error(exc)}", "reset") from None
    if handshake.leftover:
        # A proxy never speaks for the server before the client has (TLS, the tunnel's
        # HELLO): bytes here mean it is not the proxy the URL says.
        raise DialError(f"{endpoint}: proxy {proxy} sent {len(handshake.leftover)} bytes "
                        f"after opening the stream, before the server could speak", "proxy")


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
