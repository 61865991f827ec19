"""Backends that speak h2c: one HTTP/2 connection per backend endpoint, shared by requests.

`H2Pool` holds at most one `H2Upstream` per `Backend`: an h2c connection (prior knowledge)
carried in one upstream stream from the front's opener (a tunnel stream to the backend's
node), shared by every request the balancer sends to that endpoint, from any client
connection of the front, with at most `H2Settings.max_concurrent_streams` (and the
backend's own SETTINGS limit) streams at once; a request over the limit waits for a slot.
Each request is balanced on its own (`open_h2c_exchange`): the unit of balancing is the
request, not the client's connection, so one gRPC client's calls spread over every ready
endpoint.

Each connection's reader task lives in the pool's nursery (the front's): it feeds the
`H2Session`, puts each stream's events into that stream's `Inbox`, and never acknowledges
data itself — the request's task does once the data reached its client (`H2cExchange`),
so what a slow client leaves unread stays bounded by the upstream stream's window. When
the connection fails (the tunnel stream broke, the backend sent GOAWAY or broke the
protocol), only the requests in flight on it fail; the next request dials a new one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import h2.errors
import trio

from nodeagent.http.balancer import Balancer
from nodeagent.http.errors import UpstreamUnavailable
from nodeagent.http.exchange import ResponseEnd, ResponseStart
from nodeagent.http.h2heads import split_response
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
from nodeagent.http.h2wire import H2Wire, Inbox, StreamGone
from nodeagent.http.limits import Limits
from nodeagent.http.routetable import Backend, Route
from nodeagent.http.stats import HttpStats
from nodeagent.http.upstream import Opener, UpstreamFailed
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.http")

_GIVE_BACK = 64 * 1024
"""Window owed to the backend given back at least every this many bytes (`receive`)."""

Describe = Callable[[trio.abc.HalfCloseableStream, Callable[[], list[dict[str, object]]]], None]
"""`describe(stream, streams_view)`: how the pool shows the debug views what an upstream
stream carries (`StreamNotes.describe` on the server)."""


UPSTREAM_SETTINGS = H2Settings()
"""What the front announces to h2c backends: the same as to clients (4 MiB stream
windows within an 8 MiB connection window, frames of up to 256 KiB). The connection is
shared by every request sent to that endpoint, so its window bounds what all of them
hold of responses not yet written to their clients."""


class UpstreamLost(UpstreamFailed):
    """The backend's h2c connection ended with this request in flight."""


class H2Upstream:
    """One h2c connection to a backend; see the module docstring."""

    def __init__(self, backend: Backend, stream: trio.abc.HalfCloseableStream,
                 settings: H2Settings, limits: Limits) -> None:
        self.backend = backend
        self.stream = stream
        self.session = H2Session(client_side=True, settings=settings)
        self.wire = H2Wire(self.session, stream, stall_timeout=limits.idle_timeout)
        # A whole frame of the largest size the backend may send in one read: h2 parses a
        # frame once it is whole, and each read costs the reader a round of its loop.
        self.read_size = max(limits.read_size, settings.max_frame_size + 9)
        self.max_streams = settings.max_concurrent_streams
        self.inboxes: dict[int, Inbox] = {}
        self.paths: dict[int, tuple[bytes, float]] = {}  # stream → (:path, opened at)
        self.closed = False
        self.goaway = False
        self.closing = False
        """The front drains: no new streams; the connection closes after its last."""
        self._scope: trio.CancelScope = trio.CancelScope()
        self.requests = 0
        self._slot = trio.Event()

    # -- the reader ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        why = "closed by the backend"
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                await nursery.start(self.wire.run)
                why = await self._read(task_status)
                nursery.cancel_scope.cancel()
            if self._scope.cancelled_caught and self.closing:
                why = "closed: the front drains"
        finally:
            self.closed = True
            self.wire.broken = True
            self.wire.wake(0)
            for inbox in list(self.inboxes.values()):  # a stream without a task
                inbox.fail(UpstreamLost(502, f"h2c connection to {self.backend} {why}"))
            self._free_slot()
            await trio.aclose_forcefully(self.stream)
            log.info("h2c upstream closed", backend=str(self.backend), reason=why,
                     in_flight=len(self.inboxes), requests=self.requests)

    async def _read(self, task_status: trio.TaskStatus[None]) -> str:
        """Read the backend until the connection ends; returns why it ended."""
        session = self.session
        why = "closed by the backend"
        try:
            session.start()
            await self.wire.flush()
            task_status.started()
            while True:
                try:
                    data = await self.stream.receive_some(self.read_size)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    why = f"broke: {exc}"
                    break
                if not data:
                    break
                for ev in session.receive(bytes(data)):
                    t = type(ev)
                    if t is WindowIn:
                        self.wire.wake(ev.stream_id)  # type: ignore[union-attr]
                        if ev.stream_id == 0:  # type: ignore[union-attr]
                            self._free_slot()  # SETTINGS may have raised the stream limit
                    elif t is GoawayIn:
                        self._goaway(ev)  # type: ignore[arg-type]
                    else:
                        inbox = self.inboxes.get(ev.stream_id)  # type: ignore[union-attr]
                        if inbox is not None:
                            inbox.put(ev)
                        elif t is DataIn:
                            session.acknowledge(ev.stream_id, ev.flow_length)  # type: ignore[union-attr]
                await self.wire.flush()
                if self.goaway and not self.inboxes:
                    why = "drained (GOAWAY)"
                    break
        except H2Refused as exc:
            why = f"broke the protocol: {exc}"
            try:
                await self.wire.drain()  # h2's GOAWAY, before the writer is cancelled
            except StreamGone:
                pass
        except StreamGone as exc:
            why = f"broke: {exc}"
        return why

    def _goaway(self, ev: GoawayIn) -> None:
        self.goaway = True
        for sid, inbox in list(self.inboxes.items()):  # failing one may release it
            if sid > ev.last_stream_id:  # never processed: safe to retry elsewhere
                inbox.fail(UpstreamLost(502, f"{self.backend} went away (GOAWAY)"))

    def _free_slot(self) -> None:
        self._slot.set()
        self._slot = trio.Event()

    # -- streams ---------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return (not self.closed and not self.goaway and not self.closing
                and not self.wire.broken)

    def close_when_idle(self) -> None:
        """No new streams; close now if none is in flight, else after the last one (a
        server draining must not hold a tunnel stream open for an idle connection)."""
        self.closing = True
        if not self.inboxes:
            self._scope.cancel()

    def has_slot(self) -> bool:
        return len(self.inboxes) < min(self.max_streams, self.session.peer_max_streams)

    async def open(self, headers: Headers, end: bool) -> H2cExchange:
        """A new stream with `headers` sent; waits for a free slot under the limits."""
        while not self.has_slot():
            if not self.usable:
                raise UpstreamLost(502, f"h2c connection to {self.backend} closed")
            await self._slot.wait()
        if not self.usable:
            raise UpstreamLost(502, f"h2c connection to {self.backend} closed")
        sid = self.session.next_stream_id()
        inbox = self.inboxes[sid] = Inbox()
        self.paths[sid] = (next((v for n, v in headers if n == b":path"), b""),
                           trio.current_time())
        self.requests += 1
        exchange = H2cExchange(self, sid, inbox, end)
        try:
            await self.wire.send_headers(sid, headers, end)
        except StreamGone as exc:
            exchange.release()
            raise UpstreamLost(502, f"h2c connection to {self.backend} broke: {exc}") from exc
        return exchange

    def open_now(self, headers: Headers, end: bool) -> H2cExchange:
        """`open` for a caller that cannot wait: only with `usable` and `has_slot()` true.
        The head is queued and the writer woken."""
        sid = self.session.next_stream_id()
        try:
            self.session.send_headers(sid, headers, end)
        except Exception as exc:  # h2 refused: the connection is not usable after all
            raise UpstreamLost(502, f"h2c connection to {self.backend}: {exc}") from exc
        inbox = self.inboxes[sid] = Inbox()
        self.paths[sid] = (next((v for n, v in headers if n == b":path"), b""),
                           trio.current_time())
        self.requests += 1
        self.wire.kick()
        return H2cExchange(self, sid, inbox, end)

    def release(self, sid: int, owed: int = 0) -> None:
        """The stream is done with; `owed`: window of data taken and not given back."""
        self.paths.pop(sid, None)
        inbox = self.inboxes.pop(sid, None)
        if inbox is not None:
            # The window of what the stream left unforwarded (a client that reset a large
            # download) goes back to the connection, shared by every call to the backend.
            owed += inbox.drop()
            if owed and not self.closed:
                self.wire.give_back(sid, owed)
            self._free_slot()
            if self.closing and not self.inboxes:
                self._scope.cancel()

    def streams_view(self) -> list[dict[str, object]]:
        """The h2 streams in flight on this connection (`nodeagent debug streams`)."""
        now = trio.current_time()
        return [{"stream": sid, "path": path.decode("latin-1")[:200],
                 "age_seconds": round(now - opened, 1)}
                for sid, (path, opened) in sorted(self.paths.items())]


class H2cExchange:
    """One request on a backend's shared h2c connection (`exchange.Exchange`)."""

    __slots__ = ("_done", "_pending", "_started", "backend", "conn", "inbox", "join_limit",
                 "sent_end", "sid")

    def __init__(self, conn: H2Upstream, sid: int, inbox: Inbox, sent_end: bool) -> None:
        self.sent_end = sent_end
        """Our side of the stream is ended (END_STREAM sent)."""
        self.conn = conn
        self.backend = conn.backend
        self.sid = sid
        self.inbox = inbox
        self._pending = 0  # window of the data returned so far, not yet given back
        self._started = False
        self._done = False
        self.join_limit = 0
        """Body data queued together is returned joined, up to this many bytes (0: frame
        by frame): set by the caller to what its side takes in one frame."""

    def _gone(self, exc: Exception) -> UpstreamFailed:
        return UpstreamLost(502, f"h2c stream to {self.backend} failed: {exc}")

    async def send_body(self, data: bytes) -> None:
        try:
            await self.conn.wire.send_data(self.sid, data)
        except StreamGone as exc:
            raise self._gone(exc) from exc

    async def end_body(self, trailers: Headers) -> None:
        try:
            self.sent_end = True
            if trailers:
                await self.conn.wire.send_headers(self.sid, trailers, end=True)
            else:
                await self.conn.wire.end_stream(self.sid)
        except StreamGone as exc:
            raise self._gone(exc) from exc

    async def receive(self) -> ResponseStart | bytes | ResponseEnd:
        """The next part of the response. The window of the data returned so far goes back
        to the backend before waiting for more, or every `_GIVE_BACK` bytes: one `h2`
        acknowledgement per read, not per frame."""
        inbox = self.inbox
        while True:
            pending = self._pending
            if pending and (not inbox.items or pending >= _GIVE_BACK):
                self._pending = 0
                self.conn.wire.give_back(self.sid, pending)
            got = self.convert(await inbox.get())
            if got is not None:
                return got

    def convert(self, ev: H2Event) -> ResponseStart | bytes | ResponseEnd | None:
        """One event of the backend's stream as the response part it is (None: nothing
        to pass on); raises `UpstreamFailed` when the backend reset the stream. The window
        of data returned is owed to the backend (`take_pending`)."""
        t = type(ev)
        if t is DataIn:
            data: bytes = ev.data  # type: ignore[union-attr]
            more = 0
            if self.join_limit:
                data, more = self.inbox.join_data(data, self.join_limit)
            self._pending += ev.flow_length + more  # type: ignore[union-attr]
            return data or None
        if t is HeadersIn:
            status, fields = split_response(ev.headers)  # type: ignore[union-attr]
            self._started = True
            length = -1
            for name, value in fields:
                if name == b"content-length" and value.isdigit():
                    length = int(value)
            ended = ev.ended  # type: ignore[union-attr]
            if ended:
                self._done = True
            return ResponseStart(status, fields, ended=ended, length=length)
        if t is TrailersIn:
            self._done = True
            return ResponseEnd(ev.trailers)  # type: ignore[union-attr]
        if t is EndIn:
            if self._done:
                return None  # after trailers or a trailers-only head: already told
            self._done = True
            return ResponseEnd([])
        if t is ResetIn:
            code = ev.code  # type: ignore[union-attr]
            raise UpstreamFailed(502, f"{self.backend} reset the stream "
                                      f"({_code_name(code)})")
        return None

    def take_pending(self) -> int:
        """The window of the data `convert` returned (since the last `take_pending`), now
        given back by the caller (`H2Session.acknowledge` on `conn.session`)."""
        pending, self._pending = self._pending, 0
        return pending

    def abort_now(self) -> None:
        """`abort` for code that cannot wait: the reset is queued and the writer woken."""
        if not self.conn.closed:
            self.conn.session.reset(self.sid, h2.errors.ErrorCodes.CANCEL)
            self.conn.wire.wake(self.sid)
            self.conn.wire.kick()
        self.release()

    def ends_next(self) -> bool:
        items = self.inbox.items
        return bool(items) and type(items[0]) is EndIn and not self._done

    def release(self) -> None:
        self.conn.release(self.sid, self.take_pending())

    async def finish(self) -> bool:
        if self._pending:
            pending, self._pending = self._pending, 0
            await self.conn.wire.acknowledge(self.sid, pending)
        if not self.sent_end and not self.conn.closed:
            # The response ended before the request: stop the stream's sending half.
            await self.conn.wire.reset(self.sid, h2.errors.ErrorCodes.NO_ERROR)
        self.release()
        return True

    async def abort(self) -> None:
        """Reset the backend's stream (a client's cancel reaches the backend as RST_STREAM)."""
        if not self.conn.closed:
            await self.conn.wire.reset(self.sid, h2.errors.ErrorCodes.CANCEL)
        self.release()


def _code_name(code: int) -> str:
    try:
        return h2.errors.ErrorCodes(code).name
    except ValueError:
        return str(code)


class H2Pool:
    """The shared h2c connections of one front, by backend; their tasks in `nursery`."""

    def __init__(self, nursery: trio.Nursery, opener: Opener, limits: Limits,
                 settings: H2Settings | None = None,
                 describe: Describe | None = None) -> None:
        self.describe = describe
        """Told of each connection's upstream stream and how to list its h2 streams."""
        self.nursery = nursery
        self.opener = opener
        self.limits = limits
        self.settings = settings or UPSTREAM_SETTINGS
        self.conns: dict[Backend, H2Upstream] = {}
        self._dialing: dict[Backend, trio.Event] = {}

    async def connection(self, backend: Backend, route: Route) -> H2Upstream:
        while True:
            conn = self.conns.get(backend)
            if conn is not None and conn.usable:
                return conn
            dialing = self._dialing.get(backend)
            if dialing is None:
                break
            await dialing.wait()
        done = self._dialing[backend] = trio.Event()
        try:
            stream = await self.opener(backend, route, "")
            conn = H2Upstream(backend, stream, self.settings, self.limits)
            if self.describe is not None:
                self.describe(stream, conn.streams_view)
            await self.nursery.start(self._run, conn)
            self.conns[backend] = conn
            return conn
        finally:
            del self._dialing[backend]
            done.set()

    async def _run(self, conn: H2Upstream, *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await conn.run(task_status=task_status)
        finally:
            if self.conns.get(conn.backend) is conn:
                del self.conns[conn.backend]

    def drain(self) -> None:
        """The front drains: every connection closes once its streams in flight end."""
        for conn in list(self.conns.values()):
            conn.close_when_idle()

    def snapshot(self) -> list[dict[str, object]]:
        """The pool's connections for the debug views."""
        return [{"backend": str(b), "streams": sorted(c.inboxes), "requests": c.requests,
                 "goaway": c.goaway} for b, c in self.conns.items()]


def live_h2c_connection(route: Route, pool: H2Pool, balancer: Balancer
                        ) -> tuple[H2Upstream | None, Sequence[Backend]]:
    """The balancer's pick for this request, with its connection when that is live and has
    room (a stream opens on it without waiting: `H2Upstream.open_now`), else None; the
    candidates, for `open_h2c_exchange` to go on with (the pick is made once)."""
    candidates = balancer.candidates(route)
    conn = pool.conns.get(candidates[0]) if candidates else None
    if conn is not None and conn.usable and conn.has_slot():
        return conn, candidates
    return None, candidates


def opened_now(conn: H2Upstream, balancer: Balancer, stats: HttpStats, headers: Headers,
               end: bool) -> H2cExchange:
    """A stream on `live_h2c_connection`'s connection, counted as `open_h2c_exchange`
    counts one."""
    exchange = conn.open_now(headers, end)
    stats.upstream_reuses += conn.requests > 1
    stats.upstream_opens += conn.requests == 1
    balancer.succeeded(conn.backend)
    return exchange


async def open_h2c_exchange(route: Route, pool: H2Pool, balancer: Balancer, limits: Limits,
                            stats: HttpStats, headers: Headers, end: bool,
                            candidates: Sequence[Backend] | None = None) -> H2cExchange:
    """A request on one of `route`'s backends, balanced for this request alone (or over
    `candidates`, the balancer's pick already made); raises `UpstreamFailed` with the last
    failure when no backend took it."""
    failure: UpstreamFailed | None = None  # made only when one is needed (hot path)
    if candidates is None:
        candidates = balancer.candidates(route)
    for backend in candidates[: limits.max_dial_attempts]:
        try:
            conn_or_none = pool.conns.get(backend)
            if conn_or_none is not None and conn_or_none.usable and conn_or_none.has_slot():
                # The usual case: a live connection with room; opening a stream does not
                # wait (no deadline, no cancel scope to pay for).
                conn = conn_or_none
                exchange = await conn.open(headers, end)
            else:
                with trio.fail_after(limits.dial_timeout):
                    conn = await pool.connection(backend, route)
                    exchange = await conn.open(headers, end)
        except trio.TooSlowError:
            stats.timeouts += 1
            failure = UpstreamFailed(
                504, f"reaching {backend} timed out after {limits.dial_timeout:g}s")
        except UpstreamUnavailable as exc:
            failure = UpstreamFailed(exc.status, exc.reason)
        except UpstreamFailed as exc:
            failure = exc
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            failure = UpstreamFailed(502, f"cannot connect to {backend}: {reason}")
        else:
            stats.upstream_reuses += conn.requests > 1
            stats.upstream_opens += conn.requests == 1
            balancer.succeeded(backend)
            return exchange
        stats.upstream_errors += 1
        balancer.failed(backend)
        log.info("upstream unavailable", route=route.name, backend=str(backend),
                 status=failure.status, reason=failure.reason)
    raise failure or UpstreamFailed(502, f"route {route.name}: no backend could be reached")


__all__ = ["UPSTREAM_SETTINGS", "H2Pool", "H2Upstream", "H2cExchange", "UpstreamLost",
           "live_h2c_connection", "open_h2c_exchange", "opened_now"]


async def connect_h2c(route: Route, pool: H2Pool, balancer: Balancer, limits: Limits) -> None:
    """A connection in the pool to the first of `route`'s backends the balancer picks,
    without a request (a woken route's first dial, retried by `holds.dial_woken`);
    raises `UpstreamFailed` when it cannot be had."""
    backend = balancer.candidates(route)[0]
    try:
        with trio.fail_after(limits.dial_timeout):
            await pool.connection(backend, route)
    except trio.TooSlowError:
        raise UpstreamFailed(504, f"reaching {backend} timed out after "
                             f"{limits.dial_timeout:g}s") from None
    except UpstreamUnavailable as exc:
        raise UpstreamFailed(exc.status, exc.reason) from None
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise UpstreamFailed(502, f"cannot connect to {backend}: {reason}") from None
