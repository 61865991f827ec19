"""One HTTP/2 client connection of the front (ALPN `h2`, or h2c with prior knowledge).

`H2Connection.run` reads the client's bytes into an `h2session.H2Session` and acts on its
events: a request stream gets a task of its own in the connection's nursery, with an
`Inbox` for its body and a cancel scope the client's RST_STREAM cancels — unless nothing
in it has to wait (`_try_direct`: a whole request to a live h2c connection with room),
then the readers relay it (`_DirectStream`) and it gets a task only once it would have to
wait for the client's window (a task and its wake-ups cost more than the rest of the
front's work on such a request). A request goes
through the same steps as on HTTP/1.1: the head is read by the same policy
(`h2heads.h1_view`, then `headers.read_request`), routed by the same `dispatch.route_request`
(404/405/308/503/413 answered here), then forwarded through an `exchange.Exchange`:

- an HTTP/1.1 backend gets the request translated (`h1.serialize_request`; a body without
  Content-Length goes chunked, request trailers as chunked trailers) on an upstream stream
  of its own; finished upstreams are kept for the connection's next requests to the same
  backend, as the HTTP/1.1 front keeps its one;
- an h2c backend gets a stream on its shared connection (`h2pool`), each request balanced
  on its own.

gRPC (`content-type: application/grpc`): `grpc-timeout` bounds the call (then
DEADLINE_EXCEEDED), trailers pass end to end, and every answer the front makes itself is a
trailers-only gRPC status, not a text page (`grpcstatus`). A client's RST_STREAM cancels
the stream's task, which resets the backend's stream (h2c) or closes its upstream stream
(HTTP/1.1); the client's own window is given back only as its data is forwarded, so an
upload to a slow backend costs at most the stream window.

Drain (`GracefulClose`): once the front drains, the connection sends GOAWAY naming the last
stream it took and refuses later ones (REFUSED_STREAM, safe to retry elsewhere); streams in
flight finish, then the connection closes. Protocol errors and abuse (`H2Refused`) end the
connection with h2's GOAWAY, counted as refusals (`h2_<reason>`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import h2.errors
import h2.exceptions
import trio

from nodeagent.http import grpcstatus
from nodeagent.http.balancer import Balancer
from nodeagent.http.connection import GracefulClose
from nodeagent.http.dispatch import Refusal, route_request
from nodeagent.http.exchange import Exchange, H1Exchange, ResponseEnd, ResponseStart
from nodeagent.http.h1 import serialize_request
from nodeagent.http.h2heads import H2Request, h1_view, h2_request, h2_response, reason_phrase
from nodeagent.http.h2pool import (
    H2cExchange,
    H2Pool,
    connect_h2c,
    live_h2c_connection,
    open_h2c_exchange,
    opened_now,
)
from nodeagent.http.h2session import (
    DataIn,
    EndIn,
    GoawayIn,
    H2Event,
    H2Refused,
    H2Session,
    H2Settings,
    Headers,
    HeadersIn,
    ResetIn,
    TrailersIn,
    WindowIn,
)
from nodeagent.http.h2wire import H2Wire, Inbox, StreamGone, WindowStalled
from nodeagent.http.headers import ClientRequest, read_request, upstream_headers
from nodeagent.http.holds import HeldRequests, dial_woken
from nodeagent.http.limits import Limits
from nodeagent.http.paths import clip
from nodeagent.http.routetable import Backend, Route, RouteTable
from nodeagent.http.stats import HttpStats
from nodeagent.http.upstream import Opener, Upstream, UpstreamFailed, dial_upstream
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.http")

_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
_KEEP_UPSTREAMS = 16  # idle HTTP/1.1 upstreams kept per client connection


class _BodyTooLarge(Exception):
    pass


class _SlowBody(Exception):
    pass


class _Outcome:
    """How a stream's response went, filled as it goes: whether its head went out
    (`[0]`, errors can then only end it), the gRPC status name seen, and the status that
    head carried: what the request counts as even if the client closes the connection
    before the handler returns (curl does once it has the whole body, while the stream's
    end or the upstream's return to the pool is still under way), as an access log logs
    the status sent."""

    __slots__ = ("grpc", "started", "status")

    def __init__(self) -> None:
        self.started = False
        self.grpc = ""
        self.status = 0

    def __getitem__(self, _: int) -> bool:
        return self.started

    def __setitem__(self, _: int, value: bool) -> None:
        self.started = value


_JOIN = 256 * 1024
"""Body data queued together is forwarded as one piece of up to this many bytes (within
the frame size the receiving side accepts): `Inbox.join_data`."""

_GIVE_BACK = 64 * 1024
"""Window owed to a client (or a backend) given back at least every this many bytes, and
whenever its stream's inbox is empty: one `h2` acknowledgement per read, not per frame."""


class _Body:
    """A request body on its way to the backend: bytes seen so far, trailers, and the
    window of the data forwarded and not given back to the client yet."""

    __slots__ = ("owed", "seen", "trailers")

    def __init__(self) -> None:
        self.seen = 0
        self.owed = 0
        self.trailers: Headers = []


class _ClientStream:
    __slots__ = ("direct", "inbox", "scope")

    def __init__(self) -> None:
        self.inbox = Inbox()
        self.scope = trio.CancelScope()
        self.direct: _DirectStream | None = None
        """Set while the stream is relayed without a task (`H2Connection._try_direct`)."""


class _Head:
    """A request head read by the front's policy and routed (`H2Connection._read_head`)."""

    __slots__ = ("candidates", "creq", "has_body", "req", "routed")

    def __init__(self, req: H2Request, creq: ClientRequest, routed: Route | Refusal,
                 has_body: bool) -> None:
        self.req = req
        self.creq = creq
        self.routed = routed
        self.has_body = has_body
        self.candidates: Sequence[Backend] | None = None
        """The balancer's pick, when `_try_direct` made it and could not use it."""


class H2Connection:
    """One HTTP/2 client connection; see the module docstring."""

    def __init__(self, stream: trio.abc.Stream, table: Callable[[], RouteTable],
                 opener: Opener, scheme: str, client_addr: str, limits: Limits,
                 stats: HttpStats, balancer: Balancer, pool: H2Pool, access_log: bool,
                 closing: GracefulClose, initial: bytes = b"",
                 settings: H2Settings | None = None,
                 holds: HeldRequests | None = None) -> None:
        self.stream = stream
        self.holds = holds  # requests held for sleeping routes (scale to zero)
        self.table = table
        self.opener = opener
        self.scheme = scheme
        self.https = scheme != "http"
        self.xfp = scheme.encode("ascii")
        self.client_addr = client_addr
        self.client = client_addr.encode("ascii", "replace")
        self.limits = limits
        self.stats = stats
        self.balancer = balancer
        self.pool = pool
        self.access_log = access_log
        self.closing = closing
        self.initial = initial
        settings = settings or H2Settings(max_header_list_size=limits.max_header_bytes)
        self.session = H2Session(client_side=False, settings=settings)
        self.wire = H2Wire(self.session, stream, stall_timeout=limits.idle_timeout)
        # A whole frame of the largest size the client may send in one read (see
        # `H2Upstream.read_size`).
        self.read_size = max(limits.read_size, settings.max_frame_size + 9)
        self.streams: dict[int, _ClientStream] = {}
        self.idle_upstreams: list[Upstream] = []
        self.goaway_sent = False
        self.peer_gone = False
        self._nursery: trio.Nursery | None = None
        self._read_scope: trio.CancelScope | None = None
        self.direct: set[_DirectStream] = set()
        """Streams relayed without a task: the reader keeps their deadlines."""
        self._direct_deadline: float | None = None  # the read scope's, set from `direct`
        self.last_taken = 0
        """The highest stream id served: what GOAWAY names."""

    # -- the connection ---------------------------------------------------------------------

    async def run(self) -> None:
        stats = self.stats
        stats.h2_connections += 1
        self.closing.on_start.add(self._drain)
        refused: H2Refused | None = None
        try:
            self.session.start()
            if self.closing.started:
                self._goaway()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.wire.run)
                # Caught here, in the nursery's own task: raised out of it, they would
                # come wrapped in an ExceptionGroup.
                try:
                    await self.wire.flush()
                    if self.initial:
                        await self._received(self.initial)
                    await self._read_loop()
                    # What the last streams queued (flushes do not wait for the write),
                    # and a GOAWAY: written before the writer goes, within the idle timeout.
                    with trio.move_on_after(self.limits.idle_timeout):
                        await self.wire.drain()
                except H2Refused as exc:
                    refused = exc
                except StreamGone:
                    pass
                nursery.cancel_scope.cancel()
            if refused is not None:
                stats.refused(f"h2_{refused.reason}", status=0,  # type: ignore[arg-type]
                              client=self.client_addr, detail=clip(str(refused), 200))
                await self.wire.flush()  # h2's GOAWAY, written directly: the writer is gone
        except StreamGone:
            pass
        finally:
            self.closing.on_start.discard(self._drain)
            for direct in list(self.direct):
                direct.cancel()  # the client is gone: so are the backend's streams
            for up in self.idle_upstreams:
                await trio.aclose_forcefully(up.stream)
            self.idle_upstreams.clear()
            await trio.aclose_forcefully(self.stream)

    async def _read_loop(self) -> None:
        limits = self.limits
        closing = self.closing
        while True:
            if not self.streams:
                if self.goaway_sent or self.peer_gone:
                    return
                if closing.idle_closed:
                    self._goaway()
                    await self.wire.flush()
                    return
            with trio.CancelScope() as scope:
                self._read_scope = scope
                self._direct_deadline = None
                if self.direct:
                    # The earliest deadline of the streams without a task of their own
                    # (a response head's, a gRPC call's): this reader enforces them.
                    scope.deadline = self._direct_deadline = min(
                        d.deadline for d in self.direct)
                if not self.streams:
                    # Idle: wait for a next request at most idle_timeout, and not at all
                    # once the front closes idle connections (drain). Before the first
                    # request, or with a frame half-received, header_timeout, as for an
                    # HTTP/1.1 head (a slow preface or frame holds a connection no longer).
                    slow = self.last_taken == 0 or self.session.pending_input() > 0
                    scope.deadline = trio.current_time() + (
                        limits.header_timeout if slow else limits.idle_timeout)
                    closing.idle.add(scope)
                try:
                    data = await self._receive()
                finally:
                    closing.idle.discard(scope)
                    self._read_scope = None
            if scope.cancelled_caught:
                if closing.started and not self.goaway_sent:
                    self._goaway()  # the front drains: streams in flight finish
                    await self.wire.flush()
                direct_deadline = self._direct_deadline
                if direct_deadline is not None and trio.current_time() >= direct_deadline:
                    for direct in [d for d in self.direct if d.deadline <= direct_deadline]:
                        direct.expire()
                    await self.wire.flush()
                    continue
                if self.streams:
                    continue
                self._goaway()
                await self.wire.flush()
                return
            if not data:
                return
            await self._received(data)

    def _stream_ended(self) -> None:
        """The last stream in flight ended: the reader goes idle (or closes, draining)."""
        scope = self._read_scope
        if scope is None or self.streams:
            return
        self._direct_deadline = None
        if self.goaway_sent or self.peer_gone or self.closing.idle_closed:
            scope.cancel()
        else:
            scope.deadline = trio.current_time() + self.limits.idle_timeout
            self.closing.idle.add(scope)

    async def _receive(self) -> bytes:
        try:
            return cast(bytes, await self.stream.receive_some(self.read_size))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return b""

    def _goaway(self) -> None:
        """GOAWAY naming the last stream taken: the client may retry later ones elsewhere."""
        if not self.goaway_sent:
            self.goaway_sent = True
            self.session.graceful_goaway(self.last_taken)

    def _drain(self) -> None:
        """The front drains (`GracefulClose.start`): wake the reader to send GOAWAY now."""
        scope = self._read_scope
        if scope is not None:
            scope.cancel()

    async def _received(self, data: bytes) -> None:
        events = self.session.receive(data)  # H2Refused ends the connection
        streams = self.streams
        heads: list[tuple[HeadersIn, _ClientStream]] | None = None
        for ev in events:
            t = type(ev)
            if t is HeadersIn:
                head = cast(HeadersIn, ev)
                if head.stream_id in streams:
                    continue  # h2 reports trailers apart; a second head cannot happen
                if self.goaway_sent or self.closing.started:
                    # Drain: this stream was not taken; the client retries it elsewhere.
                    self._goaway()
                    self.session.reset(head.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
                    continue
                state = streams[head.stream_id] = _ClientStream()
                self.last_taken = head.stream_id
                if heads is None:
                    heads = []
                heads.append((head, state))  # started once its body in this read is in
            elif t is WindowIn:
                self.wire.wake(cast(WindowIn, ev).stream_id)
            elif t is ResetIn:
                state_or_none = streams.get(cast(ResetIn, ev).stream_id)
                if state_or_none is not None:
                    self.stats.h2_client_resets += 1
                    if state_or_none.direct is not None:
                        state_or_none.direct.cancel()
                    else:
                        state_or_none.scope.cancel()
            elif t is GoawayIn:
                self.peer_gone = True
            else:
                sid = cast(DataIn | TrailersIn | EndIn, ev).stream_id
                found = streams.get(sid)
                if found is not None:
                    found.inbox.put(ev)
                elif t is DataIn:
                    self.session.acknowledge(sid, cast(DataIn, ev).flow_length)
        if heads is not None:
            for head, state in heads:
                pre = self._read_head(head)
                if state.scope.cancel_called or not self._try_direct(head, state, pre):
                    assert self._nursery is not None
                    self._nursery.start_soon(self._stream_task, head, state, pre)
        await self.wire.flush()

    # -- one stream -------------------------------------------------------------------------

    async def _stream_task(self, head: HeadersIn, state: _ClientStream, pre: _Head,
                           resumed: _DirectStream | None = None) -> None:
        """A stream's own task: from its routed head (`pre`), or from where a stream
        relayed without a task had to wait (`resumed`: the client's window shut)."""
        sid = head.stream_id
        try:
            with state.scope:
                if resumed is None:
                    await self._serve(sid, head, state.inbox, pre)
                else:
                    await self._call(sid, pre.req, pre.creq, resumed.route, False,
                                     state.inbox, resumed.call_deadline, resumed.started,
                                     resumed.exchange)
        except StreamGone:
            pass  # the client reset the stream or the connection broke
        finally:
            self.streams.pop(sid, None)
            owed = state.inbox.drop()  # body data never forwarded: the window comes back
            if owed:
                self.wire.give_back(sid, owed)
            if self.closing.started and not self.goaway_sent:
                self._goaway()
                try:
                    with trio.CancelScope(shield=True):
                        await self.wire.flush()
                except StreamGone:
                    pass
            self._stream_ended()

    def _read_head(self, head: HeadersIn) -> _Head:
        """The head read by the HTTP/1.1 policy and routed: once per request, whether a
        task or the reader (`_try_direct`) goes on with it."""
        stats = self.stats
        stats.requests += 1
        stats.h2_requests += 1
        req = h1_view(head.headers)
        if req.grpc:
            stats.grpc_requests += 1
        creq = read_request(b"1.1", req.target, req.fields)
        has_body = not head.ended
        if has_body and creq.content_length < 0:
            creq.chunked = True  # an HTTP/1.1 upstream gets it chunked
        routed = route_request(self.table(), req.method, creq, https=self.https,
                               max_body=self.limits.max_body_bytes)
        return _Head(req, creq, routed, has_body)

    async def _serve(self, sid: int, head: HeadersIn, inbox: Inbox, pre: _Head) -> None:
        req, creq, routed, has_body = pre.req, pre.creq, pre.routed, pre.has_body
        stats = self.stats
        if routed.gate is not None:  # rate limits, auth (gate.py)
            routed = await routed.gate.admit(routed, creq, self.client_addr)
        if type(routed) is Refusal and routed.wake is not None and self.holds is not None:
            # A sleeping route: held until it wakes, then dialed with refusals retried,
            # as on HTTP/1.1 (holds.py).
            wake_deadline = trio.current_time() + routed.wake.timeout

            def recheck() -> Route | Refusal:
                return route_request(self.table(), req.method, creq, https=self.https,
                                     max_body=self.limits.max_body_bytes)

            routed = await self.holds.hold(routed, recheck)
            if type(routed) is Route:
                try:
                    dialed = await dial_woken(routed, recheck, self._dial_woken,
                                              wake_deadline, UpstreamFailed)
                    routed = dialed if isinstance(dialed, Refusal) else dialed[0]
                except UpstreamFailed as exc:
                    routed = Refusal(exc.status, exc.reason)
        if type(routed) is not Route:
            refusal = cast(Refusal, routed)
            if refusal.code is not None:
                stats.refused(refusal.code, status=refusal.status, client=self.client_addr,
                              detail=refusal.reason)
            await self._answer(sid, req, refusal.status, refusal.reason, refusal.location,
                               retry_after=refusal.retry_after, refusal=refusal)
            return
        timeout = _grpc_timeout(req)
        deadline = None if timeout is None else trio.current_time() + timeout
        await self._call(sid, req, creq, routed, has_body, inbox, deadline, _Outcome(), None,
                         pre.candidates)

    async def _call(self, sid: int, req: H2Request, creq: ClientRequest, route: Route,
                    has_body: bool, inbox: Inbox, deadline: float | None, started: _Outcome,
                    exchange: Exchange | None,
                    candidates: Sequence[Backend] | None = None) -> None:
        """Forward a routed request within its gRPC deadline, if any; count it."""
        stats = self.stats
        status = 0
        try:
            if deadline is None:  # no cancel scope for the calls that need none
                status = await self._forward_held(sid, req, creq, route, has_body, inbox,
                                                  started, exchange, candidates)
                timeout_hit = False
            else:
                with trio.move_on_at(deadline) as scope:
                    status = await self._forward_held(sid, req, creq, route, has_body, inbox,
                                                      started, exchange, candidates)
                timeout_hit = scope.cancelled_caught
            if timeout_hit:
                stats.timeouts += 1
                started.grpc = "DEADLINE_EXCEEDED"
                self._deadline_answer(sid, req, started)
                await self.wire.flush()
                return
        finally:
            # Per route, by protocol and result: the status of the head sent (even when the
            # task was cancelled after it: the client closed as soon as it had the whole
            # response); a call the client cancelled before any head counts as CANCELLED
            # (gRPC, unless its status was seen) or without a status (HTTP).
            self._count(route, req, status, started)
        if self.access_log:
            self._log_routed(creq, status)

    def _count(self, route: Route, req: H2Request, status: int, started: _Outcome) -> None:
        status = status or started.status
        if req.grpc:
            self.stats.count_route(route.name, "grpc", status, started.grpc or "CANCELLED")
        else:
            self.stats.count_route(route.name, "h2", status)

    def _log_routed(self, creq: ClientRequest, status: int) -> None:
        log.info("request routed", host=clip(creq.host.decode("latin-1")),
                 path=clip(creq.target.decode("latin-1")), status=status, protocol="h2")

    def _deadline_answer(self, sid: int, req: H2Request, started: _Outcome) -> None:
        """DEADLINE_EXCEEDED queued for the client: trailers after a head, else alone."""
        timeout = _grpc_timeout(req)
        message = f"deadline of {timeout or 0:g}s exceeded at the front"
        try:
            if started[0]:
                self.session.send_headers(sid, grpcstatus.status_trailers(
                    grpcstatus.DEADLINE_EXCEEDED, message), end=True)
            else:
                self.session.send_headers(sid, grpcstatus.trailers_only(
                    grpcstatus.DEADLINE_EXCEEDED, message, req.content_type), end=True)
        except Exception:  # h2's StreamClosedError: the client's stream is gone
            pass

    # -- a stream without a task ------------------------------------------------------------

    def _try_direct(self, head: HeadersIn, state: _ClientStream, pre: _Head) -> bool:
        """Relay the request without a task of its own when nothing in it has to wait: an
        h2c route without gate or hold, the whole body in, a live upstream connection
        with room for the stream and window for the body. The head (and body) are queued
        on the backend's connection now; its reader hands the response's events to a
        `_DirectStream`, which queues them for the client as they come, until it would
        have to wait for the client's window: then the stream gets its task
        (`_stream_task`, resumed). The client's RST_STREAM, the response head's timeout
        and `grpc-timeout` (this reader's deadline) and drain apply as they do to a task.
        False: nothing was done, a task serves the request."""
        route = pre.routed
        if (type(route) is not Route or route.backend_protocol != "h2c"
                or route.gate is not None or route.wake is not None):
            return False
        req = pre.req
        items = state.inbox.items
        size = 0
        if pre.has_body:
            if not items or type(items[-1]) is not EndIn:
                return False  # the body is still coming: a task pumps it
            for ev in items:
                if type(ev) is DataIn:
                    size += len(ev.data)
            max_body = self.limits.max_body_bytes
            if max_body is not None and size > max_body:
                return False  # the task answers 413
        call_deadline = None
        if req.grpc:
            timeout = _grpc_timeout(req)
            if timeout is not None:
                call_deadline = trio.current_time() + timeout
            deadline = call_deadline if call_deadline is not None else float("inf")
        else:
            deadline = trio.current_time() + self.limits.response_timeout
        conn, candidates = live_h2c_connection(route, self.pool, self.balancer)
        if conn is None or (size and size > conn.session.new_stream_window()):
            pre.candidates = candidates
            return False
        fields = upstream_headers(pre.creq, default_host=route.backends[0].host,
                                  client=self.client, proto=self.xfp)
        headers = h2_request(req.method, pre.creq.target, fields, te_trailers=req.te_trailers)
        try:
            exchange = opened_now(conn, self.balancer, self.stats, headers, not pre.has_body)
        except UpstreamFailed:
            return False  # a task dials anew
        sid = head.stream_id
        if pre.has_body:
            upstream = conn.session
            frame = conn.session.conn.max_outbound_frame_size
            trailers: Headers = []
            body: list[bytes] = []
            used = 0
            for ev in items:
                t = type(ev)
                if t is DataIn:
                    body.append(cast(DataIn, ev).data)
                    used += cast(DataIn, ev).flow_length
                elif t is TrailersIn:
                    trailers = cast(TrailersIn, ev).trailers
            # Without trailers, END_STREAM rides on the body's last frame (a unary gRPC
            # call's one message): no empty DATA frame after it, for `h2` to build here
            # and the backend to parse. The pieces go joined, in frames as large as the
            # backend takes.
            whole = b"".join(body)  # bounded by the stream's window (checked above)
            try:
                for i in range(0, len(whole), frame):
                    upstream.send_data(exchange.sid, whole[i:i + frame],
                                       end=not trailers and i + frame >= len(whole))
                if trailers:
                    upstream.send_headers(exchange.sid, trailers, end=True)
                elif not whole:
                    upstream.end_stream(exchange.sid)
            except Exception:  # h2 refused (the backend's stream closed under us)
                exchange.abort_now()
                return False  # a task sends it anew
            self.session.acknowledge(sid, used)  # the client's window, now it is sent
            exchange.sent_end = True
            items.clear()
            conn.wire.kick()
        direct = state.direct = _DirectStream(self, sid, state, pre, route, exchange,
                                              deadline, call_deadline)
        exchange.inbox.direct = direct
        self.direct.add(direct)
        self.stats.h2_direct_streams += 1
        return True

    def _resume(self, direct: _DirectStream) -> None:
        """A stream without a task must wait (the client's window): it gets its task."""
        direct.state.direct = None
        self.direct.discard(direct)
        assert self._nursery is not None
        head = HeadersIn(direct.sid, [], True)  # what the resumed `_stream_task` is named by
        self._nursery.start_soon(self._stream_task, head, direct.state, direct.pre, direct)

    def _direct_done(self, direct: _DirectStream) -> None:
        """A stream without a task ended (answered, failed, cancelled, timed out)."""
        direct.state.direct = None
        self.direct.discard(direct)
        self.streams.pop(direct.sid, None)
        owed = direct.state.inbox.drop()  # a body's data that came after its end was sent
        if owed:
            self.session.acknowledge(direct.sid, owed)
        if self.closing.started and not self.goaway_sent:
            self._goaway()
        self.wire.kick()
        self._stream_ended()

    async def _forward_held(self, sid: int, req: H2Request, creq: ClientRequest,
                            route: Route, has_body: bool, inbox: Inbox, started: _Outcome,
                            exchange: Exchange | None,
                            candidates: Sequence[Backend] | None) -> int:
        if route.wake is not None and self.holds is not None:
            self.holds.begin(route.wake)  # activity: it keeps the Service awake
            try:
                return await self._forward(sid, req, creq, route, has_body, inbox, started,
                                           exchange, candidates)
            finally:
                self.holds.end(route.wake)
        return await self._forward(sid, req, creq, route, has_body, inbox, started, exchange,
                                   candidates)

    async def _forward(self, sid: int, req: H2Request, creq: ClientRequest, route: Route,
                       has_body: bool, inbox: Inbox, started: _Outcome,
                       exchange: Exchange | None,
                       candidates: Sequence[Backend] | None) -> int:
        """`exchange`: already open, the request sent (a stream resumed by its task)."""
        limits = self.limits
        try:
            if exchange is not None:
                pass
            elif route.backend_protocol == "h2c":
                fields = upstream_headers(creq, default_host=route.backends[0].host,
                                          client=self.client, proto=self.xfp)
                headers = h2_request(req.method, creq.target, fields,
                                     te_trailers=req.te_trailers)
                exchange = await open_h2c_exchange(route, self.pool, self.balancer, limits,
                                                   self.stats, headers, not has_body,
                                                   candidates)
            else:
                fields = upstream_headers(creq, default_host=route.backends[0].host,
                                          client=self.client, proto=self.xfp)
                exchange = await self._h1_exchange(
                    route, serialize_request(req.method, creq.target, fields), req.method,
                    creq.chunked, has_body)
            if has_body and inbox.items and type(inbox.items[-1]) is EndIn:
                # The whole body came with the head (a unary gRPC call, a small POST): sent
                # as it is, without a pump task and its nursery.
                await self._send_whole_body(sid, inbox, exchange)
                status = await self._relay(sid, req, exchange, started)
            elif has_body:
                status = await self._exchange_with_body(sid, req, exchange, inbox, started)
            else:
                status = await self._relay(sid, req, exchange, started)
            exchange = None
        except (UpstreamFailed, _BodyTooLarge, _SlowBody, WindowStalled) as exc:
            if exchange is not None:
                with trio.CancelScope(shield=True):
                    await exchange.abort()
                exchange = None
            if isinstance(exc, UpstreamFailed):
                self.stats.upstream_errors += 1
                status, reason = exc.status, exc.reason
            elif isinstance(exc, _BodyTooLarge):
                status, reason = 413, f"request body over {limits.max_body_bytes} bytes"
                self.stats.refused("body_too_large", status=413, client=self.client_addr,
                                   detail=reason)
            elif isinstance(exc, _SlowBody):
                status, reason = 408, f"no request body data for {limits.idle_timeout:g}s"
                self.stats.refused("slow_body", status=408, client=self.client_addr,
                                   detail=reason)
            else:
                self.stats.refused("h2_window_stalled", status=0, client=self.client_addr,
                                   detail=str(exc))
                await self.wire.reset(sid, h2.errors.ErrorCodes.CANCEL)
                return 0
            if req.grpc:
                started.grpc = grpcstatus.NAMES[grpcstatus.code_for_http(status)]
            if not started[0]:
                await self._answer(sid, req, status, reason)
            elif req.grpc:
                await self.wire.send_headers(sid, grpcstatus.status_trailers(
                    grpcstatus.code_for_http(status), reason), end=True)
            else:
                await self.wire.reset(sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
            return status
        finally:
            if exchange is not None:
                # Cancelled (client reset, deadline) or failed while relaying.
                with trio.CancelScope(shield=True):
                    await exchange.abort()
        return status

    async def _h1_exchange(self, route: Route, head: bytes, method: bytes, chunked: bool,
                           has_body: bool) -> H1Exchange:
        """An HTTP/1.1 upstream: a kept one for a backend of the route, else a new one; a
        kept one found closed is replaced once for a request that can be replayed."""
        replayable = not has_body and method in _IDEMPOTENT
        for _ in (0, 1):
            up = self._take_upstream(route)
            reused = up is not None
            if up is None:
                up = await dial_upstream(route, self.opener, self.balancer, self.limits,
                                         self.stats, self.client_addr)
            else:
                self.stats.upstream_reuses += 1
            exchange = H1Exchange(up, chunked=chunked, head_request=method == b"HEAD",
                                  reused=reused, read_size=self.limits.read_size)
            try:
                await exchange.start(head, not has_body)
                return exchange
            except UpstreamFailed as exc:
                await exchange.abort()
                if not (exc.stale and replayable):
                    raise
        raise UpstreamFailed(502, "upstream closed the connection")

    async def _dial_woken(self, route: Route) -> None:
        """A woken route's first dial: an HTTP/1.1 upstream kept for `_h1_exchange`, or
        the pool's h2c connection."""
        if route.backend_protocol == "h2c":
            await connect_h2c(route, self.pool, self.balancer, self.limits)
        else:
            self.idle_upstreams.append(await dial_upstream(
                route, self.opener, self.balancer, self.limits, self.stats, self.client_addr))

    def _take_upstream(self, route: Route) -> Upstream | None:
        ups = self.idle_upstreams
        for i, up in enumerate(ups):
            if up.backend in route.backends:
                return ups.pop(i)
        return None

    async def _exchange_with_body(self, sid: int, req: H2Request, exchange: Exchange,
                                  inbox: Inbox, started: _Outcome) -> int:
        """Request body and response at the same time (gRPC streams both ways). The first
        failure of either side ends both; a response that ends before the request body
        tells the client to stop sending (RST_STREAM NO_ERROR, RFC 9113 §8.1)."""
        errors: list[Exception] = []
        pumped = [False]
        status = 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump_body, sid, inbox, exchange, req.grpc, errors,
                               pumped, nursery)
            try:
                status = await self._relay(sid, req, exchange, started)
            except (UpstreamFailed, _BodyTooLarge, _SlowBody, StreamGone) as exc:
                errors.append(exc)
            nursery.cancel_scope.cancel()
        if errors:
            raise errors[0]
        if not pumped[0]:
            await self.wire.reset(sid, h2.errors.ErrorCodes.NO_ERROR)
        return status

    async def _send_whole_body(self, sid: int, inbox: Inbox, exchange: Exchange) -> None:
        """A request body that is all in `inbox` (it ends with END_STREAM) → backend."""
        body = _Body()
        items = inbox.items
        try:
            while items and not await self._body_step(sid, items.popleft(), exchange, body,
                                                      inbox):
                pass
        except UpstreamFailed:
            pass  # the backend stopped reading: its answer (if any) is still relayed
        finally:
            self._give_back(sid, body)

    async def _pump_body(self, sid: int, inbox: Inbox, exchange: Exchange, grpc: bool,
                         errors: list[Exception], pumped: list[bool],
                         nursery: trio.Nursery) -> None:
        """Client request body → backend as it comes; the client's window comes back as
        it goes."""
        idle = self.limits.idle_timeout
        body = _Body()
        items = inbox.items
        try:
            while True:
                if body.owed and (not items or body.owed >= _GIVE_BACK):
                    self._give_back(sid, body)  # all forwarded so far, before waiting
                ev: object = None
                if items:
                    ev = items.popleft()  # a cancel scope only when there is a wait
                elif grpc:
                    ev = await inbox.get()  # a gRPC stream may be idle for long
                else:
                    with trio.move_on_after(idle):
                        ev = await inbox.get()
                    if ev is None:
                        raise _SlowBody()
                if await self._body_step(sid, cast(DataIn | TrailersIn | EndIn, ev),
                                         exchange, body, inbox):
                    pumped[0] = True
                    return
        except UpstreamFailed:
            # The backend stopped reading the body: it may have answered already (an early
            # error response, RFC 9112 §9.6), which the relay still delivers; if it did not,
            # the relay fails on its own.
            return
        except (_BodyTooLarge, _SlowBody, StreamGone) as exc:
            errors.append(exc)
            nursery.cancel_scope.cancel()
        finally:
            self._give_back(sid, body)

    @staticmethod
    def _join_limit(exchange: Exchange) -> int:
        """How much request body to forward as one piece: a frame the backend takes (h2c),
        or `_JOIN` (an HTTP/1.1 backend: one write, one chunk)."""
        if isinstance(exchange, H2cExchange):
            return min(_JOIN, exchange.conn.session.max_frame_out)
        return _JOIN

    def _give_back(self, sid: int, body: _Body) -> None:
        """The client's window of the body data forwarded so far."""
        if body.owed:
            owed, body.owed = body.owed, 0
            self.wire.give_back(sid, owed)

    async def _body_step(self, sid: int, ev: object, exchange: Exchange, body: _Body,
                         inbox: Inbox) -> bool:
        """One event of a request body → backend (the step `_send_whole_body` and
        `_pump_body` share); True once the body ended. Data goes within `max_body_bytes`,
        joined with the data queued behind it (`Inbox.join_data`), and its window goes
        back to the client once sent; trailers wait for the end."""
        t = type(ev)
        if t is DataIn:
            data = cast(DataIn, ev)
            chunk, more = inbox.join_data(data.data, self._join_limit(exchange))
            body.seen += len(chunk)
            max_body = self.limits.max_body_bytes
            if max_body is not None and body.seen > max_body:
                raise _BodyTooLarge()
            if chunk:
                await exchange.send_body(chunk)
            body.owed += data.flow_length + more  # given back by the caller (`_give_back`)
        elif t is TrailersIn:
            body.trailers = cast(TrailersIn, ev).trailers
        elif t is EndIn:
            await exchange.end_body(body.trailers)
            return True
        return False

    async def _relay(self, sid: int, req: H2Request, exchange: Exchange,
                     started: _Outcome) -> int:
        """Backend response → client, within the client's windows."""
        wire = self.wire
        status = 0
        if isinstance(exchange, H2cExchange):  # the response's frames joined, as they fit
            exchange.join_limit = min(_JOIN, self.session.max_frame_out)
        head_timeout = None if req.grpc else self.limits.response_timeout
        if head_timeout is not None:
            with trio.move_on_after(head_timeout):
                first = await exchange.receive()
                head_timeout = None
            if head_timeout is not None:
                self.stats.timeouts += 1
                raise UpstreamFailed(504, f"upstream {exchange.backend} timed out after "
                                          f"{self.limits.response_timeout:g}s")
        else:
            first = await exchange.receive()
        ev: ResponseStart | bytes | ResponseEnd = first
        while True:
            t = type(ev)
            if t is bytes:
                if exchange.ends_next():
                    # The body's last piece: END_STREAM rides on it (one frame less).
                    await wire.send_data(sid, cast(bytes, ev), end=True)
                    ev = await exchange.receive()  # the ResponseEnd, at once
                    if req.grpc:
                        started.grpc = grpcstatus.name_of(cast(ResponseEnd, ev).trailers)
                    break
                await wire.send_data(sid, cast(bytes, ev))
            elif t is ResponseStart:
                start = cast(ResponseStart, ev)
                status = started.status = start.status
                self.stats.count_status(status)
                started[0] = True
                await wire.send_headers(sid, h2_response(status, start.headers), start.ended)
                if start.ended:
                    if req.grpc:
                        started.grpc = grpcstatus.name_of(start.headers)
                    break
            else:
                trailers = cast(ResponseEnd, ev).trailers
                if req.grpc:
                    started.grpc = grpcstatus.name_of(trailers)
                if trailers:
                    await wire.send_headers(sid, trailers, end=True)
                else:
                    await wire.send_data(sid, b"", end=True)
                break
            ev = await exchange.receive()
        if await exchange.finish() and isinstance(exchange, H1Exchange):
            if len(self.idle_upstreams) < _KEEP_UPSTREAMS:
                self.idle_upstreams.append(exchange.up)
            else:
                await trio.aclose_forcefully(exchange.up.stream)
        return status

    # -- answers made here ------------------------------------------------------------------

    async def _answer(self, sid: int, req: H2Request, status: int, reason: str,
                      location: str | None = None, retry_after: int | None = None,
                      refusal: Refusal | None = None) -> None:
        """The front's own answer: a gRPC status to gRPC, a short text to the others."""
        headers, body = self._answer_parts(req, status, reason, location, retry_after,
                                           refusal)
        if not body:
            await self.wire.send_headers(sid, headers, end=True)
        else:
            await self.wire.send_headers(sid, headers)
            await self.wire.send_data(sid, body, end=True)

    def _answer_now(self, sid: int, req: H2Request, status: int, reason: str) -> None:
        """`_answer` queued without waiting (a stream without a task): a text body the
        client's window has no room for is not sent, the stream is reset instead."""
        headers, body = self._answer_parts(req, status, reason)
        session = self.session
        try:
            if not body:
                session.send_headers(sid, headers, end=True)
            elif session.send_window(sid) >= len(body):
                session.send_headers(sid, headers)
                session.send_data(sid, body, end=True)
            else:
                session.reset(sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
        except Exception:  # h2's StreamClosedError: the client's stream is gone
            pass

    def _answer_parts(self, req: H2Request, status: int, reason: str,
                      location: str | None = None, retry_after: int | None = None,
                      refusal: Refusal | None = None) -> tuple[Headers, bytes]:
        """The head and body of the front's own answer (counted and logged here)."""
        self.stats.count_status(status)
        if status >= 500 or status in (404, 503):
            log.info("request failed", status=status, reason=clip(reason, 200),
                     client=self.client_addr, method=req.method.decode("latin-1"),
                     protocol="h2")
        if req.grpc:
            code = refusal.grpc if refusal is not None and refusal.grpc is not None \
                else grpcstatus.code_for_http(status)
            return grpcstatus.trailers_only(code, reason, req.content_type), b""
        body = f"{status} {reason_phrase(status).decode()}: {reason}\n".encode()
        headers: Headers = [(b":status", b"%d" % status),
                            (b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", b"%d" % len(body))]
        if location is not None:
            headers.append((b"location", location.encode("latin-1")))
        if retry_after is not None:  # e.g. 503 over a sleeping route's max-pending
            headers.append((b"retry-after", b"%d" % retry_after))
        if refusal is not None and refusal.headers:
            headers += refusal.headers  # WWW-Authenticate
        return headers, b"" if req.method == b"HEAD" else body


def _grpc_timeout(req: H2Request) -> float | None:
    """A gRPC call's `grpc-timeout`, in seconds (None: none, or not gRPC)."""
    if req.grpc:
        for name, value in req.fields:
            if name == b"grpc-timeout":
                return grpcstatus.parse_timeout(value)
    return None


class _DirectStream:
    """A request relayed without a task of its own (`H2Connection._try_direct`): the
    backend connection's reader hands it the response's events (`DirectSink`), and it
    queues them for the client at once, as `H2Connection._relay` would, until one would
    have to wait for the client's window (or a client that reads slower than we write):
    then it gives the stream to a task (`H2Connection._resume`) with that event first."""

    __slots__ = ("call_deadline", "deadline", "exchange", "front", "pre", "route", "sid",
                 "started", "state")

    def __init__(self, front: H2Connection, sid: int, state: _ClientStream, pre: _Head,
                 route: Route, exchange: H2cExchange, deadline: float,
                 call_deadline: float | None) -> None:
        self.front = front
        self.sid = sid
        self.state = state
        self.pre = pre
        self.route = route
        self.exchange = exchange
        self.deadline = deadline
        """When the reader times it out: the response head's (HTTP), the call's (gRPC)."""
        self.call_deadline = call_deadline
        """The gRPC call's deadline (`grpc-timeout`), kept by a resumed task."""
        self.started = _Outcome()

    def take(self, item: H2Event) -> bool:
        front = self.front
        exchange = self.exchange
        try:
            got = exchange.convert(item)
        except UpstreamFailed as exc:  # the backend reset its stream
            exchange.release()
            self._failed(exc)
            return True
        session = front.session
        sid = self.sid
        started = self.started
        grpc = self.pre.req.grpc
        t = type(got)
        try:
            if got is None:
                pending = exchange.take_pending()
                if pending:  # padding, an empty DATA frame
                    exchange.conn.session.acknowledge(exchange.sid, pending)
                return True
            if t is bytes:
                data = cast(bytes, got)
                if (session.send_window(sid) < len(data)
                        or not front.wire.may_queue(len(data))):
                    exchange.take_pending()  # the task takes this data again, and its window
                    front._resume(self)
                    return False
                end = item.ended  # type: ignore[union-attr]
                session.send_data(sid, data, end)
                exchange.conn.session.acknowledge(exchange.sid, exchange.take_pending())
                if end:
                    if grpc:
                        started.grpc = grpcstatus.name_of(())
                    self._done()
                    return True
            elif t is ResponseStart:
                start = cast(ResponseStart, got)
                status = started.status = start.status
                front.stats.count_status(status)
                started[0] = True
                session.send_headers(sid, h2_response(status, start.headers), start.ended)
                if self.call_deadline is None:
                    self.deadline = float("inf")  # the head came in time
                if start.ended:
                    if grpc:
                        started.grpc = grpcstatus.name_of(start.headers)
                    self._done()
                    return True
            else:
                trailers = cast(ResponseEnd, got).trailers
                if grpc:
                    started.grpc = grpcstatus.name_of(trailers)
                if trailers:
                    session.send_headers(sid, trailers, end=True)
                else:
                    session.send_data(sid, b"", end=True)
                self._done()
                return True
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.cancel()  # the client's stream closed under us
            return True
        front.wire.kick()
        return True

    def lost(self, error: Exception) -> None:
        """The backend's connection ended with this stream in flight."""
        self.exchange.release()
        self._failed(error if isinstance(error, UpstreamFailed)
                     else UpstreamFailed(502, str(error)))

    def _failed(self, exc: UpstreamFailed) -> None:
        """As `_forward` answers a failed upstream: the front's answer before the head,
        a gRPC status or a reset after it."""
        front = self.front
        req = self.pre.req
        started = self.started
        front.stats.upstream_errors += 1
        status = exc.status
        if req.grpc:
            started.grpc = grpcstatus.NAMES[grpcstatus.code_for_http(status)]
        if not started[0]:
            front._answer_now(self.sid, req, status, exc.reason)
        else:
            try:
                if req.grpc:
                    front.session.send_headers(self.sid, grpcstatus.status_trailers(
                        grpcstatus.code_for_http(status), exc.reason), end=True)
                else:
                    front.session.reset(self.sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                pass
        self._done(status)

    def expire(self) -> None:
        """Its deadline passed (the reader's): 504 for a response head that did not come,
        DEADLINE_EXCEEDED for a gRPC call."""
        front = self.front
        req = self.pre.req
        self.exchange.inbox.direct = None
        self.exchange.abort_now()
        front.stats.timeouts += 1
        if self.call_deadline is not None:
            self.started.grpc = "DEADLINE_EXCEEDED"
            front._deadline_answer(self.sid, req, self.started)
            front._count(self.route, req, 0, self.started)
            front._direct_done(self)
            return
        front.stats.upstream_errors += 1
        reason = (f"upstream {self.exchange.backend} timed out after "
                  f"{front.limits.response_timeout:g}s")
        front._answer_now(self.sid, req, 504, reason)
        self._done(504)

    def cancel(self) -> None:
        """The client reset the stream (or went): the backend's stream is reset too."""
        self.exchange.inbox.direct = None
        self.exchange.abort_now()
        front = self.front
        front._count(self.route, self.pre.req, 0, self.started)
        front._direct_done(self)

    def _done(self, status: int = 0) -> None:
        front = self.front
        self.exchange.release()
        status = status or self.started.status
        front._count(self.route, self.pre.req, status, self.started)
        if front.access_log:
            front._log_routed(self.pre.creq, status)
        front._direct_done(self)


__all__ = ["H2Connection"]
