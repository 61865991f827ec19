"""Accepting: what a tunnel server runs to take connections from agents.

`serve()` listens on an endpoint URL, does each connection's TLS handshake and WebSocket
upgrade inside a timeout (a client that says nothing costs one socket for that long,
never a listener), and hands every transport to the caller's handler in a nursery it
owns; a failed handshake or a crashing handler costs only its own connection. Dialing is
dial.py; the URLs are urls.py.
"""

from __future__ import annotations

import errno
import ssl
from collections.abc import Awaitable, Callable

import trio

from tunnel.listeners import open_tcp_listeners
from tunnel.log import RateLimitedLog, get_logger
from tunnel.tcp import format_address
from tunnel.transports import (
    MAX_MESSAGE_SIZE,
    Endpoint,
    PeerInfo,
    StreamTransport,
    TLSStream,
    Transport,
    WebSocketHandshakeError,
    WebSocketImpl,
    describe_error,
)
from tunnel.urls import as_endpoint, choose_websocket_impl

__all__ = ["serve"]

log = get_logger("tunnel.accept")
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


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
    `handshake_timeout`. A failed handshake is logged (logger "tunnel.accept", with peer and
    reason; at most one line per reason a minute, with a count: anyone can cause them)
    and costs only that connection; so does a handler that raises.

    `reuse_port`: other processes may listen on the same address (a server's workers;
    tunnel/listeners.py)."""
    endpoint = as_endpoint(endpoint)
    impl = choose_websocket_impl(websocket_impl)
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
