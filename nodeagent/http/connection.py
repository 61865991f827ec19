"""One client connection of the HTTP front: its request loop, request by request.

`HttpConnection` serves one client connection until it closes (its entry point is
`front.serve_http_connection`). One `request.RequestReader` per connection parses every
client request (llhttp for plain heads, h11 for everything else: all the protocol checks a
public listener needs, framing, smuggling, limits); responses, the front's own answers
included, are written directly from what the upstream codec (`h1`) validated (h11's send
path re-validates every header: about a third of the per-request CPU it cost here).
Upstream streams come from a caller-supplied opener `open_upstream(backend, route,
client)`, which raises `UpstreamUnavailable` when it cannot give one: nothing here knows
about tunnels.

Per request, in named steps:
1. read the head (timeouts: `header_timeout` from accept or from the first byte of a
   request to its end → 408; `idle_timeout` between keep-alive requests → silent close;
   over `max_header_fields` fields or `max_header_bytes` → 431);
2. policy (`_route`): `headers.read_request` reads it (pure);
3. route (`_route`): `dispatch.route_request` looks it up in the table current at that
   moment (pure; a `Refusal` is a 404/405/308/503/413 answered by `_refuse`), then the
   route's gate, if it has one (`gate`: rate limits and authentication → 429/401/403);
4. forward with retry (`_forward`): pick an upstream (reuse the connection's own if the
   route still lists its backend, else the `Balancer`'s order, at most
   `max_dial_attempts`), send the request and relay the response with bodies streamed both
   ways at the same time (bounded by one read buffer per direction; a body slower than
   `min_body_rate` after `body_grace` → 408, close, upstream reset); an idempotent request
   without a body is sent once more on a fresh upstream when a kept-alive one turns out to
   have closed. A 101 response hands both sides to `tunnel.splice` (WebSocket and other
   Upgrades). A route whose backends speak h2c goes instead through `_forward_h2c`: a
   stream on the backend's shared connection (`h2pool`), the response back as HTTP/1.1.
Every failure answers a short text/plain body while no response byte has been sent, and
closes the connection otherwise. (At ~950 lines this is well over the ~600 the project
aims for: it is one state machine whose steps share the connection's buffers and parser
state. The next cut is the body pump and the two response relays, HTTP/1.1 and h2c, into
a module of their own behind a small interface.) Refusals that protect the front
(`_reject`) are also
counted by reason and logged rate-limited (`HttpStats.refused`).

Performance (`python -m scripts.bench.http_front` measures the front against a bare
trio byte relay; docs/performance.md has today's figures): much of the front's CPU is
the loopback syscalls and trio's I/O machinery, which is why heads are parsed with
llhttp and responses written without h11's re-validation.
The hot path allocates one header list, one upstream request head, one response head, one
`ClientRequest` per request, and no cancel scope of its own: the response timeout moves
the deadline of the connection's one timer scope, and the keep-alive wait enters its
scope only when the next request is not there yet. A request without a body runs in the
connection's task (only a request body gets a second task, to stream both ways at once).
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import trio

from nodeagent.http.balancer import Balancer
from nodeagent.http.dispatch import Refusal, route_request
from nodeagent.http.exchange import ResponseEnd, ResponseStart
from nodeagent.http.h1 import (
    NEED_DATA,
    ResponseHead,
    UpstreamProtocolError,
    encode_chunk,
    encode_last_chunk,
    serialize_request,
)
from nodeagent.http.headers import (
    ClientRequest,
    frame_response,
    read_request,
    request_head_size,
    response_head,
    switch_response,
    upstream_headers,
)
from nodeagent.http.holds import HeldRequests, dial_woken
from nodeagent.http.limits import Limits
from nodeagent.http.paths import clip
from nodeagent.http.request import (
    BadRequest,
    EndOfRequest,
    RequestHead,
    RequestReader,
)
from nodeagent.http.routetable import Route, RouteTable
from nodeagent.http.stats import HttpStats, RefusalReason
from nodeagent.http.upstream import (
    Opener,
    Upstream,
    UpstreamFailed,
    UpstreamRequest,
    dial_upstream,
)
from nodeagent.ops.logs import get_logger
from tunnel.splice import splice

if TYPE_CHECKING:
    # The h2c path's modules load when a route first needs them (`ondemand`).
    from nodeagent.http.h2pool import H2cExchange
    from nodeagent.http.ondemand import H2PoolSlot

log = get_logger("nodeagent.http")

_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})


class _ClientGone(Exception):
    """The client connection broke while we were writing to it."""


class _BodyTooLarge(Exception):
    pass


class _BadBody(Exception):
    def __init__(self, detail: str, reason: RefusalReason) -> None:
        super().__init__(detail)
        self.reason: RefusalReason = reason


class _SlowBody(Exception):
    pass


_REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


class GracefulClose:
    """A front's connections told to finish (a server draining): from `start()` every
    response says `connection: close`, so clients busy on a keep-alive connection move to
    a new one (which the balancer sends elsewhere) after their current request; from
    `close_idle()` connections waiting for a next request close too. Without it a draining
    server's keep-alive connections hold their tunnel streams open until the drain grace
    ends and are then reset under the client (measured: 6 failed requests per rollout
    with keep-alive clients)."""

    __slots__ = ("idle", "idle_closed", "on_start", "started")

    def __init__(self) -> None:
        self.started = False
        self.idle_closed = False
        self.idle: set[trio.CancelScope] = set()  # keep-alive waits, cancelled on close_idle
        self.on_start: set[Callable[[], None]] = set()
        """Called once at `start()`: HTTP/2 connections send GOAWAY at once (a long gRPC
        stream may never give them a response to say `connection: close` on)."""

    def start(self) -> None:
        if not self.started:
            self.started = True
            for callback in list(self.on_start):
                callback()

    def close_idle(self) -> None:
        self.start()
        self.idle_closed = True
        for scope in self.idle:
            scope.cancel()


class HttpConnection:
    """One client connection: its request reader, the held upstream, the loop."""

    __slots__ = (
        "access_log",
        "balancer",
        "client_addr",
        "closing",
        "creq",
        "fd",
        "head_request",
        "holds",
        "http11",
        "keep",
        "limits",
        "opener",
        "pool",
        "reader",
        "req",
        "route",
        "scheme",
        "started",
        "stats",
        "status",
        "stream",
        "table",
        "timer",
        "unyielded",
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
        closing: GracefulClose | None = None,
        pool: H2PoolSlot | None = None,
        holds: HeldRequests | None = None,
    ) -> None:
        self.stream = stream
        # A plaintext client's socket, read and written directly (`_receive`, `_send`)
        # through its descriptor, kept: trio's `fileno()` is a Python method (~1.5 % of
        # the CPU of a request through the tunnel, two or three calls a request). Only
        # this connection closes the socket (`_close`, after its last read and write), so
        # the number cannot name another socket while it is used here.
        self.fd = stream.socket.fileno() if type(stream) is trio.SocketStream else -1
        self.unyielded = 0  # writes since this task last let others run (`_send`)
        self.pool = pool
        self.holds = holds
        self.closing = closing if closing is not None else GracefulClose()
        self.table = table
        self.opener = opener
        self.scheme = scheme
        self.xfp = scheme.encode("ascii")
        self.client_addr = client_addr.encode("ascii", "replace")
        self.limits = limits
        self.stats = stats
        self.balancer = balancer
        self.access_log = access_log
        self.reader = RequestReader(limits.max_header_bytes)
        self.timer = trio.CancelScope()  # the response timeout's (`run`)
        self.req: RequestHead | None = None  # the request being served
        self.route: Route | None = None  # its route, once routed to one
        self.up: Upstream | None = None
        self.creq: ClientRequest  # the request being served, as `read_request` read it
        self.started = False  # the final response head went out: errors can only close
        self.status = 0  # the status answered to the request being served
        self.keep = True  # the client connection may serve another request
        self.http11 = True
        self.head_request = False

    # -- the loop -------------------------------------------------------------------------

    async def run(self, initial: bytes = b"", timed_out: bool = False) -> None:
        """Serve requests until the connection ends. `initial`: bytes the front already
        read (sniffing for HTTP/2's preface); `timed_out`: none came within the header
        timeout, answer 408 at once."""
        graceful = True
        try:
            if timed_out:
                await self._reject(
                    "head_timeout", 408, "timed out waiting for the request headers"
                )
                return
            first = True
            pending = len(initial)  # bytes of the next request already received
            if initial:
                self.reader.feed(initial)
            while True:
                # The response timeout: one cancel scope for the connection, its deadline
                # set while `_relay_response` waits for the upstream and infinite otherwise
                # (moving it costs about half of entering and leaving a scope of its own,
                # ~3 µs a request). When it fires, the request being served unwinds to
                # here and is answered as `_forward` answers a failed upstream.
                timer = self.timer = trio.CancelScope()
                with timer:
                    while True:
                        req = self.req = await self._read_request(first, pending)
                        if req is None:
                            return
                        first = False
                        # The request's steps: policy and route (no I/O), then forward.
                        route = self._route(req)
                        if route.gate is not None:  # rate limits, auth (gate.py)
                            route = await route.gate.admit(
                                route, self.creq, self.client_addr.decode()
                            )
                        if type(route) is Route:
                            if route.wake is None or self.holds is None:
                                keep = await self._forward_route(req, route)
                            else:
                                keep = await self._forward_counted(req, route)
                        else:
                            assert type(route) is Refusal
                            if route.wake is not None and self.holds is not None:
                                keep = await self._hold(req, route)
                            else:
                                keep = await self._refuse(route, req)
                        reader = self.reader
                        if not keep or not reader.done:
                            return
                        pending = reader.start_next()
                keep = await self._response_timed_out()
                reader = self.reader
                if not keep or not reader.done:
                    return
                pending = reader.start_next()
                first = False
        except _ClientGone:
            graceful = False
        finally:
            await self._close(graceful)

    async def _response_timed_out(self) -> bool:
        """The response timeout fired (`timer`): the upstream is closed and counted as
        failed, and the client answered 504 if no response head went out yet, else the
        connection closes (what `_forward` does with an `UpstreamFailed`)."""
        stats = self.stats
        stats.timeouts += 1
        stats.upstream_errors += 1
        limits = self.limits
        timeout = limits.idle_timeout if self.started else limits.response_timeout
        up, self.up = self.up, None
        backend = "" if up is None else f" {up.backend}"
        reason = f"upstream{backend} timed out after {timeout:g}s"
        if up is not None:
            await trio.aclose_forcefully(up.stream)
            self.balancer.failed(up.backend)
        if self.started:
            creq = self.creq
            log.info(
                "upstream broke mid-response",
                host=clip(creq.host.decode("latin-1")),
                path=clip(creq.target.decode("latin-1")),
                backend=backend.strip(),
                error=reason,
            )
            keep = False
        else:
            keep = await self._error(504, reason, self.req)
        if self.route is not None:
            stats.count_route(self.route.name, "h1", self.status)
        return keep

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

    def _read_now(self) -> bytes | None:
        """A plaintext client's bytes already received (b"" when it closed), without
        waiting; None when there are none yet, or for a TLS client (never read here)."""
        fd = self.fd
        if fd < 0:
            return None
        try:
            return os.read(fd, self.limits.read_size)
        except BlockingIOError:
            return None
        except OSError as exc:  # reset
            raise _ClientGone() from exc

    async def _receive(self) -> bytes:
        """The client's next bytes (b"" when it closed)."""
        if self.fd >= 0:
            # A plaintext client: the socket read directly, as trio's SocketStream would
            # (try, else wait until readable) without its layers. Trying first pays: with
            # many connections the next request is often there by the time the front
            # looks (waiting for readiness first measured ~3 % more instructions).
            data = self._read_now()
            if data is not None:
                self.unyielded = 0
                await trio.lowlevel.cancel_shielded_checkpoint()  # as trio's own does
                return data
            return await self._wait_receive(self.fd)
        try:
            # trio may hand out a bytearray; the reader takes either.
            return cast(bytes, await self.stream.receive_some(self.limits.read_size))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _ClientGone() from exc

    async def _wait_receive(self, fd: int) -> bytes:
        """A plaintext client's next bytes, once its socket is readable."""
        self.unyielded = 0
        while True:
            try:
                await trio.lowlevel.wait_readable(fd)
                return os.read(fd, self.limits.read_size)
            except BlockingIOError:
                continue
            except (trio.ClosedResourceError, OSError) as exc:
                raise _ClientGone() from exc

    async def _send(self, data: bytes) -> None:
        fd = self.fd
        if fd >= 0:
            # A plaintext client: written directly when its socket takes it all (the
            # common case), without trio's send_all layers and their task switch (~7 µs a
            # request); what it does not take goes through send_all, which waits. Every
            # 16th write in a row without a wait in between still lets other tasks run
            # (a response whose pieces are all ready at once would otherwise never wait).
            try:
                sent = os.write(fd, data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise _ClientGone() from exc
            if sent == len(data):
                self.unyielded += 1
                if self.unyielded >= 16:
                    self.unyielded = 0
                    await trio.lowlevel.checkpoint()
                return
            data = memoryview(data)[sent:]  # type: ignore[assignment]
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _ClientGone() from exc

    async def _read_request(self, first: bool, received: int) -> RequestHead | None:
        """The next request head, or None when the connection should just close.

        `received`: bytes of it already fed to the parser (pipelined after the last one).
        """
        reader = self.reader
        limits = self.limits
        try:
            event = reader.next()
            if event is NEED_DATA and not first:
                # Keep-alive: wait quietly for the first byte of the next request.
                closing = self.closing
                if closing.idle_closed:
                    return None
                # A plaintext client's next request is often there already (about two
                # times in three with 16 busy connections): read it without the idle
                # timeout's cancel scope, which only a wait needs (~5 µs a request), and
                # without a schedule point, as a request already in the reader's buffer
                # (pipelined) is served: a request served on a kept-alive connection
                # waits for its upstream's answer, where others run (the front's own
                # answers close the connection, `reader.done` being false).
                data = self._read_now()
                if data is None:
                    fd = self.fd
                    with trio.move_on_after(limits.idle_timeout) as idle:
                        closing.idle.add(idle)
                        try:
                            if fd >= 0:  # nothing there: wait for it
                                data = await self._wait_receive(fd)
                            else:
                                data = await self._receive()
                        finally:
                            closing.idle.discard(idle)
                    if data is None:
                        return None
                received += len(data)
                reader.feed(data)
                event = reader.next()
            if event is NEED_DATA:
                with trio.move_on_after(limits.header_timeout):
                    while event is NEED_DATA:
                        data = await self._receive()
                        received += len(data)
                        reader.feed(data)
                        event = reader.next()
                if event is NEED_DATA:
                    await self._reject(
                        "head_timeout", 408, "timed out waiting for the request headers"
                    )
                    return None
        except BadRequest as exc:
            self.head_request = False
            status = exc.status
            await self._reject(
                "head_too_large" if status == 431 else exc.reason,
                status,
                f"malformed request: {clip(str(exc))}",
            )
            return None
        if type(event) is not RequestHead:
            return None  # CLOSED (PAUSED cannot happen before a request)
        # The reader bounds a head only while it is incomplete: one that arrived whole is measured
        # here, and only when more bytes than the limit arrived (never for most requests).
        if len(event.headers) > limits.max_header_fields:
            await self._reject(
                "too_many_fields", 431, f"over {limits.max_header_fields} header fields"
            )
            return None
        max_head = limits.max_header_bytes
        if received > max_head and (
            request_head_size(event.method, event.target, event.headers) > max_head
        ):
            await self._reject("head_too_large", 431, f"request head over {max_head} bytes")
            return None
        return event

    # -- one request --------------------------------------------------------------------

    def _route(self, req: RequestHead) -> Route | Refusal:
        """Policy, then route: read the request (`headers`), look it up (`dispatch`).

        Not a coroutine: on this path each await level costs at every later suspension.
        """
        self.stats.requests += 1
        self.started = False
        self.head_request = req.method == b"HEAD"
        self.http11 = req.http_version == b"1.1"
        creq = self.creq = read_request(req.http_version, req.target, req.headers)
        self.keep = creq.keep_alive and not self.closing.started
        if creq.chunked and creq.content_length >= 0:
            self.stats.ambiguous_framing += 1  # served by Transfer-Encoding, then closed
        return route_request(
            self.table(),
            req.method,
            creq,
            https=self.scheme != "http",
            max_body=self.limits.max_body_bytes,
        )

    def _count_status(self, status: int) -> None:
        self.status = status
        self.stats.count_status(status)

    async def _refuse(self, refusal: Refusal, req: RequestHead) -> bool:
        if refusal.location is not None:
            return await self._redirect(refusal.location)
        if refusal.code is not None:
            keep = await self._reject(refusal.code, refusal.status, refusal.reason, req,
                                      retry_after=refusal.retry_after, headers=refusal.headers)
        else:
            keep = await self._error(refusal.status, refusal.reason, req,
                                     retry_after=refusal.retry_after)
        return keep and not refusal.close

    async def _hold(self, req: RequestHead, refusal: Refusal) -> bool:
        """A request for a sleeping route: held until it wakes (`holds.py`), then
        forwarded, or answered what holding came to (504, 503, 502)."""
        assert self.holds is not None and refusal.wake is not None
        if refusal.wake.starting_page and _wants_html(req):
            self.holds.poke(refusal.wake)
            return await self._starting_page(refusal)
        deadline = trio.current_time() + refusal.wake.timeout
        creq, method, https = self.creq, req.method, self.scheme != "http"
        max_body = self.limits.max_body_bytes

        def recheck() -> Route | Refusal:
            return route_request(self.table(), method, creq, https=https, max_body=max_body)

        outcome = await self.holds.hold(refusal, recheck)
        if type(outcome) is Route:
            # Dial before forwarding; a refused dial is retried (holds.dial_woken says why).
            try:
                dialed = await dial_woken(outcome, recheck, self._dial_woken, deadline,
                                          UpstreamFailed)
            except UpstreamFailed as exc:
                return await self._error(exc.status, exc.reason, req)
            if isinstance(dialed, Refusal):
                return await self._refuse(dialed, req)
            return await self._forward_counted(req, dialed[0])
        assert type(outcome) is Refusal
        return await self._refuse(outcome, req)

    async def _dial_woken(self, route: Route) -> None:
        """A woken route's first upstream, kept for the request (`_upstream` reuses it);
        h2c: the shared pool's connection to one of its backends."""
        if route.backend_protocol == "h1":
            await self._upstream(route)
        elif self.pool is not None:
            from nodeagent.http.h2pool import connect_h2c

            await connect_h2c(route, self.pool.get(), self.balancer, self.limits)

    async def _starting_page(self, refusal: Refusal) -> bool:
        """503 with `Refresh`: a browser shows a small page and asks again shortly."""
        body = _STARTING_PAGE % html.escape(refusal.route or "").encode()
        headers = [
            (b"content-type", b"text/html; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"refresh", b"2"),
            (b"retry-after", b"2"),
            (b"cache-control", b"no-store"),
        ]
        keep = self.keep and self.reader.done
        if not keep:
            headers.append((b"connection", b"close"))
        self._count_status(503)
        await self._answer(503, b"Service Unavailable", headers, body)
        return keep

    async def _forward_route(self, req: RequestHead, route: Route) -> bool:
        """Forward to the route's backends in the protocol they speak, counted per route."""
        self.status = 0
        self.route = route
        if route.backend_protocol == "h1":
            keep = await self._forward(req, route)
        else:
            keep = await self._forward_h2c(req, route)
        self.stats.count_route(route.name, "h1", self.status)
        return keep

    async def _forward_counted(self, req: RequestHead, route: Route) -> bool:
        """`_forward`, counted as activity of a route that sleeps when idle."""
        holds, wake = self.holds, route.wake
        if holds is None or wake is None:
            return await self._forward_route(req, route)
        holds.begin(wake)
        try:
            return await self._forward_route(req, route)
        finally:
            holds.end(wake)

    async def _forward(self, req: RequestHead, route: Route) -> bool:
        """Send the request to one of the route's backends and relay the response.

        A kept-alive upstream that turns out to have closed before answering gets the
        request once more on a fresh upstream, when the request can be replayed (idempotent,
        no body). Other failures answer an error while nothing has been sent to the client.
        """
        stats = self.stats
        method = req.method
        creq = self.creq
        upgrade = creq.upgrade is not None
        headers = upstream_headers(
            creq,
            default_host=route.backends[0].host,
            client=self.client_addr,
            proto=self.xfp,
        )
        up_req = UpstreamRequest(
            method, serialize_request(method, creq.target, headers), creq.chunked
        )
        try:
            # Does the request have a body? The reader answers EndOfRequest at once if not.
            first_body = self.reader.next()
        except BadRequest as exc:
            return await self._reject(
                exc.reason, 400, f"malformed request body: {clip(str(exc))}", req
            )
        replayable = type(first_body) is EndOfRequest and method in _IDEMPOTENT
        status = 0
        try:
            for attempt in (0, 1):
                try:
                    up, reused = await self._upstream(route)
                except UpstreamFailed as exc:
                    return await self._error(exc.status, exc.reason, req)
                try:
                    status = await self._exchange(up, up_req, first_body, upgrade, reused)
                    break
                except UpstreamFailed as exc:
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
                        host=clip(creq.host.decode("latin-1")),
                        path=clip(creq.target.decode("latin-1")),
                        backend=str(up.backend),
                        error=exc.reason,
                    )
                    return False
        except (_BodyTooLarge, _BadBody, _SlowBody) as exc:
            # The request was cut short: reset the upstream first (a node's stream is
            # worth more than this client), then answer if nothing was sent yet.
            up_held, self.up = self.up, None
            if up_held is not None:
                await trio.aclose_forcefully(up_held.stream)
            if self.started:
                return False
            if isinstance(exc, _BodyTooLarge):
                max_body = self.limits.max_body_bytes
                return await self._reject(
                    "body_too_large", 413, f"request body over {max_body} bytes", req
                )
            if isinstance(exc, _SlowBody):
                return await self._reject("slow_body", 408, str(exc), req)
            detail = f"malformed request body: {clip(str(exc))}"
            return await self._reject(exc.reason, 400, detail, req)
        if self.access_log:
            log.info(
                "request routed",
                host=clip(creq.host.decode("latin-1")),
                path=clip(creq.target.decode("latin-1")),
                node=self.up.backend.node if self.up else None,
                status=status,
            )
        return self.keep and status != 101

    async def _forward_h2c(self, req: RequestHead, route: Route) -> bool:
        """The request to an h2c backend (a stream on its shared connection, balanced for
        this request alone), the response back as HTTP/1.1 (`h2heads`: trailers become
        chunked trailers)."""
        creq = self.creq
        if self.pool is None or creq.upgrade is not None:
            return await self._error(502, "this backend speaks h2c: no protocol upgrades", req)
        from nodeagent.http.h2heads import h2_request
        from nodeagent.http.h2pool import open_h2c_exchange

        headers = h2_request(
            req.method,
            creq.target,
            upstream_headers(
                creq, default_host=route.backends[0].host, client=self.client_addr,
                proto=self.xfp,
            ),
            te_trailers=False,
        )
        try:
            first_body = self.reader.next()
        except BadRequest as exc:
            return await self._reject(
                exc.reason, 400, f"malformed request body: {clip(str(exc))}", req
            )
        has_body = type(first_body) is not EndOfRequest
        try:
            pool = self.pool.get()
            exchange = await open_h2c_exchange(
                route, pool, self.balancer, self.limits, self.stats, headers, not has_body
            )
        except UpstreamFailed as exc:
            return await self._error(exc.status, exc.reason, req)
        body_state: list[BaseException | None] = [None]
        status = 0
        try:
            if has_body:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump_body, exchange, first_body, body_state,
                                       nursery)
                    try:
                        status = await self._relay_h2c(exchange)
                    except UpstreamFailed as exc:
                        body_state[0] = exc
                    nursery.cancel_scope.cancel()
                if body_state[0] is not None:
                    raise body_state[0]
            else:
                status = await self._relay_h2c(exchange)
            await exchange.finish()
        except (UpstreamFailed, _BodyTooLarge, _BadBody, _SlowBody) as exc:
            with trio.CancelScope(shield=True):
                await exchange.abort()
            if self.started:
                return False
            if isinstance(exc, UpstreamFailed):
                self.stats.upstream_errors += 1
                return await self._error(exc.status, exc.reason, req)
            if isinstance(exc, _BodyTooLarge):
                max_body = self.limits.max_body_bytes
                return await self._reject(
                    "body_too_large", 413, f"request body over {max_body} bytes", req
                )
            if isinstance(exc, _SlowBody):
                return await self._reject("slow_body", 408, str(exc), req)
            return await self._reject(
                exc.reason, 400, f"malformed request body: {clip(str(exc))}",
                req,
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await exchange.abort()
            raise
        return self.keep and self.reader.done and status != 0

    async def _relay_h2c(self, exchange: H2cExchange) -> int:
        """An h2c backend's response → the HTTP/1.1 client."""
        from nodeagent.http.h2heads import reason_phrase

        limits = self.limits
        status = 0
        chunked = False
        ev: ResponseStart | bytes | ResponseEnd | None = None
        with trio.move_on_after(limits.response_timeout):
            ev = await exchange.receive()
        if ev is None:
            self.stats.timeouts += 1
            raise UpstreamFailed(
                504, f"upstream {exchange.backend} timed out after {limits.response_timeout:g}s"
            )
        while True:
            t = type(ev)
            if t is bytes:
                await self._send(encode_chunk(cast(bytes, ev)) if chunked else cast(bytes, ev))
            elif t is ResponseStart:
                start = cast(ResponseStart, ev)
                status = start.status
                head, chunked, self.keep = frame_response(
                    status,
                    reason_phrase(status),
                    start.headers,
                    length=0 if start.ended else start.length,
                    head_request=self.head_request,
                    http11=self.http11,
                    keep_alive=self.keep,
                )
                self._count_status(status)
                self.started = True
                await self._send(head)
                if start.ended:
                    return status
            else:
                if chunked:
                    await self._send(encode_last_chunk(cast(ResponseEnd, ev).trailers))
                return status
            ev = await exchange.receive()

    async def _upstream(self, route: Route) -> tuple[Upstream, bool]:
        """An upstream for `route` and whether it is a kept-alive one."""
        held = self.up
        if held is not None:
            if held.backend in route.backends:
                self.stats.upstream_reuses += 1
                return held, True
            self.up = None
            await trio.aclose_forcefully(held.stream)
        up = self.up = await dial_upstream(
            route, self.opener, self.balancer, self.limits, self.stats,
            self.client_addr.decode(),
        )
        return up, False

    async def _exchange(
        self,
        up: Upstream,
        req: UpstreamRequest,
        first_body: Any,
        upgrade: bool,
        reused: bool,
    ) -> int:
        """Send the request, relay the response; returns its status. Keeps `up` if reusable."""
        up.request_done = False
        up.parser.start(req.method == b"HEAD")
        if type(first_body) is EndOfRequest:
            head = req.head + encode_last_chunk(first_body.trailers) if req.chunked else req.head
            up.request_done = True
            await up.send(head, stale=reused)
            status = await self._relay_response(up, upgrade, reused)
        else:
            await up.send(req.head, stale=reused)
            up.chunked = req.chunked
            body_state: list[BaseException | None] = [None]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump_body, up, first_body, body_state, nursery)
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

    async def _pump_body(
        self,
        sink: Upstream | H2cExchange,
        event: Any,
        state: list[BaseException | None],
        nursery: trio.Nursery,
    ) -> None:
        """Client request body → upstream, until EndOfMessage. Failures stop the exchange."""
        reader = self.reader
        limits = self.limits
        max_body = limits.max_body_bytes
        idle = limits.idle_timeout
        rate = limits.min_body_rate
        # Seconds the client may still keep us waiting: the grace, plus 1/rate per byte
        # sent, minus the time spent waiting for it (see Limits.min_body_rate).
        credit = min(limits.body_grace, idle)
        seen = 0
        try:
            while True:
                if event is NEED_DATA:
                    wait = idle if rate is None else credit
                    start = trio.current_time()
                    with trio.move_on_at(start + wait):
                        data = await self._receive()
                        if rate is not None:
                            spent = trio.current_time() - start
                            credit = min(credit - spent + len(data) / rate, idle)
                        reader.feed(data)
                        event = reader.next()
                        continue
                    if wait < idle:
                        raise _SlowBody(f"request body slower than {rate:g} bytes/s")
                    raise _SlowBody(f"no request body data for {idle:g}s")
                t = type(event)
                if t is bytes:
                    seen += len(event)
                    if max_body is not None and seen > max_body:
                        raise _BodyTooLarge()
                    await sink.send_body(event)
                elif t is EndOfRequest:
                    await sink.end_body(event.trailers)
                    return
                else:  # CLOSED: the client went away mid-body
                    raise _ClientGone()
                event = reader.next()
        except BadRequest as exc:
            state[0] = _BadBody(str(exc), exc.reason)
        except (_SlowBody, _BodyTooLarge, _ClientGone, UpstreamFailed) as exc:
            state[0] = exc
        nursery.cancel_scope.cancel()

    async def _relay_response(self, up: Upstream, upgrade: bool, reused: bool) -> int:
        """Upstream response → client, batching each read's output into one write."""
        parser = up.parser
        ustream = up.stream
        limits = self.limits
        out: list[bytes] = []
        status = 0
        chunked = False
        event: Any
        timeout = limits.response_timeout
        timer = self.timer
        got_any = not reused  # a fresh upstream's silence is not a stale keep-alive
        try:
            while True:
                event = parser.next()
                if event is NEED_DATA:
                    if out:
                        await self._send(b"".join(out))
                        out.clear()
                    # The connection's timer (`run`): armed for the wait only.
                    timer.deadline = trio.current_time() + timeout
                    try:
                        data = cast(bytes, await ustream.receive_some(limits.read_size))
                    except (
                        trio.BrokenResourceError,
                        trio.ClosedResourceError,
                        OSError,
                    ) as exc:
                        timer.deadline = math.inf
                        raise UpstreamFailed(
                            502, f"upstream {up.backend} broke: {exc}", stale=not got_any
                        ) from exc
                    timer.deadline = math.inf
                    if timer.cancel_called:
                        # It expired as the bytes came, before this task ran: time out
                        # now (a later checkpoint would, serving something else).
                        await trio.lowlevel.checkpoint()
                    if not data and status == 0:
                        raise UpstreamFailed(
                            502,
                            f"upstream {up.backend} closed the connection without answering",
                            stale=not got_any,
                        )
                    got_any = True
                    parser.feed(data)
                    continue
                t = type(event)
                if t is bytes:
                    out.append(encode_chunk(event) if chunked else event)
                elif t is ResponseHead:
                    status = event.status
                    if status == 101:
                        if not upgrade:
                            raise UpstreamFailed(
                                502, f"upstream {up.backend} switched protocols unasked"
                            )
                        self._count_status(101)
                        self.started = True
                        out.append(switch_response(event.reason, event.headers))
                        await self._send(b"".join(out))
                        await self._switch(up)
                        return 101
                    head, chunked, self.keep = frame_response(
                        status,
                        event.reason,
                        event.headers,
                        length=parser.length,
                        head_request=self.head_request,
                        http11=self.http11,
                        keep_alive=self.keep,
                    )
                    out.append(head)
                    if status >= 200:
                        self._count_status(status)
                        timeout = limits.idle_timeout
                        self.started = True
                else:  # END
                    if chunked:
                        out.append(encode_last_chunk(parser.trailers))
                    await self._send(b"".join(out))
                    return status
        except UpstreamProtocolError as exc:
            raise UpstreamFailed(
                502, f"upstream {up.backend} sent a malformed response: {exc}"
            ) from exc

    async def _switch(self, up: Upstream) -> None:
        """After a 101: raw bytes both ways, with each side's leftover input first."""
        self.stats.upgrades += 1
        self.up = None  # the upstream now belongs to this upgraded connection only
        client_rest = self.reader.trailing_data
        ustream = up.stream
        upstream_rest = up.parser.rest()
        release = getattr(ustream, "release", None)
        if release is not None:
            # A wrapper over a bare stream that splice() carries faster (the server's
            # TunnelUpstream): the bare stream, and what the wrapper held after the rest.
            ustream, held = release()
            upstream_rest += held
        await splice(
            self.stream,
            ustream,
            chunk=self.limits.read_size,
            a_leftover=client_rest,
            b_leftover=upstream_rest,
        )

    # -- answers made here ------------------------------------------------------------------

    async def _reject(
        self, reason: RefusalReason, status: int, detail: str, req: RequestHead | None = None,
        *, retry_after: int | None = None, headers: list[tuple[bytes, bytes]] | None = None,
    ) -> bool:
        """A refusal that protects the front: counted by reason, logged rate-limited, then
        answered by `_error` (`detail` is the one-line body; client text in it is clipped)."""
        stats = self.stats
        if status in (400, 431):
            stats.bad_requests += 1
        elif status == 408:
            stats.timeouts += 1
        stats.refused(reason, status=status, client=self.client_addr.decode(), detail=detail)
        return await self._error(status, detail, req, retry_after=retry_after, extra=headers)

    async def _error(self, status: int, reason: str, req: RequestHead | None = None, *,
                     retry_after: int | None = None,
                     extra: list[tuple[bytes, bytes]] | None = None) -> bool:
        """A short text/plain answer; returns whether the connection can go on."""
        if self.started:
            return False  # a response (or an answer of ours) went out already: only close
        keep = self.keep and self.reader.done and status not in (400, 408, 413, 431)
        body = f"{status} {_REASONS.get(status, '')}: {reason}\n".encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
        ]
        if not keep:
            headers.append((b"connection", b"close"))
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        if extra:
            headers += extra
        self._count_status(status)
        if status >= 500 or status in (404, 503):
            log.info(
                "request failed",
                status=status,
                reason=clip(reason, 200),
                client=self.client_addr.decode(),
                method=req.method.decode("latin-1") if req is not None else None,
            )
        await self._answer(status, _REASONS.get(status, "").encode(), headers, body)
        return keep

    async def _redirect(self, location: str) -> bool:
        body = f"308 Permanent Redirect: {location}\n".encode()
        headers = [
            (b"location", location.encode("latin-1")),
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
        ]
        keep = self.keep and self.reader.done
        if not keep:
            headers.append((b"connection", b"close"))
        self._count_status(308)
        await self._answer(308, b"Permanent Redirect", headers, body)
        return keep

    async def _answer(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """One response of the front's own; no body to a HEAD (its length is still said)."""
        self.started = True
        head = response_head(status, reason, headers)
        await self._send(head if self.head_request else head + body)


_STARTING_PAGE = (
    b"<!doctype html><html><head><meta charset=utf-8><title>Starting\xe2\x80\xa6</title>"
    b"</head><body><p>%s is starting; this page reloads itself.</p></body></html>\n")


def _wants_html(req: RequestHead) -> bool:
    """A browser's navigation: GET or HEAD accepting text/html."""
    if req.method not in (b"GET", b"HEAD"):
        return False
    return any(name == b"accept" and b"text/html" in value for name, value in req.headers)


__all__ = ["HttpConnection"]
