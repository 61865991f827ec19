"""The HTTP front end to end: real sockets, a real h11 upstream, httpx and raw clients."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import socket
import ssl
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio_websocket import open_websocket_url, serve_websocket

from nodeagent.http import (
    Backend,
    CertStore,
    Limits,
    Route,
    RouteSpec,
    TlsConfig,
    UpstreamUnavailable,
)
from nodeagent.http.tls import context_from_pem
from tests.http.helpers import Upstream, running_front, start_tcp

MiB = 1024 * 1024


def client(**kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=10, **kwargs)


def route_to(port: int, name: str = "r", node: str | None = None) -> Route:
    return Route(name, (Backend(node, "127.0.0.1", port),))


async def raw_exchange(port: int, data: bytes, wait: float = 5.0) -> bytes:
    """Send bytes, then read until the front closes (or `wait` runs out)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    out = b""
    with trio.move_on_after(wait):
        try:
            if data:
                await stream.send_all(data)
            while chunk := await stream.receive_some(65536):
                out += chunk
        except trio.BrokenResourceError:
            pass
    await stream.aclose()
    return out


@pytest.fixture
def no_tracebacks(caplog: pytest.LogCaptureFixture) -> AsyncIterator[None]:
    caplog.set_level(logging.DEBUG)
    yield  # type: ignore[misc]
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        assert record.levelno < logging.ERROR, record.getMessage()
    assert "Traceback" not in caplog.text


async def test_routes_by_host_and_path(nursery: trio.Nursery, no_tracebacks: None) -> None:
    a, b = Upstream("a"), Upstream("b")
    pa, pb = await start_tcp(nursery, a.handle), await start_tcp(nursery, b.handle)
    specs = [
        RouteSpec("app.example.com", "/", route_to(pa, "app")),
        RouteSpec("app.example.com", "/api", route_to(pb, "api")),
        RouteSpec("*.example.com", "/", route_to(pb, "wild")),
    ]
    async with running_front(specs) as f, client() as c:
        r = await c.get(f"{f.url}/api/v1", headers={"host": "app.example.com"})
        assert r.status_code == 200 and r.json()["upstream"] == "b"
        assert r.json()["target"] == "/api/v1"
        r = await c.get(f"{f.url}/apix", headers={"host": "APP.example.com:80"})
        assert r.json()["upstream"] == "a"
        r = await c.get(f"{f.url}/", headers={"host": "zz.example.com"})
        assert r.json()["upstream"] == "b"
        r = await c.get(f"{f.url}/x?q=1", headers={"host": "nope.org"})
        assert r.status_code == 404
        assert r.headers["content-type"].startswith("text/plain")
        assert "no route for nope.org/x?q=1" in r.text
        assert f.front.stats.responses_4xx == 1 and f.front.stats.responses_2xx == 3


async def test_keep_alive_reuses_one_upstream(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f:
        async with client(limits=httpx.Limits(max_connections=1)) as c:
            for i in range(6):
                r = await c.get(f"{f.url}/n{i}")
                assert r.status_code == 200 and r.json()["target"] == f"/n{i}"
            r = await c.head(f"{f.url}/head")
            assert r.status_code == 200 and r.content == b""
            assert int(r.headers["content-length"]) > 0
        stats = f.front.stats
        assert stats.connections_accepted == 1
        assert f.opener.opens == 1 and up.connections == 1
        assert f.opener.clients == ["127.0.0.1"]  # who the upstream stream is for
        assert stats.upstream_opens == 1 and stats.upstream_reuses == 6
        assert {req["connection"] for req in up.requests} == {1}


async def test_draining_front_closes_keep_alive_connections_between_requests(
        nursery: trio.Nursery) -> None:
    """A server draining: a busy keep-alive client gets `connection: close` on its next
    response (and reconnects elsewhere); one idle all along is closed by close_idle."""
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f:
        async with client(limits=httpx.Limits(max_connections=1)) as busy, \
                client(limits=httpx.Limits(max_connections=1)) as idle:
            assert (await busy.get(f"{f.url}/a")).headers.get("connection") is None
            assert (await idle.get(f"{f.url}/a")).status_code == 200
            f.front.drain(close_idle=False)
            r = await busy.get(f"{f.url}/b")
            assert r.status_code == 200 and r.headers["connection"] == "close"
            f.front.drain(close_idle=True)
            await trio.sleep(1.5)  # cancelled at once, then the lingering close (1 s)
            assert f.front.stats.connections_open == 0
            # The idle client's next request goes out on a new connection.
            assert (await idle.get(f"{f.url}/c")).status_code == 200
        assert f.front.stats.connections_accepted == 3  # busy, idle, idle again


async def test_upstream_closing_keeps_client_connection(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f:
        async with client(limits=httpx.Limits(max_connections=1)) as c:
            assert (await c.get(f"{f.url}/close")).status_code == 200
            r = await c.get(f"{f.url}/after")
            assert r.status_code == 200 and r.json()["connection"] == 2
            r = await c.get(f"{f.url}/http10")
            assert r.status_code == 200 and r.text == "old style body"
            assert r.headers["x-old"] == "yes"
            assert (await c.get(f"{f.url}/again")).status_code == 200
        assert f.front.stats.connections_accepted == 1
        assert f.opener.opens == 3


async def test_stale_kept_upstream_is_redialed(nursery: trio.Nursery) -> None:
    """An upstream that closes idle keep-alive connections: the front dials again."""
    served = 0

    async def closes_after_each(stream: trio.SocketStream) -> None:
        nonlocal served
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(4096)
        served += 1
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await trio.sleep(0.05)
        await stream.aclose()  # no Connection: close was announced

    port = await start_tcp(nursery, closes_after_each)
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f:
        async with client(limits=httpx.Limits(max_connections=1)) as c:
            for _ in range(3):
                r = await c.get(f"{f.url}/")
                assert r.status_code == 200 and r.text == "ok"
                await trio.sleep(0.2)
        assert served == 3 and f.opener.opens == 3
        assert f.front.stats.responses_5xx == 0


async def test_forwarded_and_hop_by_hop_headers(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f, client() as c:
        r = await c.get(
            f"{f.url}/h",
            headers={
                "host": "shop.example.com",
                "x-forwarded-for": "203.0.113.9",
                "x-forwarded-proto": "https",
                "x-forwarded-host": "spoofed",
                "connection": "keep-alive, x-drop-me",
                "x-drop-me": "secret",
                "keep-alive": "timeout=1",
                "te": "trailers",
                "proxy-authorization": "Basic abc",
                "x-kept": "yes",
            },
        )
        seen = dict((n, v) for n, v in r.json()["headers"])
        assert seen["x-forwarded-for"] == "203.0.113.9, 127.0.0.1"
        assert seen["x-forwarded-proto"] == "http"
        assert seen["x-forwarded-host"] == "shop.example.com"
        assert seen["host"] == "shop.example.com"
        assert seen["x-kept"] == "yes"
        for gone in ("x-drop-me", "keep-alive", "te", "proxy-authorization", "connection"):
            assert gone not in seen
        # The upstream's hop-by-hop response headers do not reach the client.
        assert "keep-alive" not in r.headers
        assert "x-secret-hop" not in r.headers


async def test_connection_option_cannot_unframe_the_body(nursery: trio.Nursery) -> None:
    """`Connection: content-length` must not strip the body's framing on the way upstream:
    the body would then reach the upstream as a second, smuggled request."""
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n"
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f:
        out = await raw_exchange(
            f.port,
            b"POST /form HTTP/1.1\r\nHost: h\r\nConnection: close, content-length, host\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(smuggled), smuggled),
        )
    assert out.startswith(b"HTTP/1.1 200 ")
    assert [r["target"] for r in up.requests] == ["/form"]
    assert up.requests[0]["body_length"] == len(smuggled)
    assert ["host", "h"] in up.requests[0]["headers"]


async def test_large_chunked_bodies_stream_with_bounded_memory(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    size = 20 * MiB
    piece = b"y" * 65536

    async def body() -> AsyncIterator[bytes]:
        for _ in range(size // len(piece)):
            yield piece

    want = hashlib.sha256(b"y" * size).hexdigest()
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f, client() as c:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            r = await c.post(f"{f.url}/upload", content=body())
            assert r.status_code == 200
            assert r.json()["body_length"] == size
            assert r.json()["body_sha256"] == want
            assert ["transfer-encoding", "chunked"] in r.json()["headers"]
            received = 0
            async with c.stream("GET", f"{f.url}/big?n={size}") as resp:
                assert resp.headers["transfer-encoding"] == "chunked"
                async for chunk in resp.aiter_raw():
                    received += len(chunk)
            assert received == size
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert peak < 6 * MiB, f"peak {peak / MiB:.1f} MiB while relaying 2 x 20 MiB"


async def test_content_length_body_and_limit(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    limits = Limits(max_body_bytes=1000)
    async with running_front([RouteSpec(None, "/", route_to(port))], limits) as f, client() as c:
        r = await c.post(f"{f.url}/p", content=b"z" * 1000)
        assert r.status_code == 200 and r.json()["body_length"] == 1000
        assert ["content-length", "1000"] in r.json()["headers"]
        r = await c.post(f"{f.url}/p", content=b"z" * 1001)
        assert r.status_code == 413
        assert len(up.requests) == 1


async def test_websocket_upgrade_passthrough(nursery: trio.Nursery, no_tracebacks: None) -> None:
    async def echo(request: Any) -> None:
        ws = await request.accept()
        try:
            while True:
                msg = await ws.get_message()
                await ws.send_message(f"echo:{msg}" if isinstance(msg, str) else msg)
        except Exception:  # the client closed
            pass

    server = await nursery.start(serve_websocket, echo, "127.0.0.1", 0, None)
    async with running_front([RouteSpec(None, "/chat", route_to(server.port))]) as f:
        async with open_websocket_url(f"ws://127.0.0.1:{f.port}/chat") as ws:
            for i in range(5):
                await ws.send_message(f"hello {i}")
                assert await ws.get_message() == f"echo:hello {i}"
            big = bytes(range(256)) * 2000
            await ws.send_message(big)
            assert await ws.get_message() == big
        with trio.fail_after(3):
            while f.front.stats.connections_open:  # noqa: ASYNC110 - a counter, no event
                await trio.sleep(0.01)
        assert f.front.stats.upgrades == 1
        assert f.front.stats.responses_1xx == 1


def switching_upstream(received: list[bytes], close_first: bool = False) -> Any:
    """A raw upstream that switches protocols and talks at once in the same write, then
    records what the client sent until its half-close (or, with `close_first`, until it
    has `early;done`), answers `bye` and closes."""

    async def handle(stream: trio.SocketStream) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += await stream.receive_some(65536)
        data = buf.split(b"\r\n\r\n", 1)[1]
        await stream.send_all(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: raw\r\nConnection: upgrade\r\n"
            b"Keep-Alive: timeout=5\r\n\r\nhello;"
        )
        while not (close_first and data == b"early;done"):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
        received.append(data)
        await stream.send_all(b"bye")
        await stream.aclose()

    return handle


UPGRADE = b"GET /raw HTTP/1.1\r\nHost: h\r\nConnection: upgrade\r\nUpgrade: raw\r\n\r\n"


async def read_until_eof(stream: trio.abc.Stream) -> bytes:
    out = b""
    try:
        while chunk := await stream.receive_some(65536):
            out += chunk
    except trio.BrokenResourceError:
        pass
    return out


async def test_upgrade_relays_early_bytes_and_half_close(nursery: trio.Nursery) -> None:
    received: list[bytes] = []
    port = await start_tcp(nursery, switching_upstream(received))
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f:
        stream = await trio.open_tcp_stream("127.0.0.1", f.port)
        # Bytes of the new protocol in the request's own segment: h11 has already read
        # them when the 101 arrives, and they must still reach the upstream first.
        await stream.send_all(UPGRADE + b"early;")
        await stream.send_all(b"later")
        head = b""
        with trio.fail_after(5):
            while not head.endswith(b"hello;"):
                head += await stream.receive_some(65536)
            await stream.send_eof()  # the half-close reaches the upstream as EOF
            rest = await read_until_eof(stream)
        assert head.startswith(b"HTTP/1.1 101 ")
        assert b"upgrade: raw" in head and b"keep-alive" not in head
        assert rest == b"bye"
        assert received == [b"early;later"]
        await stream.aclose()
        assert f.front.stats.upgrades == 1


async def test_upgrade_over_tls_ends_when_the_upstream_closes(nursery: trio.Nursery) -> None:
    """A TLS client cannot be half-closed: the upstream's EOF closes the connection."""
    received: list[bytes] = []
    port = await start_tcp(nursery, switching_upstream(received, close_first=True))
    ca = trustme.CA()
    cert = ca.issue_cert("h")
    store = CertStore(
        {"h": context_from_pem(cert.cert_chain_pems[0].bytes(), cert.private_key_pem.bytes())}
    )
    specs = [RouteSpec(None, "/", route_to(port))]
    async with running_front(specs, tls=TlsConfig(store)) as f:
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        tcp = await trio.open_tcp_stream("127.0.0.1", f.port)
        stream = trio.SSLStream(tcp, ctx, server_hostname="h")
        await stream.send_all(UPGRADE + b"early;")
        head = b""
        with trio.fail_after(5):
            while not head.endswith(b"hello;"):
                head += await stream.receive_some(65536)
            await stream.send_all(b"done")
            # The client never closes: only the upstream's close can end the connection.
            rest = await read_until_eof(stream)
            while f.front.stats.connections_open:  # noqa: ASYNC110 - a counter, no event
                await trio.sleep(0.01)
        assert head.startswith(b"HTTP/1.1 101 ")
        assert rest == b"bye"
        assert received == [b"early;done"]
        await trio.aclose_forcefully(stream)


async def test_error_statuses(nursery: trio.Nursery, no_tracebacks: None) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()

    async def hangs_up(stream: trio.SocketStream) -> None:
        await stream.receive_some(4096)
        await stream.aclose()

    rude_port = await start_tcp(nursery, hangs_up)
    specs = [
        RouteSpec("empty", "/", Route("empty", ())),
        RouteSpec("dead", "/", route_to(dead_port, "dead")),
        RouteSpec("rude", "/", route_to(rude_port, "rude")),
        RouteSpec("slow", "/", route_to(port, "slow")),
        RouteSpec("ok", "/", route_to(port, "ok")),
    ]
    limits = Limits(dial_timeout=0.3, response_timeout=0.5)
    async with running_front(specs, limits) as f, client() as c:
        r = await c.get(f"{f.url}/", headers={"host": "empty"})
        assert r.status_code == 503 and "route empty has no ready backends" in r.text
        r = await c.get(f"{f.url}/", headers={"host": "dead"})
        assert r.status_code == 502 and "cannot connect" in r.text
        r = await c.get(f"{f.url}/", headers={"host": "rude"})
        assert r.status_code == 502 and "closed" in r.text
        r = await c.get(f"{f.url}/sleep?s=2", headers={"host": "slow"})
        assert r.status_code == 504 and "timed out" in r.text

        f.opener.fail = UpstreamUnavailable(502, "node edge-1 is not connected")
        r = await c.get(f"{f.url}/", headers={"host": "ok"})
        assert r.status_code == 502 and "node edge-1 is not connected" in r.text
        f.opener.fail = None
        f.opener.delay = 1.0
        r = await c.get(f"{f.url}/", headers={"host": "ok"})
        assert r.status_code == 504 and "timed out after 0.3s" in r.text
        f.opener.delay = 0
        r = await c.get(f"{f.url}/", headers={"host": "ok"})
        assert r.status_code == 200
        assert f.front.stats.responses_5xx == 6


async def test_balances_and_skips_failed_backends(nursery: trio.Nursery) -> None:
    a, b = Upstream("a"), Upstream("b")
    pa, pb = await start_tcp(nursery, a.handle), await start_tcp(nursery, b.handle)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    backends = tuple(Backend(None, "127.0.0.1", p) for p in (pa, dead_port, pb))
    async with running_front([RouteSpec(None, "/", Route("lb", backends))]) as f:
        for _ in range(6):
            async with client() as c:  # a new client connection each time
                assert (await c.get(f"{f.url}/")).status_code == 200
        assert len(a.requests) >= 2 and len(b.requests) >= 2
        dead_dials = [x for x in f.opener.backends if x.port == dead_port]
        assert len(dead_dials) == 1  # tried once, then skipped during its cooldown


async def test_route_swap_does_not_disturb_request_in_flight(nursery: trio.Nursery) -> None:
    a, b = Upstream("a"), Upstream("b")
    pa, pb = await start_tcp(nursery, a.handle), await start_tcp(nursery, b.handle)
    async with running_front([RouteSpec(None, "/", route_to(pa, "r"))]) as f:
        async with client(limits=httpx.Limits(max_connections=1)) as c:
            results: list[httpx.Response] = []

            async def slow() -> None:
                results.append(await c.get(f"{f.url}/sleep?s=0.5"))

            async with trio.open_nursery() as n:
                n.start_soon(slow)
                await trio.sleep(0.2)
                f.set_routes([RouteSpec(None, "/", route_to(pb, "r"))])
            assert results[0].status_code == 200 and results[0].json()["upstream"] == "a"
            # The same client connection now goes to the new backend.
            r = await c.get(f"{f.url}/next")
            assert r.json()["upstream"] == "b"
        assert f.front.stats.connections_accepted == 1


async def test_tls_redirect(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    route = Route("secure", (Backend(None, "127.0.0.1", port),), tls_redirect=True)
    async with running_front([RouteSpec("secure.test", "/", route)]) as f, client() as c:
        r = await c.get(f"{f.url}/a/b?x=1", headers={"host": "secure.test:8080"})
        assert r.status_code == 308
        assert r.headers["location"] == "https://secure.test/a/b?x=1"
        assert up.requests == []


async def test_malformed_request_gets_400(nursery: trio.Nursery, no_tracebacks: None) -> None:
    async with running_front([]) as f:
        out = await raw_exchange(f.port, b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400 ")
        assert b"malformed request" in out
        out = await raw_exchange(f.port, b"\x16\x03\x01\x02\x00garbage\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400 ")
        big = b"GET / HTTP/1.1\r\nHost: x\r\nx-big: " + b"a" * 200_000 + b"\r\n\r\n"
        out = await raw_exchange(f.port, big)
        assert out.startswith(b"HTTP/1.1 431 ")
        assert f.front.stats.bad_requests == 3


async def test_header_timeout_408_and_idle_close(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    limits = Limits(header_timeout=0.3, idle_timeout=0.5)
    async with running_front([RouteSpec(None, "/", route_to(port))], limits) as f:
        with trio.fail_after(3):
            out = await raw_exchange(f.port, b"GET / HTTP/1.1\r\nHost: x\r\n")
        assert out.startswith(b"HTTP/1.1 408 ")
        with trio.fail_after(3):
            out = await raw_exchange(f.port, b"")  # says nothing at all
        assert out.startswith(b"HTTP/1.1 408 ")
        # After a complete request the idle keep-alive timeout closes without a word.
        start = trio.current_time()
        with trio.fail_after(30):  # hang guard
            out = await raw_exchange(f.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200 ") and out.count(b"HTTP/1.1") == 1
        # Kept open for the idle timeout first (a lower bound: load only lengthens it).
        assert trio.current_time() - start >= 0.4
        assert f.front.stats.timeouts == 2


async def test_a_request_received_during_the_previous_one_then_idle_close(
        nursery: trio.Nursery) -> None:
    """A kept-alive client's next request, already received when its previous response
    went out, is read without the keep-alive wait (`HttpConnection._read_now`); the wait
    after it still ends the connection: the idle timeout, or a draining front's
    close_idle."""
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    limits = Limits(idle_timeout=0.5)
    first = b"GET /sleep?s=0.3 HTTP/1.1\r\nHost: h\r\n\r\n"
    second = b"GET /two HTTP/1.1\r\nHost: h\r\n\r\n"

    async def two_requests(stream: trio.SocketStream) -> bytes:
        await stream.send_all(first)
        await trio.sleep(0.1)  # the front waits for the upstream's answer meanwhile
        await stream.send_all(second)
        got = b""
        while got.count(b"HTTP/1.1 200 ") < 2 or not got.endswith(b"}"):
            data = await stream.receive_some(65536)
            assert data, got
            got += data
        assert b'"/two"' in got
        return got

    async with running_front([RouteSpec(None, "/", route_to(port))], limits) as f:
        stream = await trio.open_tcp_stream("127.0.0.1", f.port)
        with trio.fail_after(30):  # hang guard
            await two_requests(stream)
            assert await stream.receive_some(65536) == b""  # the idle timeout closed it
        assert f.front.stats.requests == 2 and f.front.stats.responses_2xx == 2
        assert f.opener.opens == 1  # one upstream, kept alive
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f:  # idle: 60 s
        stream = await trio.open_tcp_stream("127.0.0.1", f.port)
        with trio.fail_after(30):
            await two_requests(stream)
            await trio.sleep(0.1)  # waiting for a third request now
            f.front.drain(close_idle=True)
            assert await stream.receive_some(65536) == b""  # close_idle closed it


async def test_response_timeout_fires_and_waits_nowhere_else(nursery: trio.Nursery) -> None:
    """The response timeout (the connection's timer, armed only while the front waits
    for the upstream): a slow upstream is answered 504 and counted, the same keep-alive
    connection then serves requests, a keep-alive wait and a WebSocket longer than the
    timeout are not cut by it."""
    up = Upstream()
    port = await start_tcp(nursery, up.handle)

    async def echo(request: Any) -> None:
        ws = await request.accept()
        with contextlib.suppress(Exception):  # the client closed
            while True:
                await ws.send_message(await ws.get_message())

    server = await nursery.start(serve_websocket, echo, "127.0.0.1", 0, None)
    specs = [RouteSpec(None, "/chat", route_to(server.port, "ws")),
             RouteSpec(None, "/", route_to(port))]
    async with running_front(specs, Limits(response_timeout=0.5)) as f:
        stats = f.front.stats
        stream = await trio.open_tcp_stream("127.0.0.1", f.port)

        async def get(path: str) -> bytes:
            await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: h\r\n\r\n".encode())
            got = b""
            while b"\r\n\r\n" not in got or not got.endswith((b"}", b"s\n")):
                data = await stream.receive_some(65536)
                assert data, got
                got += data
            return got

        with trio.fail_after(30):  # hang guard
            got = await get("/sleep?s=2")
            assert got.startswith(b"HTTP/1.1 504 ") and b"timed out after 0.5s" in got
            assert stats.timeouts == 1 and stats.upstream_errors == 1
            assert stats.by_route["r", "h1", "5xx"] == 1
            # The same connection goes on, on a new upstream: the timer was replaced.
            assert (await get("/sleep?s=0.2")).startswith(b"HTTP/1.1 200 ")
            await trio.sleep(0.8)  # a keep-alive wait longer than the response timeout
            assert (await get("/after-wait")).startswith(b"HTTP/1.1 200 ")
            assert stats.timeouts == 1 and stats.by_route["r", "h1", "2xx"] == 2
            assert f.opener.opens == 2
            async with open_websocket_url(f"ws://127.0.0.1:{f.port}/chat") as ws:
                await ws.send_message("one")
                assert await ws.get_message() == "one"
                await trio.sleep(0.8)  # longer than the response timeout
                await ws.send_message("two")
                assert await ws.get_message() == "two"
        await stream.aclose()
        assert stats.timeouts == 1 and stats.upgrades == 1


async def test_tls_termination_by_sni(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    ca = trustme.CA()
    app = ca.issue_cert("app.example.com")
    wild = ca.issue_cert("*.wild.test")
    store = CertStore(
        {
            "app.example.com": context_from_pem(
                app.cert_chain_pems[0].bytes(), app.private_key_pem.bytes()
            ),
            "*.wild.test": context_from_pem(
                b"".join(p.bytes() for p in wild.cert_chain_pems), wild.private_key_pem.bytes()
            ),
        }
    )
    specs = [RouteSpec(None, "/", route_to(port))]
    async with running_front(specs, tls=TlsConfig(store, handshake_timeout=2)) as f:
        client_ctx = ssl.create_default_context()
        ca.configure_trust(client_ctx)

        async def get(sni: str) -> bytes:
            tcp = await trio.open_tcp_stream("127.0.0.1", f.port)
            stream = trio.SSLStream(tcp, client_ctx, server_hostname=sni)
            await stream.send_all(
                f"POST /tls HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n"
                "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".encode()
            )
            out = b""
            try:
                while chunk := await stream.receive_some(65536):
                    out += chunk
            except trio.BrokenResourceError:
                pass
            await trio.aclose_forcefully(stream)
            return out

        for name in ("app.example.com", "a.wild.test"):
            out = await get(name)
            assert out.startswith(b"HTTP/1.1 200 ")
            doc = json.loads(out.split(b"\r\n\r\n", 1)[1])
            assert ["x-forwarded-proto", "https"] in doc["headers"]
            assert doc["body_length"] == 5
        with pytest.raises(trio.BrokenResourceError):
            await get("unknown.test")
        assert f.front.stats.tls_handshake_errors == 1


# -- garbage in, never a traceback ---------------------------------------------------------

_request_parts = st.sampled_from(
    [
        b"GET / HTTP/1.1\r\n",
        b"POST /x HTTP/1.1\r\n",
        b"GET http://h/abs HTTP/1.1\r\n",
        b"CONNECT h:443 HTTP/1.1\r\n",
        b"Host: a\r\n",
        b"Host: b\r\nHost: c\r\n",
        b"Content-Length: 5\r\n",
        b"Content-Length: -1\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: gzip\r\n",
        b"Upgrade: websocket\r\nConnection: upgrade\r\n",
        b"\r\n",
        b"5\r\nhello\r\n0\r\n\r\n",
        b"zz\r\n",
        b"\x00\xff",
        b" ",
    ]
)
_garbage = st.one_of(
    st.binary(max_size=300),
    st.lists(_request_parts, max_size=8).map(b"".join),
    st.tuples(st.lists(_request_parts, max_size=6).map(b"".join), st.binary(max_size=40)).map(
        lambda t: t[0] + t[1]
    ),
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(inputs=st.lists(_garbage, min_size=1, max_size=5))
def test_garbage_never_crashes(inputs: list[bytes], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.clear()

    async def run() -> None:
        async def ok(stream: trio.SocketStream) -> None:
            try:
                await stream.receive_some(65536)
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            except trio.BrokenResourceError:
                pass
            await stream.aclose()

        async with trio.open_nursery() as nursery:
            port = await start_tcp(nursery, ok)
            limits = Limits(header_timeout=0.3, idle_timeout=0.3, response_timeout=0.5)
            specs = [RouteSpec(None, "/", route_to(port))]
            async with running_front(specs, limits) as f:
                async with trio.open_nursery() as clients:
                    for data in inputs:

                        async def one(data: bytes = data) -> None:
                            with trio.fail_after(5):
                                out = await raw_exchange(f.port, data)
                            assert out == b"" or out.startswith(b"HTTP/1.1 "), out[:80]

                        clients.start_soon(one)
            nursery.cancel_scope.cancel()

    trio.run(run)
    assert "Traceback" not in caplog.text
    for record in caplog.records:
        assert record.exc_info is None and record.levelno < logging.ERROR, record.getMessage()


async def test_pipelined_requests_and_expect_continue(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f:
        two = (
            b"GET /one HTTP/1.1\r\nHost: h\r\n\r\n"
            b"GET /two HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        )
        out = await raw_exchange(f.port, two)
        assert out.count(b"HTTP/1.1 200 ") == 2
        assert out.index(b'"/one"') < out.index(b'"/two"')
        assert f.opener.opens == 1

        stream = await trio.open_tcp_stream("127.0.0.1", f.port)
        await stream.send_all(
            b"POST /e HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
        )
        with trio.fail_after(5):
            first = await stream.receive_some(65536)
        assert first.startswith(b"HTTP/1.1 100 ")
        await stream.send_all(b"hello")
        got = b""
        with trio.fail_after(5):
            while b"}" not in got:
                got += await stream.receive_some(65536)
        assert got.startswith(b"HTTP/1.1 200 ") and b'"body_length": 5' in got
        await stream.aclose()


async def test_response_framing_for_old_and_closing_clients(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f:
        with trio.fail_after(5):
            out = await raw_exchange(f.port, b"GET /big?n=10 HTTP/1.0\r\nHost: h\r\n\r\n")
        head, body = out.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert b"transfer-encoding" not in head.lower() and b"connection: close" in head
        assert body == b"x" * 10  # unknown length to HTTP/1.0: until close
        with trio.fail_after(5):
            out = await raw_exchange(
                f.port, b"GET /big?n=10 HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
            )
        head, body = out.split(b"\r\n\r\n", 1)
        assert b"transfer-encoding: chunked" in head and b"connection: close" in head
        assert body == b"a\r\nxxxxxxxxxx\r\n0\r\n\r\n"


async def test_error_answer_honours_connection_close() -> None:
    async with running_front([]) as f:
        with trio.fail_after(2):  # closes at once, not after the idle timeout
            out = await raw_exchange(
                f.port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
        assert out.startswith(b"HTTP/1.1 404 ") and b"connection: close" in out.lower()


async def test_error_answer_to_head_has_no_body() -> None:
    """The front's own answers follow HEAD's framing (h11's send path refused to write
    them, and the client got a bare close)."""
    async with running_front([]) as f:
        with trio.fail_after(2):
            out = await raw_exchange(
                f.port, b"HEAD /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
        head, body = out.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 404 ") and b"content-length: " in head
        assert body == b""


async def test_any_half_closeable_stream_is_an_upstream(nursery: trio.Nursery) -> None:
    """The opener may return any HalfCloseableStream (the tunnel's streams, here memory)."""
    import trio.testing

    from nodeagent.http import HttpFront, RouteTable

    up = Upstream("mem")
    opens = 0

    async def opener(backend: Backend, route: Route,
                     client: str = "") -> trio.abc.HalfCloseableStream:
        nonlocal opens
        opens += 1
        near, far = trio.testing.memory_stream_pair()
        nursery.start_soon(up.handle, far)
        return near

    table = RouteTable.build([RouteSpec(None, "/", Route("m", (Backend("edge-1", "svc", 80),)))])
    front = HttpFront(table=lambda: table, open_upstream=opener)
    await nursery.start(front.run, "127.0.0.1", 0)
    async with client(limits=httpx.Limits(max_connections=1)) as c:
        for i in range(3):
            r = await c.post(f"http://127.0.0.1:{front.port}/m{i}", content=b"q" * 100_000)
            assert r.status_code == 200 and r.json()["upstream"] == "mem"
            assert r.json()["body_length"] == 100_000
        async with c.stream("GET", f"http://127.0.0.1:{front.port}/big?n={3 * MiB}") as resp:
            assert sum([len(x) async for x in resp.aiter_raw()]) == 3 * MiB
    assert opens == 1
    front.stop()


async def test_a_client_that_reads_late_gets_the_whole_response(nursery: trio.Nursery) -> None:
    """The plaintext client's socket is written directly while it takes everything; once
    its buffers are full the rest waits in send_all (nothing lost, nothing reordered)."""
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    size = 32 * 1024 * 1024  # more than the loopback socket buffers hold
    async with running_front([RouteSpec(None, "/", route_to(port))]) as f:
        stream = await trio.open_tcp_stream("127.0.0.1", f.port)
        await stream.send_all(
            b"GET /big?n=%d HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n" % size)
        await trio.sleep(1)  # the front fills the socket and has to wait
        got = bytearray()
        with trio.fail_after(60):
            while chunk := await stream.receive_some(1 << 20):
                got += chunk
        await stream.aclose()
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding: chunked" in head.lower()
    assert body.endswith(b"\r\n0\r\n\r\n")
    assert body.count(b"x") == size
