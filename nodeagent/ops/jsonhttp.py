"""The one small HTTP/1.1 server (h11 on trio) behind every operational endpoint: the debug
socket, the metrics/health listener and the controller's config watch stream.

`serve_http(stream, handler)` reads requests on one connection and answers each with what
`handler(request)` returns: a `Reply` (a complete body; the connection stays open for the
next request) or a `StreamingReply` (chunked, for as long as its iterator yields; the
connection ends with it). Malformed HTTP gets h11's status hint and a one-line JSON error;
a request body up to `max_request_bytes` is in `Request.body` (a larger one gets 413); an
idle connection is closed after `idle_timeout`.

`JsonRoutes` is the handler the debug socket and the health listener share: GET/HEAD of a
path → a callable returning JSON-able data (or `HttpStatus` for another status), plus
`/metrics` (Prometheus text) when given a registry and `/` listing the routes; a route
wrapped in `QueryRoute` is given the query string (`/tunnels?node=edge-1`).

None of this is on the data path: it favours one obvious code path over speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import inspect
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import trio

from nodeagent.ops.logs import get_logger
from tunnel.transports.tls import TLSStream

log = get_logger("nodeagent.http")

MAX_REQUEST_BYTES = 16 * 1024
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]  # lower-case names; repeated headers: the last one
    body: bytes = b""


@dataclass(frozen=True)
class Reply:
    """A complete answer."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class StreamingReply:
    """A chunked answer that lasts as long as `chunks` yields; the connection ends with it."""

    chunks: AsyncGenerator[bytes, None]
    status: int = 200
    content_type: str = "application/x-ndjson"
    headers: tuple[tuple[str, str], ...] = field(default=(("cache-control", "no-store"),))


Handler = Callable[[Request], Awaitable[Reply | StreamingReply]]


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def to_json(value: Any) -> bytes:
    return json.dumps(value, default=_json_default, indent=1).encode() + b"\n"


def json_reply(status: int, value: Any, *headers: tuple[str, str]) -> Reply:
    return Reply(status, to_json(value), headers=headers)


def text_reply(status: int, text: str) -> Reply:
    return Reply(status, text.encode(), content_type="text/plain")


async def serve_http(stream: trio.abc.Stream, handler: Handler, *, idle_timeout: float = 30.0,
                     max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
    """Answer requests on `stream` until the client leaves, a streaming reply ends, or the
    connection idles for `idle_timeout`; always closes `stream`."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_request_bytes)

    async def next_event() -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(bytes(await stream.receive_some(max_request_bytes)))

    try:
        while True:
            event: Any = None
            with trio.move_on_after(idle_timeout):
                event = await next_event()
            if type(event) is not h11.Request:
                return
            body = b""
            while type(part := await next_event()) is not h11.EndOfMessage:
                if type(part) is h11.Data:
                    body += bytes(part.data)
                    if len(body) > max_request_bytes:
                        await _send(conn, stream, json_reply(
                            413, {"error": f"request body over {max_request_bytes} bytes"},
                            ("connection", "close")))
                        return
            request = dataclasses.replace(_request(event), body=body)
            reply = await handler(request)
            if isinstance(reply, StreamingReply):
                # A stream lasts (the controller's config watches: thousands, for
                # days): not with the request's objects kept alive in this frame.
                del event, part, request, body
                await _stream(conn, stream, reply)
                return
            await _send(conn, stream, reply, head_only=request.method == "HEAD")
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except h11.RemoteProtocolError as exc:
        with contextlib.suppress(h11.LocalProtocolError, *_GONE):
            await _send(conn, stream, json_reply(exc.error_status_hint,
                                                 {"error": f"malformed request: {exc}"}))
    except _GONE as exc:
        log.debug("http connection ended", reason=repr(exc))
    finally:
        await trio.aclose_forcefully(stream)


def _request(event: h11.Request) -> Request:
    target = urlsplit(event.target.decode("latin-1"))
    path = target.path.rstrip("/") if len(target.path) > 1 else target.path
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
    return Request(event.method.decode("latin-1"), path or "/", parse_qs(target.query), headers)


async def _send(conn: h11.Connection, stream: trio.abc.Stream, reply: Reply, *,
                head_only: bool = False) -> None:
    headers = [("content-type", reply.content_type),
               ("content-length", str(len(reply.body))), *reply.headers]
    data = conn.send(h11.Response(status_code=reply.status, headers=headers)) or b""
    if not head_only:
        data += conn.send(h11.Data(data=reply.body)) or b""
    data += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(data)


async def _stream(conn: h11.Connection, stream: trio.abc.Stream, reply: StreamingReply) -> None:
    headers = [("content-type", reply.content_type), *reply.headers]
    head = conn.send(h11.Response(status_code=reply.status, headers=headers)) or b""
    await stream.send_all(head)
    # A chunked body (an HTTP/1.1 client: h11 said so in the head) is framed here, not
    # by h11, whose state machine per chunk was a large share of the config stream's CPU
    # to send a fan-out (`python -m scripts.bench.config_fanout`). h11 still writes the
    # head and the end: chunked framing has no length for it to track in between.
    chunked = b"\r\nTransfer-Encoding: chunked\r\n" in head
    # aclosing: when the client goes away mid-stream, the generator's cleanup runs now,
    # not whenever the garbage collector finds it.
    async with contextlib.aclosing(reply.chunks) as chunks:
        async for chunk in chunks:
            if not chunk:
                continue  # an empty chunk would end the body
            await _send_chunk(stream, b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked
                              else conn.send(h11.Data(data=chunk)) or b"")
    await stream.send_all(conn.send(h11.EndOfMessage()) or b"")


async def _send_chunk(stream: trio.abc.Stream, data: bytes) -> None:
    """A `TLSStream` (the controller's config stream) writes a chunk the socket can take
    in this task, with no lock and no scheduler round trip: at a fan-out to 5,000 watches,
    trio.SSLStream's send path was a fifth of the controller's CPU. What the socket does
    not take waits in the stream, and `send_all` sends it (and reports any error)."""
    if isinstance(stream, TLSStream) and stream.can_send_nowait():
        if stream.send_nowait(data):
            return
        data = b""
    await stream.send_all(data)


@dataclass(frozen=True)
class HttpStatus:
    """A route's answer with a status other than 200 (e.g. /readyz answering 503)."""

    status: int
    body: Any


@dataclass(frozen=True)
class QueryRoute:
    """A route that reads the query string: `handler(query)` (e.g. `?node=edge-1`)."""

    handler: Callable[[Mapping[str, list[str]]], Awaitable[Any] | Any]


RouteHandler = Callable[[], Awaitable[Any] | Any] | QueryRoute


class JsonRoutes:
    """GET/HEAD path → JSON from a callable; `/metrics` from a Prometheus registry."""

    def __init__(self, routes: Mapping[str, RouteHandler], *, registry: Any = None) -> None:
        self.routes = dict(routes)
        self.registry = registry

    def names(self) -> list[str]:
        extra = {"/metrics"} if self.registry is not None else set()
        return sorted(set(self.routes) | extra)

    async def __call__(self, request: Request) -> Reply:
        path = request.path
        known = path in self.routes or path == "/" or (
            path == "/metrics" and self.registry is not None)
        if not known:
            return json_reply(404, {"error": f"no such route {path}", "routes": self.names()})
        if request.method not in ("GET", "HEAD"):
            return json_reply(405, {"error": f"method {request.method} not allowed"},
                              ("allow", "GET, HEAD"))
        if path == "/metrics" and "/metrics" not in self.routes:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return Reply(200, generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)
        if path == "/" and "/" not in self.routes:
            return json_reply(200, {"routes": self.names()})
        try:
            route = self.routes[path]
            result = route.handler(request.query) if isinstance(route, QueryRoute) else route()
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # a broken route must not take the listener down
            log.warning("route failed", route=path, error=repr(exc))
            return json_reply(500, {"error": f"{path} failed: {exc!r}"})
        if isinstance(result, HttpStatus):
            return json_reply(result.status, result.body)
        return json_reply(200, result)
