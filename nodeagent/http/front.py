"""The HTTP front's listener: accepts TCP connections, terminates TLS (certificate chosen by
SNI, see `tls`) when configured, and serves each connection in a task of its own nursery.

`HttpFront` owns the listeners, the connection tasks, the counters (`HttpStats`) and the
`Balancer` its connections share; `serve_http_connection` is the per-connection entry,
usable on any stream (tests and embedders call it directly). A bug in serving one
connection costs that connection, never the listener.

Which protocol a connection speaks: on TLS, ALPN (`h2` offered before `http/1.1`); on
plaintext, the first bytes (HTTP/2's connection preface is h2c with prior knowledge,
anything else HTTP/1.1), so one port serves both. HTTP/2 connections are served by
`h2connection`, HTTP/1.1 ones by `connection`; both route through the same `dispatch`.
HTTP/2's modules and the h2c backends' pool load when first needed (`ondemand`).

Connection caps (`Limits.max_connections`, `max_connections_per_client`) are checked on
accept, before TLS or any parsing: over a cap, a plain-HTTP connection gets a fixed 503
(no request is read) and a TLS one is closed before its handshake (which would cost more
CPU than the refusal protects). Open connections are counted per `client_key` in a dict
whose entries go at zero, so its size is the number of clients connected right now.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from nodeagent.http.balancer import Balancer
from nodeagent.http.connection import GracefulClose, HttpConnection
from nodeagent.http.holds import HeldRequests
from nodeagent.http.limits import Limits
from nodeagent.http.ondemand import H2PoolSlot
from nodeagent.http.preface import PREFACE
from nodeagent.http.routetable import Backend, RouteTable
from nodeagent.http.stats import HttpStats
from nodeagent.http.tls import TlsConfig
from nodeagent.http.upstream import Opener
from nodeagent.ops.logs import get_logger
from nodeagent.proxyprotocol.receive import ProxyTrust, looks_like_proxy_header

if TYPE_CHECKING:
    from nodeagent.http.h2pool import Describe

log = get_logger("nodeagent.http")

_BUSY_BODY = b"503 Service Unavailable: too many connections, retry later\n"
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n\r\n%b"
    % (len(_BUSY_BODY), _BUSY_BODY)
)


def client_key(address: str) -> str:
    """Whom a connection counts against for `max_connections_per_client`.

    An IPv4 address (also IPv4-mapped IPv6) is itself; an IPv6 address counts by its /64,
    the smallest block one host or site gets, so a client cannot escape the cap by
    cycling through the addresses of its own prefix.
    """
    if ":" not in address:
        return address
    try:
        ip = ipaddress.IPv6Address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))


async def serve_http_connection(
    stream: trio.abc.Stream,
    *,
    table: Callable[[], RouteTable],
    open_upstream: Opener,
    scheme: str = "http",
    client_addr: str,
    limits: Limits | None = None,
    stats: HttpStats | None = None,
    balancer: Balancer | None = None,
    access_log: bool = False,
    closing: GracefulClose | None = None,
    pool: H2PoolSlot | None = None,
    h2: bool | None = None,
    holds: HeldRequests | None = None,
    proxy: ProxyTrust | None = None,
    listener: str = "http",
) -> None:
    """Serve one client connection until it closes; closes `stream` (and upstreams) at the end.

    `table` is called for every request, so the owner swaps routes by changing what it
    returns. `h2`: True, the connection speaks HTTP/2 (ALPN chose it); False, HTTP/1.1
    only; None, HTTP/1.1 or h2c with prior knowledge, told apart by the first bytes.
    `pool`: the h2c backends' shared connections (one for this connection alone if
    None). `proxy`: set, a plaintext connection that starts with a PROXY header (one its
    peer may not send, or a second one) is refused as `untrusted`. Never raises for
    anything a client or upstream does; cancellation propagates.
    """
    limits = limits or Limits()
    if pool is None:
        async with trio.open_nursery() as nursery:
            await serve_http_connection(
                stream, table=table, open_upstream=open_upstream, scheme=scheme,
                client_addr=client_addr, limits=limits, stats=stats, balancer=balancer,
                access_log=access_log, closing=closing, h2=h2, holds=holds,
                pool=H2PoolSlot(nursery, open_upstream, limits), proxy=proxy,
                listener=listener)
            nursery.cancel_scope.cancel()
        return
    stats = stats if stats is not None else HttpStats()
    balancer = balancer if balancer is not None else Balancer(limits.failed_backend_cooldown)
    closing = closing if closing is not None else GracefulClose()
    initial = b""
    timed_out = False
    if h2 is None:
        sniffed = await _sniff_preface(stream, limits)
        if sniffed is None:
            timed_out = True
        else:
            initial = sniffed
            h2 = initial.startswith(PREFACE)
            if proxy is not None and looks_like_proxy_header(initial):
                proxy.refuse_unexpected(client_addr, listener)
                await trio.aclose_forcefully(stream)
                return
    if h2:
        from nodeagent.http.h2connection import H2Connection  # loaded on first use

        await H2Connection(stream, table, open_upstream, scheme, client_addr, limits, stats,
                           balancer, pool.get(), access_log, closing, initial,
                           holds=holds).run()
        return
    await HttpConnection(
        stream,
        table,
        open_upstream,
        scheme,
        client_addr,
        limits,
        stats,
        balancer,
        access_log,
        closing,
        pool,
        holds,
    ).run(initial, timed_out)


async def _sniff_preface(stream: trio.abc.Stream, limits: Limits) -> bytes | None:
    """The first bytes of a plaintext connection: enough to tell HTTP/2's preface from an
    HTTP/1.1 request (one read, more only while they are a strict prefix of the preface);
    b"" when the client closed or broke, None when they did not come within
    `header_timeout` (answered 408 at once, as a head that does not arrive in time)."""
    data = b""
    with trio.move_on_after(limits.header_timeout):
        while True:
            try:
                chunk = await stream.receive_some(limits.read_size)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return data
            if not chunk:
                return data
            data += chunk
            n = len(data)
            if n >= len(PREFACE) or data != PREFACE[:n]:
                return data
    return None  # not even a whole preface (or request line start) in time: 408


class HttpFront:
    """A listening HTTP (or HTTPS) front that owns its connection tasks.

    `run(host, port)` / `serve(listeners)` return when cancelled or after `stop()`; every
    connection task lives in the front's nursery and ends with it.
    """

    def __init__(
        self,
        *,
        table: Callable[[], RouteTable],
        open_upstream: Opener,
        tls: TlsConfig | None = None,
        limits: Limits | None = None,
        stats: HttpStats | None = None,
        access_log: bool = False,
        describe_upstream: Describe | None = None,
        holds: HeldRequests | None = None,
        proxy: ProxyTrust | None = None,
        name: str = "http",
        unhealthy: Callable[[Backend], bool] | None = None,
    ) -> None:
        self.describe_upstream = describe_upstream
        """How the shared h2c upstream streams show their h2 streams in the debug views."""
        # PROXY v2 from trusted load balancers (the client's address for everything).
        self.proxy = proxy
        self.name = name
        self.table = table
        self.holds = holds
        self.open_upstream = open_upstream
        self.tls = tls
        self.limits = limits or Limits()
        self.stats = stats if stats is not None else HttpStats()
        self.balancer = Balancer(self.limits.failed_backend_cooldown, unhealthy=unhealthy)
        self.access_log = access_log
        self._ssl_context = tls.server_context() if tls is not None else None
        self._scope: trio.CancelScope | None = None
        self.pool: H2PoolSlot | None = None
        # drain(): keep-alive connections close after their current request.
        self.closing = GracefulClose()
        self.listeners: list[trio.SocketListener] = []
        self.per_client: dict[str, int] = {}
        """Open connections by `client_key`; a key goes when its count reaches zero."""

    async def run(
        self,
        host: str | None,
        port: int,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        await self.serve(listeners, task_status=task_status)

    async def serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self.listeners = listeners
        for listener in listeners:
            addr = listener.socket.getsockname()
            log.info(
                "http front listening", address=f"{addr[0]}:{addr[1]}", tls=self.tls is not None
            )
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                # The h2c backends' shared connections live as long as the front.
                self.pool = H2PoolSlot(nursery, self.open_upstream, self.limits,
                                       describe=self.describe_upstream)
                await nursery.start(
                    functools.partial(
                        trio.serve_listeners, self._handle, listeners, handler_nursery=nursery
                    )
                )
                task_status.started(listeners)
        finally:
            self._scope = None

    def stop(self) -> None:
        """Close the listeners and every connection (the run/serve call returns)."""
        if self._scope is not None:
            self._scope.cancel()

    def drain(self, *, close_idle: bool) -> None:
        """Finish keep-alive connections: every response from now on says `connection:
        close`; with `close_idle`, connections waiting for a next request close now."""
        if close_idle:
            self.closing.close_idle()
            if self.pool is not None:
                self.pool.drain()  # h2c upstreams close once their last stream ends
        else:
            self.closing.start()

    @property
    def port(self) -> int:
        """The port of the first listener (handy with port 0)."""
        return int(self.listeners[0].socket.getsockname()[1])

    async def _refuse_connection(self, stream: trio.SocketStream) -> None:
        if self._ssl_context is None:
            with trio.move_on_after(1.0):
                try:
                    await stream.send_all(_BUSY)  # fits any fresh socket's send buffer
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
        await trio.aclose_forcefully(stream)

    async def _handle(self, stream: trio.SocketStream) -> None:
        stats = self.stats
        limits = self.limits
        stats.connections_accepted += 1
        try:
            peer = stream.socket.getpeername()
            client_addr = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        except OSError:
            # Reset before we got to it: nothing to serve, and no address to judge trust
            # (a balancer's header would otherwise look like a client's).
            await trio.aclose_forcefully(stream)
            return
        if self.proxy is not None and isinstance(peer, tuple) and self.proxy.trusts(client_addr):
            # Before the caps and TLS: the balancer's header comes first and names the
            # client they count.
            header = await self.proxy.client_of(stream, (client_addr, int(peer[1])), self.name)
            if header is None or header.source is None:
                await trio.aclose_forcefully(stream)
                return
            client_addr = header.source[0]
        key = client_key(client_addr)
        per_client = self.per_client
        count = per_client.get(key, 0)
        total = limits.max_connections
        each = limits.max_connections_per_client
        if total is not None and stats.connections_open >= total:
            stats.refused(
                "connections_total", status=503, client=client_addr, detail=f"over {total} open"
            )
            await self._refuse_connection(stream)
            return
        if each is not None and count >= each:
            stats.refused(
                "connections_per_client",
                status=503,
                client=client_addr,
                detail=f"over {each} open from {key}",
            )
            await self._refuse_connection(stream)
            return
        per_client[key] = count + 1
        stats.connections_open += 1
        try:
            conn_stream: trio.abc.Stream = stream
            scheme = "http"
            h2: bool | None = None  # plaintext: h2c prior knowledge or HTTP/1.1
            if self._ssl_context is not None and self.tls is not None:
                ssl_stream = trio.SSLStream(
                    stream, self._ssl_context, server_side=True, https_compatible=True
                )
                ok = False
                with trio.move_on_after(self.tls.handshake_timeout):
                    try:
                        await ssl_stream.do_handshake()
                        ok = True
                    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                        log.info(
                            "tls handshake failed",
                            client=client_addr,
                            error=str(exc.__cause__ or exc),
                        )
                if not ok:
                    stats.tls_handshake_errors += 1
                    await trio.aclose_forcefully(stream)
                    return
                conn_stream = ssl_stream
                scheme = "https"
                h2 = ssl_stream.selected_alpn_protocol() == "h2"
            await serve_http_connection(
                conn_stream,
                table=self.table,
                open_upstream=self.open_upstream,
                scheme=scheme,
                client_addr=client_addr,
                limits=self.limits,
                stats=stats,
                balancer=self.balancer,
                access_log=self.access_log,
                closing=self.closing,
                pool=self.pool,
                h2=h2,
                holds=self.holds,
                proxy=self.proxy,
                listener=self.name,
            )
        except Exception as exc:
            # A bug here must cost one connection, not the listener and all its clients.
            log.error("http connection failed", error=repr(exc), exc_info=True)
        finally:
            stats.connections_open -= 1
            left = per_client[key] - 1
            if left:
                per_client[key] = left
            else:
                del per_client[key]


__all__ = ["HttpFront", "client_key", "serve_http_connection"]
