"""Real servers for the HTTP front tests: an h11 upstream with a few behaviours, a front."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

from nodeagent.http import (
    Backend,
    HttpFront,
    Limits,
    Route,
    RouteSpec,
    RouteTable,
    UpstreamUnavailable,
)
from tunnel.protocol import StreamReason
from tunnel.tcp import DialFailed, connect_tcp


async def open_direct(backend: Backend, route: Route, client: str = "") -> trio.SocketStream:
    """An opener that dials every backend itself over TCP (the server's direct backends do
    the same through `Server.open_upstream`), failures mapped as the server maps them."""
    try:
        return await connect_tcp(backend.host, backend.port, connect_timeout=10.0)
    except DialFailed as exc:
        status = 504 if exc.reason is StreamReason.TIMEOUT else 502
        raise UpstreamUnavailable(status, f"cannot connect to {backend}: {exc.message}") from None


async def _next_event(conn: h11.Connection, stream: trio.abc.Stream) -> Any:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
            continue
        return event


@dataclass
class Upstream:
    """An HTTP/1.1 origin. Paths:

    /big?n=N      N bytes of b"x", chunked, streamed in 64 KiB pieces
    /sleep?s=S    answers after S seconds
    /close        answers with Connection: close
    /http10       answers as HTTP/1.0 without length (close-delimited)
    anything else JSON: method, target, headers, body length and sha256, connection number
    """

    name: str = "up"
    connections: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        number = self.connections
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                req = await _next_event(conn, stream)
                if type(req) is not h11.Request:
                    return
                if conn.they_are_waiting_for_100_continue:
                    await stream.send_all(
                        conn.send(h11.InformationalResponse(status_code=100, headers=[]))
                    )
                digest = hashlib.sha256()
                size = 0
                while True:
                    ev = await _next_event(conn, stream)
                    if type(ev) is h11.Data:
                        digest.update(ev.data)
                        size += len(ev.data)
                    elif type(ev) is h11.EndOfMessage:
                        break
                    else:
                        return
                target = req.target.decode()
                doc = {
                    "upstream": self.name,
                    "method": req.method.decode(),
                    "target": target,
                    "headers": [[n.decode(), v.decode()] for n, v in req.headers],
                    "body_length": size,
                    "body_sha256": digest.hexdigest(),
                    "connection": number,
                }
                self.requests.append(doc)
                path, _, query = target.partition("?")
                if path == "/big":
                    n = int(query.split("=")[1])
                    await stream.send_all(conn.send(h11.Response(status_code=200, headers=[])))
                    piece = b"x" * 65536
                    while n > 0:
                        data = piece[:n]
                        n -= len(data)
                        await stream.send_all(conn.send(h11.Data(data=data)))
                    await stream.send_all(conn.send(h11.EndOfMessage()))
                elif path == "/http10":
                    await stream.send_all(b"HTTP/1.0 200 OK\r\nx-old: yes\r\n\r\nold style body")
                    await stream.aclose()
                    return
                else:
                    if path == "/sleep":
                        await trio.sleep(float(query.split("=")[1]))
                    body = json.dumps(doc).encode()
                    headers = [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"keep-alive", b"timeout=5"),
                        (b"connection", b"x-secret-hop"),
                        (b"x-secret-hop", b"must not pass"),
                    ]
                    if path == "/close":
                        headers.append((b"connection", b"close"))
                    await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
                    if req.method != b"HEAD":
                        await stream.send_all(conn.send(h11.Data(data=body)))
                    await stream.send_all(conn.send(h11.EndOfMessage()))
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            pass
        finally:
            await trio.aclose_forcefully(stream)


async def start_tcp(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> int:
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


@dataclass
class Opener:
    """open_direct with counters, and a switch to make it fail."""

    opens: int = 0
    fail: Exception | None = None
    delay: float = 0.0
    backends: list[Backend] = field(default_factory=list)
    clients: list[str] = field(default_factory=list)

    async def __call__(self, backend: Backend, route: Route,
                       client: str = "") -> trio.abc.HalfCloseableStream:
        self.backends.append(backend)
        self.clients.append(client)
        if self.delay:
            await trio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        self.opens += 1
        return await open_direct(backend, route)


@dataclass
class Front:
    front: HttpFront
    opener: Opener
    tables: list[RouteTable]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_routes(self, specs: list[RouteSpec], default: Route | None = None) -> None:
        self.tables[0] = RouteTable.build(specs, default)


@asynccontextmanager
async def running_front(
    specs: list[RouteSpec], limits: Limits | None = None, **kwargs: Any
) -> AsyncIterator[Front]:
    tables = [RouteTable.build(specs)]
    opener = Opener()
    front = HttpFront(table=lambda: tables[0], open_upstream=opener, limits=limits, **kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(front.run, "127.0.0.1", 0)
        yield Front(front, opener, tables, front.port)
        front.stop()


@dataclass
class H2Origin:
    """An h2c origin (prior knowledge), built on the `h2` state machine. Every request is
    answered with JSON (method, path, headers, body length, the origin's name, the
    connection's number) and, when the request asked `te: trailers`, a trailer
    `x-body-sha256`. `/big?n=N` streams N bytes; `/hang` never answers; `/reset` resets."""

    name: str = "h2"
    connections: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    resets_received: int = 0
    open_streams: int = 0
    body_bytes_sent: int = 0
    goaways_sent: int = 0
    sockets: list[trio.SocketStream] = field(default_factory=list)
    data_frames: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)
    """By request path: each DATA frame of the request body, (its length, END_STREAM)."""
    request_trailers: dict[str, list[tuple[bytes, bytes]]] = field(default_factory=dict)

    async def drop(self) -> None:
        """Close every connection now (a backend that crashed)."""
        for sock in self.sockets:
            await trio.aclose_forcefully(sock)

    async def handle(self, stream: trio.SocketStream) -> None:
        import h2.config
        import h2.connection
        import h2.events

        self.sockets.append(stream)
        self.connections += 1
        number = self.connections
        conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None))
        conn.initiate_connection()
        lock = trio.Lock()
        bodies: dict[int, list[bytes]] = {}
        heads: dict[int, list[tuple[bytes, bytes]]] = {}
        frames: dict[int, list[tuple[int, bool]]] = {}
        trailers: dict[int, list[tuple[bytes, bytes]]] = {}
        windows: dict[int, trio.Event] = {}

        async def flush() -> None:
            async with lock:
                data = conn.data_to_send()
                if data:
                    await stream.send_all(data)

        async def send_body(sid: int, body: bytes) -> None:
            data = memoryview(body)  # slices of a large body without copying its rest
            while data:
                window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if window <= 0:
                    event = windows[sid] = trio.Event()
                    await event.wait()
                    continue
                conn.send_data(sid, bytes(data[:window]))
                self.body_bytes_sent += min(window, len(data))
                data = data[window:]
                await flush()

        async def answer(sid: int) -> None:
            self.open_streams += 1
            try:
                headers = dict(heads[sid])
                body = b"".join(bodies.pop(sid, []))
                path = headers[b":path"].decode()
                self.data_frames[path] = frames.pop(sid, [])
                if sid in trailers:
                    self.request_trailers[path] = trailers.pop(sid)
                doc = {"upstream": self.name, "method": headers[b":method"].decode(),
                       "target": path, "connection": number, "body_length": len(body),
                       "headers": [[n.decode(), v.decode()] for n, v in heads[sid]]}
                self.requests.append(doc)
                if path == "/hang":
                    await trio.sleep_forever()
                if path == "/slow":
                    await trio.sleep(1.0)
                if path == "/goaway":
                    # A graceful drain: GOAWAY naming this stream, then the answer.
                    import hyperframe.frame as hf

                    goaway = hf.GoAwayFrame(0)
                    goaway.last_stream_id = sid
                    async with lock:
                        await stream.send_all(conn.data_to_send() + goaway.serialize())
                    self.goaways_sent += 1
                    await trio.sleep(0.5)
                if path == "/reset":
                    conn.reset_stream(sid, 2)
                    await flush()
                    return
                if path.startswith("/big"):
                    n = int(path.split("=")[1])
                    conn.send_headers(sid, [(b":status", b"200")])
                    await flush()
                    await send_body(sid, b"x" * n)
                    conn.end_stream(sid)
                    await flush()
                    return
                out = json.dumps(doc).encode()
                conn.send_headers(sid, [(b":status", b"200"),
                                        (b"content-type", b"application/json")])
                await send_body(sid, out)
                if headers.get(b"te") == b"trailers":
                    conn.send_headers(sid, [(b"x-body-sha256",
                                             hashlib.sha256(body).hexdigest().encode())],
                                      end_stream=True)
                else:
                    conn.end_stream(sid)
                await flush()
            except Exception:
                pass
            finally:
                self.open_streams -= 1

        try:
            async with trio.open_nursery() as nursery:
                tasks: dict[int, trio.CancelScope] = {}

                async def run(sid: int) -> None:
                    with trio.CancelScope() as scope:
                        tasks[sid] = scope
                        await answer(sid)

                await flush()
                while data := await stream.receive_some(65536):
                    for ev in conn.receive_data(data):
                        if isinstance(ev, h2.events.RequestReceived):
                            heads[ev.stream_id] = list(ev.headers)  # type: ignore[arg-type]
                        elif isinstance(ev, h2.events.DataReceived):
                            bodies.setdefault(ev.stream_id, []).append(ev.data)  # type: ignore[arg-type]
                            frames.setdefault(ev.stream_id, []).append(  # type: ignore[arg-type]
                                (len(ev.data or b""), ev.stream_ended is not None))
                            conn.acknowledge_received_data(ev.flow_controlled_length,  # type: ignore[arg-type]
                                                           ev.stream_id)  # type: ignore[arg-type]
                        elif isinstance(ev, h2.events.TrailersReceived):
                            trailers[ev.stream_id] = list(ev.headers)  # type: ignore[index,arg-type]
                        elif isinstance(ev, h2.events.StreamEnded):
                            nursery.start_soon(run, ev.stream_id)
                        elif isinstance(ev, h2.events.StreamReset):
                            self.resets_received += 1
                            scope = tasks.get(ev.stream_id)  # type: ignore[arg-type]
                            if scope is not None:
                                scope.cancel()
                        elif isinstance(ev, h2.events.WindowUpdated):
                            for sid in list(windows):
                                if ev.stream_id in (0, sid):
                                    windows.pop(sid).set()
                    await flush()
                nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError, Exception):
            pass
        finally:
            await trio.aclose_forcefully(stream)


class RawH2:
    """A bare HTTP/2 client on the `h2` state machine, for what httpx hides: GOAWAY, window
    updates withheld (a reader that never reads), resets."""

    def __init__(self, stream: trio.SocketStream) -> None:
        import h2.config
        import h2.connection

        self.stream = stream
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        self.body: dict[int, int] = {}
        self.unread: dict[int, int] = {}  # window not given back yet, by stream
        self.status: dict[int, int] = {}
        self.heads: dict[int, list[tuple[bytes, bytes]]] = {}  # response heads, trailers
        self.resets: dict[int, int] = {}  # stream → RST_STREAM code received
        self.ended: set[int] = set()
        self.goaway: int | None = None
        self.refused: dict[int, int] = {}  # stream → RST_STREAM code, for hand-made streams
        self.closed = False
        self._buf = b""

    @classmethod
    async def connect(cls, port: int) -> RawH2:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        await client.flush()
        return client

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def request(self, path: str, host: str = "app.test") -> int:
        sid: int = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"http"),
                                     (b":authority", host.encode()),
                                     (b":path", path.encode())], end_stream=True)
        await self.flush()
        return sid

    async def send(self, path: str, body: bytes = b"",
                   headers: list[tuple[bytes, bytes]] | None = None) -> int:
        """A request with its whole body (or none) and END_STREAM in one write."""
        sid: int = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(b":method", b"POST" if body else b"GET"),
                                     (b":scheme", b"http"), (b":authority", b"app.test"),
                                     (b":path", path.encode()), *(headers or [])],
                               end_stream=not body)
        if body:
            self.conn.send_data(sid, body, end_stream=True)
        await self.flush()
        return sid

    async def reset(self, sid: int) -> None:
        self.conn.reset_stream(sid, 8)  # CANCEL
        await self.flush()

    async def wait_for(self, done: Callable[[], bool], seconds: float = 10.0) -> None:
        """Read (granting windows) until `done()`."""
        with trio.fail_after(seconds):
            while not done():
                await self.pump(0.05, grant=True)

    async def pump(self, seconds: float, *, grant: bool) -> None:
        """Read for `seconds` (or until the server closes); `grant`: give the window back
        for what arrived, else keep it shut."""
        import h2.events

        if grant:
            for sid, n in self.unread.items():
                if n:
                    self.conn.acknowledge_received_data(n, sid)
            self.unread.clear()
            await self.flush()
        with trio.move_on_after(seconds):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    self.closed = True
                    return
                for ev in self.conn.receive_data(self._intercept(data)):
                    if isinstance(ev, h2.events.ResponseReceived):
                        self.status[ev.stream_id] = int(dict(ev.headers)[b":status"])  # type: ignore[arg-type, index]
                        self.heads[ev.stream_id or 0] = list(ev.headers or ())  # type: ignore[arg-type]
                    elif isinstance(ev, h2.events.TrailersReceived):
                        self.heads.setdefault(ev.stream_id or 0, []).extend(ev.headers or ())  # type: ignore[arg-type]
                    elif isinstance(ev, h2.events.StreamReset):
                        self.resets[ev.stream_id or 0] = int(ev.error_code or 0)
                    elif isinstance(ev, h2.events.DataReceived):
                        sid = ev.stream_id or 0
                        self.body[sid] = self.body.get(sid, 0) + len(ev.data or b"")
                        if grant:
                            self.conn.acknowledge_received_data(ev.flow_controlled_length or 0,
                                                                sid)
                        else:
                            self.unread[sid] = (self.unread.get(sid, 0)
                                                + (ev.flow_controlled_length or 0))
                    elif isinstance(ev, h2.events.StreamEnded):
                        self.ended.add(ev.stream_id or 0)
                with trio.CancelScope(shield=True):  # a write cut by the timeout loses frames
                    await self.flush()

    def _intercept(self, data: bytes) -> bytes:
        """Take out what h2 cannot take as a client: a graceful GOAWAY (h2 closes the
        connection on any GOAWAY and then refuses the frames of streams still in flight),
        and resets of streams written by hand (h2 never opened them)."""
        import hyperframe.frame as hf

        buf = self._buf + data
        out = b""
        while len(buf) >= 9:
            frame, length = hf.Frame.parse_frame_header(memoryview(buf[:9]))
            if len(buf) < 9 + length:
                break
            raw, buf = buf[:9 + length], buf[9 + length:]
            if isinstance(frame, hf.GoAwayFrame):
                frame.parse_body(memoryview(raw[9:]))
                self.goaway = frame.last_stream_id
            elif (isinstance(frame, hf.RstStreamFrame)
                  and frame.stream_id > self.conn.highest_outbound_stream_id):
                frame.parse_body(memoryview(raw[9:]))
                self.refused[frame.stream_id] = frame.error_code
            else:
                out += raw
        self._buf = buf
        return out

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)
