"""The HTTP/1.1 front: client connections in, routed by Host/path, relayed to upstreams.

`serve_http_connection` serves one client connection until it closes: h11 parses every
client request (all the protocol checks a public listener needs: framing, smuggling,
limits); the response is written directly from what the upstream codec (`h1`) validated,
and each keep-alive request gets a fresh h11 parser (cheaper than h11's own send path,
which re-validates every header: about a third of the per-request CPU it cost here);
`HttpFront` listens on TCP (optionally terminating TLS by SNI) and owns one task per
connection in its nursery. Upstream streams come from a caller-supplied opener
`open_upstream(backend, route)`, which raises `UpstreamUnavailable` when it cannot give
one: the front knows nothing about tunnels.

Per connection, in order: read a request head (timeouts: `header_timeout` from accept or
from the first byte of a request to its end → 408; `idle_timeout` between keep-alive
requests → silent close), look the route up in the table current at that moment, pick a
backend (reuse the connection's upstream if the route still lists its backend, else round
robin skipping backends that failed within `failed_backend_cooldown`), relay the request
and the response with bodies streamed both ways at the same time (bounded by one read
buffer per direction), then loop. A 101 response switches both sides to raw byte
splicing (WebSocket and other Upgrades). Every failure answers a short text/plain body
while no response byte has been sent, and closes the connection otherwise.

Header rewriting (RFC 9110 §7.6.1): hop-by-hop fields (Connection and the fields it
names, Keep-Alive, Proxy-Connection, TE, Trailer, Transfer-Encoding, Upgrade, Proxy-*) are
dropped both ways; h11 re-frames bodies itself. `Upgrade` and `Connection: upgrade` pass
for upgrade requests. `X-Forwarded-For` gets the client address appended;
`X-Forwarded-Proto` and `X-Forwarded-Host` are replaced (incoming values are not trusted).
Header names are forwarded lowercased, as h11 parses them. Response framing to the client:
the upstream's Content-Length is kept; an unknown length goes chunked to HTTP/1.1 clients
and until-close to HTTP/1.0 ones.

Performance notes (2-core VM, 1 KiB GETs, 16 keep-alive connections, bench_proxy): the
front does about half of what a bare trio byte relay does; of its CPU about a third is the
loopback socket syscalls themselves, the rest is shared by trio's I/O machinery, h11's
request parsing and this module. The hot path allocates one header list, one upstream
request head, one response head, and two cancel scopes per request.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

import h11
import trio

from nodeagent.http.errors import UpstreamUnavailable
from nodeagent.http.h1 import (
    NEED_DATA,
    ResponseHead,
    ResponseParser,
    UpstreamProtocolError,
    encode_chunk,
    encode_last_chunk,
    serialize_request,
)
from nodeagent.http.routes import Backend, Route, RouteTable
from nodeagent.http.tls import TlsConfig
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.http")

Opener = Callable[[Backend, Route], Awaitable[trio.abc.HalfCloseableStream]]

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_XF = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host"})
_CONNECTION_OPTIONS = frozenset({b"close", b"keep-alive", b"upgrade"})
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
_NEED_DATA = h11.NEED_DATA
_PAUSED = h11.PAUSED
_Data = h11.Data
_EOM = h11.EndOfMessage
_Response = h11.Response
_Info = h11.InformationalResponse
_Request = h11.Request


@dataclass(frozen=True, slots=True)
class Limits:
    """Sizes and deadlines of the front, in bytes and seconds."""

    max_header_bytes: int = 64 * 1024
    """Largest request or response head (h11 max_incomplete_event_size); over → 431/502."""
    max_body_bytes: int | None = None
    """Largest request body; None for no limit. Over → 413 (or close once streaming)."""
    header_timeout: float = 10.0
    """Accept (or first byte of a request) → complete request head; over → 408 and close."""
    idle_timeout: float = 60.0
    """Keep-alive wait for the next request, and longest stall inside a body."""
    dial_timeout: float = 10.0
    """One `open_upstream` call; over → 504 (after trying other backends)."""
    response_timeout: float = 60.0
    """Request sent → upstream response head; over → 504."""
    max_dial_attempts: int = 3
    """Backends tried for one request before answering with the last failure."""
    failed_backend_cooldown: float = 5.0
    """A backend whose dial failed is tried last for this long."""
    read_size: int = 64 * 1024
    """Bytes per receive: with one buffer per direction, the memory bound per connection."""


@dataclass(slots=True)
class HttpStats:
    """Counters for metrics; plain ints the server role exports (see `as_dict`)."""

    connections_accepted: int = 0
    connections_open: int = 0
    requests: int = 0
    responses_1xx: int = 0
    responses_2xx: int = 0
    responses_3xx: int = 0
    responses_4xx: int = 0
    responses_5xx: int = 0
    upstream_opens: int = 0
    upstream_reuses: int = 0
    upstream_errors: int = 0
    """Failed dials, broken upstreams and malformed upstream responses."""
    bad_requests: int = 0
    """Malformed requests from clients (400/431), counted apart from other 4xx."""
    timeouts: int = 0
    """Header (408), dial and response (504) timeouts."""
    upgrades: int = 0
    tls_handshake_errors: int = 0

    def count_status(self, status: int) -> None:
        if status < 200:
            self.responses_1xx += 1
        elif status < 300:
            self.responses_2xx += 1
        elif status < 400:
            self.responses_3xx += 1
        elif status < 500:
            self.responses_4xx += 1
        else:
            self.responses_5xx += 1

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Balancer:
    """Round robin over a route's backends, trying recently failed ones last.

    State is kept per route name (routes are rebuilt on every table swap) and per backend;
    both maps are cleared when they grow past `max_entries`, which only resets rotation.
    """

    def __init__(self, cooldown: float = 5.0, max_entries: int = 65536) -> None:
        self._cooldown = cooldown
        self._max = max_entries
        self._next: dict[str, int] = {}
        self._failed: dict[Backend, float] = {}

    def candidates(self, route: Route) -> Sequence[Backend]:
        backends = route.backends
        if len(backends) <= 1:
            return backends
        i = self._next.get(route.name, 0)
        if len(self._next) >= self._max:
            self._next.clear()
        self._next[route.name] = i + 1
        i %= len(backends)
        order = backends[i:] + backends[:i]
        if self._failed:
            now = time.monotonic()
            bad = [b for b in order if self._failed.get(b, 0.0) > now]
            if bad:
                order = tuple(b for b in order if b not in bad) + tuple(bad)
        return order

    def failed(self, backend: Backend) -> None:
        if len(self._failed) >= self._max:
            self._failed.clear()
        self._failed[backend] = time.monotonic() + self._cooldown

    def succeeded(self, backend: Backend) -> None:
        if self._failed:
            self._failed.pop(backend, None)


async def open_direct(backend: Backend, route: Route) -> trio.SocketStream:
    """An opener for backends the server reaches itself (`backend.node` is None)."""
    try:
        return await trio.open_tcp_stream(backend.host, backend.port)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise UpstreamUnavailable(502, f"cannot connect to {backend}: {reason}") from exc


class _ClientGone(Exception):
    """The client connection broke while we were writing to it."""


class _UpstreamFailed(Exception):
    def __init__(self, status: int, reason: str, stale: bool = False) -> None:
        super().__init__(status, reason)
        self.status = status
        self.reason = reason
        self.stale = stale  # a reused upstream that failed before any response byte


class _Upstream:
    __slots__ = ("backend", "parser", "request_done", "stream")

    def __init__(
        self, backend: Backend, stream: trio.abc.HalfCloseableStream, max_head: int
    ) -> None:
        self.backend = backend
        self.stream = stream
        self.parser = ResponseParser(max_head)
        self.request_done = False


class _UpstreamRequest:
    """What `_handle` prepared for the upstream: the head bytes and the body framing."""

    __slots__ = ("chunked", "head", "method")

    def __init__(self, method: bytes, head: bytes, chunked: bool) -> None:
        self.method = method
        self.head = head
        self.chunked = chunked


_REASONS = {
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


class _Connection:
    """One client connection: the h11 server state, the held upstream, the loop."""

    __slots__ = (
        "access_log",
        "balancer",
        "client_addr",
        "conn",
        "head_request",
        "http11",
        "keep",
        "limits",
        "opener",
        "scheme",
        "started",
        "stats",
        "stream",
        "table",
        "up",
        "xfp",
    )

    def __init__(
        self,
        stream: trio.abc.Stream,
        table: Callable[[], RouteTable],
        opener: Opener,
        scheme: str,
        client_addr: str,
        limits: Limits,
        stats: HttpStats,
        balancer: Balancer,
        access_log: bool,
    ) -> None:
        self.stream = stream
        self.table = table
        self.opener = opener
        self.scheme = scheme
        self.xfp = scheme.encode("ascii")
        self.client_addr = client_addr.encode("ascii", "replace")
        self.limits = limits
        self.stats = stats
        self.balancer = balancer
        self.access_log = access_log
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.up: _Upstream | None = None
        self.started = False  # the final response head went out: errors can only close
        self.keep = True  # the client connection may serve another request
        self.http11 = True
        self.head_request = False

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        graceful = True
        try:
            first = True
            while True:
                req = await self._read_request(first)
                if req is None:
                    return
                first = False
                keep = await self._handle(req)
                conn = self.conn
                if not keep or conn.their_state is not h11.DONE:
                    return
                # The response went out without h11 (see _relay_response), so instead of
                # start_next_cycle a fresh parser takes over the bytes already received.
                rest, eof = conn.trailing_data
                conn = self.conn = h11.Connection(h11.SERVER, self.limits.max_header_bytes)
                if rest:
                    conn.receive_data(bytes(rest))
                if eof:
                    conn.receive_data(b"")
        except _ClientGone:
            graceful = False
        finally:
            await self._close(graceful)

    async def _close(self, graceful: bool) -> None:
        stream = self.stream
        try:
            up, self.up = self.up, None
            if up is not None:
                await trio.aclose_forcefully(up.stream)
            if graceful and isinstance(stream, trio.abc.HalfCloseableStream):
                # Lingering close: half-close, then drain what the client still sends for a
                # moment, so that closing with unread input does not reset away our answer.
                with trio.move_on_after(1.0):
                    await stream.send_eof()
                    for _ in range(16):
                        if not await stream.receive_some(self.limits.read_size):
                            break
            elif graceful:
                with trio.move_on_after(1.0):
                    await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _receive(self) -> bytes:
        try:
            # trio may hand out a bytearray; h11 takes either (its stub says bytes).
            return cast(bytes, await self.stream.receive_some(self.limits.read_size))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _ClientGone() from exc

    async def _send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _ClientGone() from exc

    async def _read_request(self, first: bool) -> h11.Request | None:
        """The next request head, or None when the connection should just close."""
        conn = self.conn
        limits = self.limits
        try:
            event = conn.next_event()
            if event is _NEED_DATA and not first:
                # Keep-alive: wait quietly for the first byte of the next request.
                data = None
                with trio.move_on_after(limits.idle_timeout):
                    data = await self._receive()
                if data is None:
                    return None
                conn.receive_data(data)
                event = conn.next_event()
            if event is _NEED_DATA:
                with trio.move_on_after(limits.header_timeout):
                    while event is _NEED_DATA:
                        conn.receive_data(await self._receive())
                        event = conn.next_event()
                if event is _NEED_DATA:
                    self.stats.timeouts += 1
                    await self._error(408, "timed out waiting for the request headers")
                    return None
        except h11.RemoteProtocolError as exc:
            self.stats.bad_requests += 1
            status = exc.error_status_hint
            log.info("bad request", client=self.client_addr.decode(), status=status, error=str(exc))
            await self._error(status, f"malformed request: {exc}")
            return None
        if type(event) is _Request:
            return event
        return None  # ConnectionClosed, or PAUSED cannot happen in IDLE

    # -- one request --------------------------------------------------------------------

    async def _handle(self, req: h11.Request) -> bool:
        stats = self.stats
        stats.requests += 1
        method = req.method
        self.started = False
        self.head_request = method == b"HEAD"
        self.http11 = req.http_version == b"1.1"
        target = req.target
        host = b""
        chunked = False
        upgrade: bytes | None = None
        connection: list[bytes] | None = None
        xff: bytes | None = None
        content_length = -1
        headers: list[tuple[bytes, bytes]] = []
        for name, value in req.headers:
            if name in _HOP_BY_HOP or name.startswith(b"proxy-"):
                if name == b"connection":
                    if connection is None:
                        connection = []
                    connection.extend(t.strip().lower() for t in value.split(b","))
                elif name == b"transfer-encoding":
                    chunked = True
                elif name == b"upgrade":
                    upgrade = value
                continue
            if name in _XF:
                if name == b"x-forwarded-for":
                    xff = value if xff is None else xff + b", " + value
                continue
            if name == b"host":
                host = value
            elif name == b"content-length":
                content_length = int(value)
            headers.append((name, value))

        self.keep = self.http11 and not (connection is not None and b"close" in connection)
        if target[:1] != b"/" and target != b"*":
            # Absolute form (RFC 9112 §3.2.2): its authority replaces Host.
            scheme_end = target.find(b"://")
            if scheme_end > 0:
                rest = target[scheme_end + 3 :]
                slash = rest.find(b"/")
                authority, target = (rest, b"/") if slash < 0 else (rest[:slash], rest[slash:])
                host = authority
                headers = [(n, v) for n, v in headers if n != b"host"]
                headers.append((b"host", host))
        if method == b"CONNECT":
            await self._error(405, "CONNECT is not served on this listener", req)
            return False

        host_s = host.decode("latin-1")
        path_s = target.decode("latin-1")
        match = self.table().lookup(host_s, path_s)
        if match is None:
            return await self._error(404, f"no route for {host_s}{path_s}", req)
        route = match.route
        if route.tls_redirect and self.scheme == "http":
            return await self._redirect(host_s, path_s)
        if not route.backends:
            return await self._error(503, f"route {route.name} has no ready backends", req)
        max_body = self.limits.max_body_bytes
        if max_body is not None and content_length > max_body:
            return await self._error(413, f"request body over {max_body} bytes", req)

        if connection is not None:
            dropped = [t for t in connection if t not in _CONNECTION_OPTIONS]
            if dropped:
                headers = [(n, v) for n, v in headers if n not in dropped]
        if upgrade is not None and connection is not None and b"upgrade" in connection:
            headers.append((b"connection", b"upgrade"))
            headers.append((b"upgrade", upgrade))
        else:
            upgrade = None
        if not host:
            headers.append((b"host", route.backends[0].host.encode("idna")))
        client = self.client_addr
        headers.append((b"x-forwarded-for", client if xff is None else xff + b", " + client))
        headers.append((b"x-forwarded-proto", self.xfp))
        if host:
            headers.append((b"x-forwarded-host", host))
        if chunked:
            headers = [(n, v) for n, v in headers if n != b"content-length"]
            headers.append((b"transfer-encoding", b"chunked"))
        up_req = _UpstreamRequest(method, serialize_request(method, target, headers), chunked)

        try:
            # Does the request have a body? h11 answers EndOfMessage at once if not.
            first_body = self.conn.next_event()
        except h11.RemoteProtocolError as exc:
            stats.bad_requests += 1
            return await self._error(400, f"malformed request body: {exc}", req)
        replayable = type(first_body) is _EOM and method in _IDEMPOTENT
        status = 0
        try:
            for attempt in (0, 1):
                try:
                    up, reused = await self._upstream(route)
                except _UpstreamFailed as exc:
                    return await self._error(exc.status, exc.reason, req)
                try:
                    status = await self._exchange(
                        up, up_req, first_body, upgrade is not None, reused
                    )
                    break
                except _UpstreamFailed as exc:
                    self.up = None
                    await trio.aclose_forcefully(up.stream)
                    if exc.stale and replayable and attempt == 0:
                        continue  # the kept-alive upstream had closed: dial a fresh one
                    stats.upstream_errors += 1
                    self.balancer.failed(up.backend)
                    if not self.started:
                        return await self._error(exc.status, exc.reason, req)
                    log.info(
                        "upstream broke mid-response",
                        host=host_s,
                        path=path_s,
                        backend=str(up.backend),
                        error=exc.reason,
                    )
                    return False
        except _BodyTooLarge:
            if not self.started:
                return await self._error(413, f"request body over {max_body} bytes", req)
            return False
        except _BadBody as exc:
            stats.bad_requests += 1
            if not self.started:
                return await self._error(400, f"malformed request body: {exc}", req)
            return False
        if self.access_log:
            log.info(
                "request routed",
                host=host_s,
                path=path_s,
                node=self.up.backend.node if self.up else None,
                status=status,
            )
        return self.keep and status != 101

    async def _upstream(self, route: Route) -> tuple[_Upstream, bool]:
        """An upstream for `route` and whether it is a kept-alive one."""
        held = self.up
        if held is not None:
            if held.backend in route.backends:
                self.stats.upstream_reuses += 1
                return held, True
            self.up = None
            await trio.aclose_forcefully(held.stream)
        limits = self.limits
        failure = _UpstreamFailed(502, f"route {route.name}: no backend could be reached")
        candidates = self.balancer.candidates(route)
        for backend in candidates[: limits.max_dial_attempts]:
            try:
                with trio.fail_after(limits.dial_timeout):
                    stream = await self.opener(backend, route)
            except trio.TooSlowError:
                self.stats.timeouts += 1
                failure = _UpstreamFailed(
                    504, f"dialing {backend} timed out after {limits.dial_timeout:g}s"
                )
            except UpstreamUnavailable as exc:
                failure = _UpstreamFailed(exc.status, exc.reason)
            except OSError as exc:
                reason = exc.strerror or str(exc) or type(exc).__name__
                failure = _UpstreamFailed(502, f"cannot connect to {backend}: {reason}")
            else:
                self.stats.upstream_opens += 1
                self.balancer.succeeded(backend)
                up = self.up = _Upstream(backend, stream, limits.max_header_bytes)
                return up, False
            self.stats.upstream_errors += 1
            self.balancer.failed(backend)
            log.info(
                "upstream unavailable",
                route=route.name,
                backend=str(backend),
                status=failure.status,
                reason=failure.reason,
            )
        raise failure

    async def _exchange(
        self,
        up: _Upstream,
        req: _UpstreamRequest,
        first_body: Any,
        upgrade: bool,
        reused: bool,
    ) -> int:
        """Send the request, relay the response; returns its status. Keeps `up` if reusable."""
        up.request_done = False
        up.parser.start(req.method == b"HEAD")
        if type(first_body) is _EOM:
            head = req.head + encode_last_chunk(first_body.headers) if req.chunked else req.head
            up.request_done = True
            await self._up_send(up, head, stale=reused)
            status = await self._relay_response(up, upgrade, reused)
        else:
            await self._up_send(up, req.head, stale=reused)
            body_state: list[BaseException | None] = [None]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    self._pump_body, up, req.chunked, first_body, body_state, nursery
                )
                status = await self._relay_response(up, upgrade, reused)
                nursery.cancel_scope.cancel()
            if body_state[0] is not None:
                raise body_state[0]
        if status == 101:
            return status
        if not (up.request_done and up.parser.reusable):
            self.up = None
            await trio.aclose_forcefully(up.stream)
        return status

    async def _up_send(self, up: _Upstream, data: bytes, stale: bool = False) -> None:
        try:
            await up.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _UpstreamFailed(
                502, f"upstream {up.backend} closed the connection", stale=stale
            ) from exc

    async def _pump_body(
        self,
        up: _Upstream,
        chunked: bool,
        event: Any,
        state: list[BaseException | None],
        nursery: trio.Nursery,
    ) -> None:
        """Client request body → upstream, until EndOfMessage. Failures stop the exchange."""
        conn = self.conn
        limits = self.limits
        max_body = limits.max_body_bytes
        seen = 0
        try:
            while True:
                if event is _NEED_DATA:
                    with trio.move_on_after(limits.idle_timeout):
                        conn.receive_data(await self._receive())
                        event = conn.next_event()
                        continue
                    raise _BadBody(f"no request body data for {limits.idle_timeout:g}s")
                t = type(event)
                if t is _Data:
                    data = event.data
                    seen += len(data)
                    if max_body is not None and seen > max_body:
                        raise _BodyTooLarge()
                    if chunked:
                        data = encode_chunk(data)
                    await self._up_send(up, data)
                elif t is _EOM:
                    if chunked:
                        await self._up_send(up, encode_last_chunk(event.headers))
                    up.request_done = True
                    return
                else:  # ConnectionClosed: the client went away mid-body
                    raise _ClientGone()
                event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            state[0] = _BadBody(str(exc))
        except (_BadBody, _BodyTooLarge, _ClientGone, _UpstreamFailed) as exc:
            state[0] = exc
        nursery.cancel_scope.cancel()

    async def _relay_response(self, up: _Upstream, upgrade: bool, reused: bool) -> int:
        """Upstream response → client, batching each read's output into one write."""
        parser = up.parser
        ustream = up.stream
        limits = self.limits
        out: list[bytes] = []
        status = 0
        chunked = False
        event: Any
        timeout = limits.response_timeout
        got_any = not reused  # a fresh upstream's silence is not a stale keep-alive
        try:
            while True:
                event = parser.next()
                if event is NEED_DATA:
                    if out:
                        await self._send(b"".join(out))
                        out.clear()
                    data = b""
                    with trio.move_on_after(timeout):
                        try:
                            data = cast(bytes, await ustream.receive_some(limits.read_size))
                        except (
                            trio.BrokenResourceError,
                            trio.ClosedResourceError,
                            OSError,
                        ) as exc:
                            raise _UpstreamFailed(
                                502, f"upstream {up.backend} broke: {exc}", stale=not got_any
                            ) from exc
                        if not data and status == 0:
                            raise _UpstreamFailed(
                                502,
                                f"upstream {up.backend} closed the connection without answering",
                                stale=not got_any,
                            )
                        got_any = True
                        parser.feed(data)
                        continue
                    self.stats.timeouts += 1
                    raise _UpstreamFailed(
                        504, f"upstream {up.backend} timed out after {timeout:g}s"
                    )
                t = type(event)
                if t is bytes:
                    out.append(encode_chunk(event) if chunked else event)
                elif t is ResponseHead:
                    status = event.status
                    if status >= 200:
                        self.stats.count_status(status)
                        timeout = limits.idle_timeout
                        headers = _response_headers(event.headers)
                        if not self.head_request and status not in (204, 304) and parser.length < 0:
                            # Unknown length: chunked to HTTP/1.1 clients, else until close.
                            if self.http11:
                                chunked = True
                                headers = [(n, v) for n, v in headers if n != b"content-length"]
                                headers.append((b"transfer-encoding", b"chunked"))
                            else:
                                self.keep = False
                        if not self.keep:
                            headers.append((b"connection", b"close"))
                        self.started = True
                        out.append(_status_head(status, event.reason, headers))
                    elif status == 101:
                        if not upgrade:
                            raise _UpstreamFailed(
                                502, f"upstream {up.backend} switched protocols unasked"
                            )
                        self.stats.count_status(101)
                        self.started = True
                        out.append(_switch_head(event))
                        await self._send(b"".join(out))
                        await self._splice(up)
                        return 101
                    else:
                        out.append(
                            _status_head(status, event.reason, _response_headers(event.headers))
                        )
                else:  # END
                    if chunked:
                        out.append(encode_last_chunk(parser.trailers))
                    await self._send(b"".join(out))
                    return status
        except UpstreamProtocolError as exc:
            raise _UpstreamFailed(
                502, f"upstream {up.backend} sent a malformed response: {exc}"
            ) from exc

    async def _splice(self, up: _Upstream) -> None:
        """After a 101: raw bytes both ways, with each side's leftover h11 input first."""
        self.stats.upgrades += 1
        self.up = None  # the upstream now belongs to this upgraded connection only
        client_rest, _ = self.conn.trailing_data
        up_rest = up.parser.rest()
        client = self.stream
        upstream = up.stream
        size = self.limits.read_size

        async def pump(src: trio.abc.Stream, dst: trio.abc.Stream, rest: bytes) -> None:
            try:
                if rest:
                    await dst.send_all(rest)
                while True:
                    data = await src.receive_some(size)
                    if not data:
                        break
                    await dst.send_all(data)
                if isinstance(dst, trio.abc.HalfCloseableStream):
                    await dst.send_eof()
                    return
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            # The peer cannot be half-closed (TLS) or broke: end both directions.
            nursery.cancel_scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, upstream, client_rest)
                nursery.start_soon(pump, upstream, client, up_rest)
        finally:
            await trio.aclose_forcefully(upstream)

    # -- answers made here ------------------------------------------------------------------

    async def _error(self, status: int, reason: str, req: h11.Request | None = None) -> bool:
        """A short text/plain answer; returns whether the connection can go on."""
        conn = self.conn
        if self.started or conn.our_state not in (h11.SEND_RESPONSE, h11.IDLE):
            return False
        keep = self.keep and conn.their_state is h11.DONE and status not in (400, 408, 413, 431)
        body = f"{status} {_REASONS.get(status, '')}: {reason}\n".encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
        ]
        if not keep:
            headers.append((b"connection", b"close"))
        self.stats.count_status(status)
        if status >= 500 or status in (404, 503):
            log.info(
                "request failed",
                status=status,
                reason=reason,
                client=self.client_addr.decode(),
                method=req.method.decode("latin-1") if req is not None else None,
            )
        try:
            # From IDLE too: h11 lets a server answer a request it could not parse.
            data = conn.send(
                h11.Response(
                    status_code=status, headers=headers, reason=_REASONS.get(status, "").encode()
                )
            )
            assert data is not None
            data += conn.send(h11.Data(data=body)) or b""
            data += conn.send(_EOM()) or b""
        except h11.LocalProtocolError:
            return False
        await self._send(data)
        return keep

    async def _redirect(self, host: str, target: str) -> bool:
        from nodeagent.http.routes import normalize_host

        location = f"https://{normalize_host(host)}{target}"
        body = f"308 Permanent Redirect: {location}\n".encode()
        headers = [
            (b"location", location.encode("latin-1")),
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
        ]
        keep = self.keep and self.conn.their_state is h11.DONE
        if not keep:
            headers.append((b"connection", b"close"))
        self.stats.count_status(308)
        conn = self.conn
        data = conn.send(h11.Response(status_code=308, headers=headers))
        assert data is not None
        data += conn.send(h11.Data(data=body)) or b""
        data += conn.send(_EOM()) or b""
        await self._send(data)
        return keep


class _BodyTooLarge(Exception):
    pass


class _BadBody(Exception):
    pass


def _status_head(status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """A response head written directly: the upstream codec validated every name and value."""
    parts = [b"HTTP/1.1 %d %b\r\n" % (status, reason)]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _switch_head(event: ResponseHead) -> bytes:
    headers = [(n, v) for n, v in event.headers if n not in _HOP_BY_HOP]
    headers.append((b"connection", b"upgrade"))
    upgrade = [v for n, v in event.headers if n == b"upgrade"]
    if upgrade:
        headers.append((b"upgrade", upgrade[0]))
    return _status_head(101, event.reason, headers)


def _response_headers(headers: Any) -> list[tuple[bytes, bytes]]:
    connection: list[bytes] | None = None
    out: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name in _HOP_BY_HOP or name.startswith(b"proxy-"):
            if name == b"connection":
                if connection is None:
                    connection = []
                connection.extend(t.strip().lower() for t in value.split(b","))
            continue
        out.append((name, value))
    if connection is not None:
        dropped = [t for t in connection if t not in _CONNECTION_OPTIONS]
        if dropped:
            out = [(n, v) for n, v in out if n not in dropped]
    return out


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
) -> None:
    """Serve one client connection until it closes; closes `stream` (and upstreams) at the end.

    `table` is called for every request, so the owner swaps routes by changing what it
    returns. Never raises for anything a client or upstream does; cancellation propagates.
    """
    limits = limits or Limits()
    await _Connection(
        stream,
        table,
        open_upstream,
        scheme,
        client_addr,
        limits,
        stats if stats is not None else HttpStats(),
        balancer if balancer is not None else Balancer(limits.failed_backend_cooldown),
        access_log,
    ).run()


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
    ) -> None:
        self.table = table
        self.open_upstream = open_upstream
        self.tls = tls
        self.limits = limits or Limits()
        self.stats = stats if stats is not None else HttpStats()
        self.balancer = Balancer(self.limits.failed_backend_cooldown)
        self.access_log = access_log
        self._ssl_context = tls.server_context() if tls is not None else None
        self._scope: trio.CancelScope | None = None
        self.listeners: list[trio.SocketListener] = []

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

    @property
    def port(self) -> int:
        """The port of the first listener (handy with port 0)."""
        return int(self.listeners[0].socket.getsockname()[1])

    async def _handle(self, stream: trio.SocketStream) -> None:
        stats = self.stats
        stats.connections_accepted += 1
        stats.connections_open += 1
        try:
            try:
                peer = stream.socket.getpeername()
                client_addr = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            except OSError:
                client_addr = "unknown"
            conn_stream: trio.abc.Stream = stream
            scheme = "http"
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
            )
        except Exception as exc:
            # A bug here must cost one connection, not the listener and all its clients.
            log.error("http connection failed", error=repr(exc), exc_info=True)
        finally:
            stats.connections_open -= 1


__all__ = [
    "Balancer",
    "HttpFront",
    "HttpStats",
    "Limits",
    "Opener",
    "open_direct",
    "serve_http_connection",
]
