"""The HTTP front speaking HTTP/2: h2c prior knowledge and ALPN h2 on the same ports as
HTTP/1.1, translation to HTTP/1.1 backends and from HTTP/1.1 clients to h2c backends, with
real sockets, httpx clients, an h11 origin and an `h2` origin."""

from __future__ import annotations

import hashlib
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import hpack
import httpx
import hyperframe.frame as hf
import pytest
import trio
import trustme

from nodeagent.http import Backend, CertStore, Limits, Route, RouteSpec, TlsConfig
from nodeagent.http.h2session import PREFACE
from nodeagent.http.tls import context_from_pem
from tests.http.helpers import Front, H2Origin, RawH2, Upstream, running_front, start_tcp


def client(**kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(trust_env=False, timeout=10, **kwargs)


def h2c_client(**kwargs: Any) -> httpx.AsyncClient:
    """HTTP/2 with prior knowledge (no Upgrade dance): what gRPC clients do on plaintext."""
    return client(http1=False, http2=True, **kwargs)


def route_to(port: int, name: str = "r", protocol: str = "h1", ports: tuple[int, ...] = ()
             ) -> Route:
    return Route(name, tuple(Backend(None, "127.0.0.1", p) for p in (port, *ports)),
                 backend_protocol=protocol)  # type: ignore[arg-type]


async def test_h2c_prior_knowledge_and_http11_on_one_port(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    async with running_front([RouteSpec("app.test", "/", route_to(port))]) as f:
        async with h2c_client() as c:
            r = await c.get(f"{f.url}/a?x=1", headers={"host": "app.test",
                                                       "cookie": "a=1", "x-custom": "yes"})
            assert r.http_version == "HTTP/2" and r.status_code == 200
            doc = r.json()
            assert doc["target"] == "/a?x=1"
            headers = dict(doc["headers"])
            assert headers["host"] == "app.test" and headers["x-custom"] == "yes"
            assert headers["x-forwarded-proto"] == "http"
            assert "keep-alive" not in r.headers and "x-secret-hop" not in r.headers
            # Request bodies without a length go chunked to the HTTP/1.1 origin.
            body = b"y" * 300_000
            async def pieces() -> Any:
                yield body[:100_000]
                yield body[100_000:]

            r = await c.post(f"{f.url}/post", content=pieces(),
                             headers={"host": "app.test"})
            assert r.json()["body_length"] == len(body)
            assert r.json()["body_sha256"] == hashlib.sha256(body).hexdigest()
            r = await c.get(f"{f.url}/big?n=3000000", headers={"host": "app.test"})
            assert len(r.content) == 3_000_000
            r = await c.get(f"{f.url}/", headers={"host": "nope.test"})
            assert r.status_code == 404 and r.text.startswith("404 Not Found: no route")
        async with client() as c:
            r = await c.get(f"{f.url}/h1", headers={"host": "app.test"})
            assert r.http_version == "HTTP/1.1" and r.json()["target"] == "/h1"
        stats = f.front.stats
        assert stats.h2_connections == 1 and stats.h2_requests == 4
        # One h2 client connection's requests share kept HTTP/1.1 upstreams.
        assert stats.upstream_reuses >= 2


async def test_alpn_h2_on_tls(nursery: trio.Nursery) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("app.test")
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    ctx = context_from_pem(cert.private_key_and_cert_chain_pem.bytes(),
                           cert.private_key_pem.bytes())
    tls = TlsConfig(certs=CertStore({"app.test": ctx}))
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with running_front([RouteSpec("app.test", "/", route_to(port))], tls=tls) as f:
        transport = httpx.AsyncHTTPTransport(verify=client_ctx, http2=True)
        async with client(transport=transport) as c:
            r = await c.get(f"https://127.0.0.1:{f.port}/tls",
                            headers={"host": "app.test"}, extensions={"sni_hostname": "app.test"})
            assert r.http_version == "HTTP/2" and r.json()["target"] == "/tls"
            assert dict(r.json()["headers"])["x-forwarded-proto"] == "https"
        transport = httpx.AsyncHTTPTransport(verify=client_ctx, http2=False)
        async with client(transport=transport) as c:
            r = await c.get(f"https://127.0.0.1:{f.port}/tls1",
                            headers={"host": "app.test"}, extensions={"sni_hostname": "app.test"})
            assert r.http_version == "HTTP/1.1" and r.json()["target"] == "/tls1"


async def test_h2c_backend_from_h2_and_http11_clients(nursery: trio.Nursery) -> None:
    origin = H2Origin()
    port = await start_tcp(nursery, origin.handle)
    async with running_front([RouteSpec(None, "/", route_to(port, protocol="h2c"))]) as f:
        async with h2c_client() as c:
            for i in range(5):
                r = await c.post(f"{f.url}/p{i}", content=b"abc" * i)
                assert r.http_version == "HTTP/2" and r.json()["target"] == f"/p{i}"
                assert r.json()["body_length"] == 3 * i
            r = await c.get(f"{f.url}/big?n=5000000")
            assert len(r.content) == 5_000_000
        async with client() as c:
            r = await c.post(f"{f.url}/from-h1", content=b"hello")
            assert r.http_version == "HTTP/1.1" and r.status_code == 200
            doc = r.json()
            assert doc["target"] == "/from-h1" and doc["body_length"] == 5
            assert dict(doc["headers"])[":authority"] == f"127.0.0.1:{f.port}"
            r = await c.get(f"{f.url}/big?n=1000000")
            assert len(r.content) == 1_000_000
            r = await c.get(f"{f.url}/reset")
            assert r.status_code == 502
        # Every request on one shared h2c connection.
        assert origin.connections == 1
        assert [d["connection"] for d in origin.requests] == [1] * len(origin.requests)


async def test_a_lost_h2c_connection_fails_only_its_requests(nursery: trio.Nursery) -> None:
    """Two backends, one call in flight on each; one backend's connection dies: its call
    fails (502), the other's completes, and the next call to it dials a new connection."""
    a, b = H2Origin("a"), H2Origin("b")
    pa, pb = await start_tcp(nursery, a.handle), await start_tcp(nursery, b.handle)
    route = route_to(pa, protocol="h2c", ports=(pb,))
    async with running_front([RouteSpec(None, "/", route)]) as f, h2c_client() as c:
        results: dict[str, Any] = {}

        async def call(key: str) -> None:
            results[key] = await c.get(f"{f.url}/slow")

        async with trio.open_nursery() as calls:
            calls.start_soon(call, "first")
            calls.start_soon(call, "second")
            with trio.fail_after(5):
                while a.open_streams + b.open_streams < 2:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            await a.drop()
        statuses = sorted((r.status_code, r.json()["upstream"] if r.status_code == 200
                           else r.text) for r in results.values())
        assert statuses[0] == (200, "b"), statuses
        assert statuses[1][0] == 502 and "h2c" in statuses[1][1], statuses
        r1, r2 = await c.get(f"{f.url}/x"), await c.get(f"{f.url}/y")
        assert {r1.json()["upstream"], r2.json()["upstream"]} == {"a", "b"}
        assert a.connections == 2 and b.connections == 1


async def test_a_slow_reader_costs_the_windows_not_the_response(nursery: trio.Nursery) -> None:
    """A client that never opens its window gets 64 KiB; the backend's h2c stream stops at
    the front's stream window (4 MiB): 16 MiB asked, about 4 MiB moved. Granting the
    window moves the rest."""
    from nodeagent.http.h2pool import UPSTREAM_SETTINGS

    window = UPSTREAM_SETTINGS.stream_window
    asked = 16 * 1024 * 1024
    assert window == 4 * 1024 * 1024 and window * 2 < asked
    origin = H2Origin()
    port = await start_tcp(nursery, origin.handle)
    async with running_front([RouteSpec(None, "/", route_to(port, protocol="h2c"))]) as f:
        client = await RawH2.connect(f.port)
        sid = await client.request(f"/big?n={asked}")
        await client.pump(2.0, grant=False)
        assert client.status[sid] == 200
        assert client.body[sid] <= 65535
        assert origin.body_bytes_sent <= window + 65535, origin.body_bytes_sent
        with trio.fail_after(60):
            while sid not in client.ended:
                await client.pump(1.0, grant=True)
        assert client.body[sid] == asked
        await client.aclose()


async def test_a_client_that_stops_reading_tcp_holds_back_the_backend(
        nursery: trio.Nursery) -> None:
    """Windows wide open (2 GiB) but the socket never read: the front's writer blocks, the
    stream's next write waits for it, the backend's window is not given back, and the
    backend stops: far less than the 256 MiB asked leaves it (socket buffers, windows and
    one write round), not everything into the front's memory."""
    import h2.settings

    origin = H2Origin()
    port = await start_tcp(nursery, origin.handle)
    async with running_front([RouteSpec(None, "/", route_to(port, protocol="h2c"))]) as f:
        client = await RawH2.connect(f.port)
        big = 2**31 - 1
        client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: big})
        client.conn.increment_flow_control_window(big - 65535)
        await client.request(f"/big?n={256 * 1024 * 1024}")
        await trio.sleep(3.0)
        sent = origin.body_bytes_sent
        assert 0 < sent <= 16 * 1024 * 1024, sent
        await trio.sleep(1.0)
        assert origin.body_bytes_sent - sent <= 1024 * 1024  # it stays stopped
        await client.stream.aclose()


async def test_drain_sends_goaway_and_calls_in_flight_finish(nursery: trio.Nursery) -> None:
    origin = H2Origin()
    port = await start_tcp(nursery, origin.handle)
    async with running_front([RouteSpec(None, "/", route_to(port, protocol="h2c"))]) as f:
        client = await RawH2.connect(f.port)
        first = await client.request("/slow")
        second = await client.request("/slow")
        with trio.fail_after(5):
            while origin.open_streams < 2:  # noqa: ASYNC110
                await trio.sleep(0.01)
        f.front.drain(close_idle=False)
        await client.pump(0.3, grant=True)
        assert client.goaway == second  # GOAWAY at once, naming the last stream taken
        # A stream the client opened before it read the GOAWAY: refused, never served (h2
        # itself no longer sends after GOAWAY, so the frame is written by hand).
        late = second + 2
        frame = hf.HeadersFrame(late)
        frame.data = hpack.Encoder().encode([(b":method", b"GET"), (b":scheme", b"http"),
                                             (b":authority", b"app.test"), (b":path", b"/late")])
        frame.flags.add("END_HEADERS")
        frame.flags.add("END_STREAM")
        await client.stream.send_all(frame.serialize())
        with trio.fail_after(10):
            while not client.closed:
                await client.pump(1.0, grant=True)
        assert client.status[first] == client.status[second] == 200
        assert {first, second} <= client.ended and late not in client.status
        assert client.refused == {late: 7}  # REFUSED_STREAM: safe to retry elsewhere
        assert "/late" not in [d["target"] for d in origin.requests]


async def test_a_backend_draining_with_goaway_finishes_its_calls(nursery: trio.Nursery) -> None:
    """An h2c backend that drains (GOAWAY naming the streams it will still answer) has its
    calls in flight answered; the next call dials a new connection."""
    origin = H2Origin()
    port = await start_tcp(nursery, origin.handle)
    async with running_front([RouteSpec(None, "/", route_to(port, protocol="h2c"))]) as f:
        async with h2c_client() as c:
            r = await c.get(f"{f.url}/goaway")
            assert r.status_code == 200 and r.json()["target"] == "/goaway"
            assert origin.goaways_sent == 1
            r = await c.get(f"{f.url}/after")
            assert r.status_code == 200 and r.json()["connection"] == 2


async def test_bad_http2_input_ends_the_connection_cleanly(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """Malformed HTTP/2 (a head without :path, an uppercase field name, a connection-
    specific field, garbage frames, a preface cut short): GOAWAY or a close, counted as a
    refusal, never a traceback; the front goes on serving."""
    caplog.set_level(logging.INFO)
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    enc = hpack.Encoder()
    good = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"app.test")]

    def headers_frame(fields: list[tuple[bytes, bytes]]) -> bytes:
        frame = hf.HeadersFrame(1)
        frame.data = hpack.Encoder().encode(fields)
        frame.flags.add("END_HEADERS")
        frame.flags.add("END_STREAM")
        return frame.serialize()

    settings = PREFACE + hf.SettingsFrame(0).serialize()
    attacks = [
        settings + headers_frame(good),  # no :path
        settings + headers_frame([*good, (b":path", b"/"), (b"X-Upper", b"1")]),
        settings + headers_frame([*good, (b":path", b"/"), (b"connection", b"close")]),
        settings + b"\x00\x00\x04\x08\x00\x00\x00\x00\x00" + b"\xff" * 4,  # bad WINDOW_UPDATE
        # A frame announcing 16 MiB: refused once more than the largest allowed frame
        # (256 KiB) is in, not buffered to its end.
        settings + b"\xff" * 9 + b"\x00" * 300_000,
        PREFACE[:10],
    ]
    del enc
    limits = Limits(header_timeout=1.0)
    async with running_front([RouteSpec(None, "/", route_to(port))], limits) as f:
        for data in attacks:
            stream = await trio.open_tcp_stream("127.0.0.1", f.port)
            await stream.send_all(data)
            with trio.fail_after(15):
                got = b""
                try:
                    while chunk := await stream.receive_some(65536):
                        got += chunk
                except trio.BrokenResourceError:
                    pass
            await stream.aclose()
        stats = f.front.stats
        assert stats.refused_h2_protocol_error == 4, stats
        assert stats.refused_h2_frame_too_large == 1, stats  # refused on its header
        assert stats.refused_head_timeout == 1, stats  # the preface cut short
        async with h2c_client() as c:
            assert (await c.get(f"{f.url}/still")).json()["target"] == "/still"
    for record in caplog.records:
        assert record.exc_info is None and record.levelno < logging.ERROR, record.getMessage()


async def test_a_zero_window_stall_is_reset_after_the_idle_timeout(
        nursery: trio.Nursery) -> None:
    """A client that never opens its window holds one stream task and the windows, and
    only until `idle_timeout`: then the stream is reset, counted, and the backend's stream
    with it."""
    origin = H2Origin()
    port = await start_tcp(nursery, origin.handle)
    limits = Limits(idle_timeout=1.0)
    async with running_front([RouteSpec(None, "/", route_to(port, protocol="h2c"))],
                             limits) as f:
        client = await RawH2.connect(f.port)
        sid = await client.request("/big?n=8388608")
        with trio.fail_after(10):
            while f.front.stats.refused_h2_window_stalled == 0:
                await client.pump(0.2, grant=False)
        await client.pump(0.5, grant=False)
        assert client.body[sid] <= 65535 and sid not in client.ended
        assert origin.resets_received == 1  # the backend's stream was reset too
        await client.aclose()


async def test_a_slow_preface_or_frame_is_dropped_after_the_header_timeout(
        nursery: trio.Nursery) -> None:
    """Before its first request, or with a frame half-sent, an idle HTTP/2 connection gets
    `header_timeout` (as an HTTP/1.1 head does), not `idle_timeout`."""
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    limits = Limits(header_timeout=0.5, idle_timeout=60)
    head = hf.HeadersFrame(1)
    head.data = hpack.Encoder().encode([(b":method", b"GET"), (b":scheme", b"http"),
                                        (b":authority", b"a.test"), (b":path", b"/")])
    head.flags.add("END_HEADERS")
    head.flags.add("END_STREAM")
    settings = PREFACE + hf.SettingsFrame(0).serialize()
    async with running_front([RouteSpec(None, "/", route_to(port))], limits) as f:
        for data in (settings, settings + head.serialize()[:12]):
            stream = await trio.open_tcp_stream("127.0.0.1", f.port)
            await stream.send_all(data)
            with trio.fail_after(10):  # idle_timeout would be 60 s
                try:
                    while await stream.receive_some(65536):
                        pass
                except trio.BrokenResourceError:
                    pass
            await stream.aclose()
        assert f.front.stats.h2_connections == 2


# -- requests relayed without a task of their own (h2c backends) -----------------------------


@asynccontextmanager
async def warm_h2c_front(nursery: trio.Nursery, limits: Limits | None = None,
                         ) -> AsyncIterator[tuple[H2Origin, Front, RawH2]]:
    """An h2c origin behind a front and a client of it, after a first request: that one
    dials the backend's h2c connection (a task does that); the next ones find it live and
    go without a task. Yields the origin, the running front and the client."""
    origin = H2Origin()
    port = await start_tcp(nursery, origin.handle)
    routes = [RouteSpec(None, "/", route_to(port, protocol="h2c"))]
    async with running_front(routes, limits) as f:
        client = await RawH2.connect(f.port)
        sid = await client.send("/warm")
        await client.wait_for(lambda: sid in client.ended)
        yield origin, f, client


async def test_whole_requests_to_an_h2c_backend_go_without_a_task(
        nursery: trio.Nursery) -> None:
    """Requests whose body came with their head (or that have none), to a live h2c
    connection, are relayed by the connections' readers: answered with the body, the
    trailers and the statuses as a task would, and counted per route."""
    async with warm_h2c_front(nursery) as (origin, f, client):
        get = await client.send("/get")
        post = await client.send("/post", b"z" * 5000, [(b"te", b"trailers")])
        reset = await client.send("/reset")
        await client.wait_for(lambda: {get, post, reset} <= client.ended)
        assert client.status[get] == client.status[post] == 200
        assert client.status[reset] == 502  # the backend reset its stream before a head
        trailers = dict(client.heads[post])
        assert trailers[b"x-body-sha256"] == hashlib.sha256(b"z" * 5000).hexdigest().encode()
        assert [d["body_length"] for d in origin.requests if d["target"] == "/post"] == [5000]
        stats = f.front.stats
        assert stats.h2_direct_streams == 3, stats
        assert stats.upstream_errors == 1  # the backend's reset
        assert origin.connections == 1
        await client.aclose()


async def test_a_whole_request_body_goes_on_joined_with_end_stream_on_its_last_frame(
        nursery: trio.Nursery) -> None:
    """A request relayed without a task sends its body's pieces joined, in order, in
    frames no larger than the backend takes, END_STREAM on the last one (no empty DATA
    frame after it); with request trailers, the body and then the trailers, which end
    the stream; a client's own empty closing DATA frame is not passed on as one."""
    async with warm_h2c_front(nursery) as (origin, f, client):
        conn = client.conn
        head = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"app.test")]
        pieces = [b"a" * 1000, b"b" * 20000, b"c" * 5]
        joined = await client.send("/joined", b"", [(b"te", b"trailers")])  # a GET first
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [*head, (b":path", b"/pieces"), (b"te", b"trailers")])
        for i, piece in enumerate(pieces):
            conn.send_data(sid, piece, end_stream=i == len(pieces) - 1)
        with_trailers = conn.get_next_available_stream_id()
        conn.send_headers(with_trailers, [*head, (b":path", b"/trailers")])
        conn.send_data(with_trailers, b"x" * 100)
        conn.send_headers(with_trailers, [(b"x-t", b"1")], end_stream=True)
        empty_end = conn.get_next_available_stream_id()
        conn.send_headers(empty_end, [*head, (b":path", b"/empty-end")])
        conn.send_data(empty_end, b"y" * 10)
        conn.end_stream(empty_end)  # an empty DATA frame with END_STREAM
        await client.flush()
        await client.wait_for(lambda: {joined, sid, with_trailers, empty_end} <= client.ended)
        assert {client.status[s] for s in (joined, sid, with_trailers, empty_end)} == {200}
        body = b"".join(pieces)
        assert dict(client.heads[sid])[b"x-body-sha256"] == hashlib.sha256(body).hexdigest(
            ).encode()
        assert origin.data_frames["/pieces"] == [(16384, False), (len(body) - 16384, True)]
        assert origin.data_frames["/trailers"] == [(100, False)]
        assert origin.request_trailers["/trailers"] == [(b"x-t", b"1")]
        assert origin.data_frames["/empty-end"] == [(10, True)]
        assert origin.data_frames["/joined"] == []
        assert f.front.stats.h2_direct_streams == 4, f.front.stats
        await client.aclose()


async def test_a_stream_without_a_task_honours_reset_and_deadlines(
        nursery: trio.Nursery) -> None:
    """Without a task, the client's RST_STREAM still resets the backend's stream, the
    response head still times out (504) and a gRPC call's `grpc-timeout` still ends it
    (DEADLINE_EXCEEDED), each resetting the backend's stream; a lost backend connection
    fails the stream (502)."""
    grpc = [(b"content-type", b"application/grpc"), (b"te", b"trailers")]
    async with warm_h2c_front(nursery, Limits(response_timeout=0.5)) as (origin, f, client):
        stats = f.front.stats
        cancelled = await client.send("/hang")
        with trio.fail_after(5):
            while origin.open_streams < 1:
                await client.pump(0.02, grant=True)
        await client.reset(cancelled)
        with trio.fail_after(5):
            while origin.resets_received < 1:
                await client.pump(0.02, grant=True)
        assert stats.h2_client_resets == 1
        slow = await client.send("/hang")
        call = await client.send("/hang", b"\x00\x00\x00\x00\x00",
                                 [*grpc, (b"grpc-timeout", b"300m")])
        await client.wait_for(lambda: {slow, call} <= client.ended)
        assert client.status[slow] == 504
        head = dict(client.heads[call])
        assert head[b"grpc-status"] == b"4", head  # DEADLINE_EXCEEDED
        with trio.fail_after(5):
            while origin.resets_received < 3:
                await client.pump(0.02, grant=True)
        assert stats.timeouts == 2
        lost = await client.send("/hang")
        with trio.fail_after(5):
            while origin.open_streams < 1:
                await client.pump(0.02, grant=True)
        await origin.drop()
        await client.wait_for(lambda: lost in client.ended)
        assert client.status[lost] == 502
        assert stats.h2_direct_streams == 4, stats
        await client.aclose()


async def test_a_stream_without_a_task_waits_for_the_window_in_a_task(
        nursery: trio.Nursery) -> None:
    """A response larger than the client's window: the stream goes on in a task of its
    own once the window is shut, within the windows as before (64 KiB to a client that
    does not read, the backend held at the front's stream window), and finishes when
    the client reads."""
    async with warm_h2c_front(nursery) as (origin, f, client):
        sid = await client.send("/big?n=16777216")
        await client.pump(2.0, grant=False)
        assert client.status[sid] == 200
        assert client.body[sid] <= 65535
        assert origin.body_bytes_sent <= 4 * 1024 * 1024 + 65535, origin.body_bytes_sent
        await client.wait_for(lambda: sid in client.ended, 60)
        assert client.body[sid] == 16 * 1024 * 1024
        assert f.front.stats.h2_direct_streams == 1
        await client.aclose()


async def test_drain_lets_streams_without_a_task_finish(nursery: trio.Nursery) -> None:
    async with warm_h2c_front(nursery) as (origin, f, client):
        sid = await client.send("/slow")
        with trio.fail_after(5):
            while origin.open_streams < 1:
                await client.pump(0.02, grant=True)
        f.front.drain(close_idle=False)
        await client.wait_for(lambda: client.closed, 10)
        assert client.goaway == sid and client.status[sid] == 200 and sid in client.ended
        assert f.front.stats.h2_direct_streams == 1


async def test_backends_send_frames_of_up_to_256_kib_and_no_larger(
        nursery: trio.Nursery) -> None:
    """The front takes 256 KiB frames from h2c backends (`h2pool.UPSTREAM_SETTINGS`: a
    body in a sixteenth of the frames), as from clients; a backend's frame
    over 256 KiB breaks its connection (the call fails with 502, refused on the frame's
    header, not buffered to its end), and the front goes on."""
    import h2.config
    import h2.connection
    import h2.events

    announced: list[int] = []

    async def backend(stream: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None))
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        while data := await stream.receive_some(65536):
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.RemoteSettingsChanged):
                    announced.append(conn.max_outbound_frame_size)
                if not isinstance(ev, h2.events.RequestReceived):
                    continue
                sid = ev.stream_id
                path = dict(ev.headers or ())[b":path"]
                if path == b"/fits":
                    conn.send_headers(sid, [(b":status", b"200")])
                    conn.send_data(sid, b"f" * 256 * 1024, end_stream=True)  # one frame
                else:  # a frame header announcing 256 KiB + 1, then its bytes trickle
                    await stream.send_all(b"\x04\x00\x01\x00\x00" + sid.to_bytes(4, "big"))
                    for _ in range(65):  # refused once more than 256 KiB + 9 is in
                        await stream.send_all(b"o" * 4096)
            await stream.send_all(conn.data_to_send())

    port = await start_tcp(nursery, backend)
    async with running_front([RouteSpec(None, "/", route_to(port, protocol="h2c"))]) as f:
        raw = await RawH2.connect(f.port)
        await raw.pump(0.5, grant=True)  # the front's SETTINGS
        assert raw.conn.max_outbound_frame_size == 256 * 1024  # what clients may send
        await raw.aclose()
        async with h2c_client() as c:
            with trio.fail_after(10):
                r = await c.get(f"{f.url}/fits")
                assert r.status_code == 200 and r.content == b"f" * 256 * 1024
                assert announced == [256 * 1024]
                r = await c.get(f"{f.url}/over")
                assert r.status_code == 502, r.text
                r = await c.get(f"{f.url}/fits")
                assert r.status_code == 200 and len(r.content) == 256 * 1024


async def test_cancelled_downloads_give_the_shared_connections_window_back(
        nursery: trio.Nursery) -> None:
    """A client that stops reading a large response and then resets it leaves up to a
    stream window (1 MiB) of the backend's data unforwarded at the front: the window of
    what was dropped goes back to the backend's shared h2c connection (8 MiB), or a few
    such calls would stall every later call on it."""
    origin = H2Origin()
    port = await start_tcp(nursery, origin.handle)
    async with running_front([RouteSpec(None, "/", route_to(port, protocol="h2c"))]) as f:
        client = await RawH2.connect(f.port)
        for _ in range(12):  # 12 MiB dropped, over the connection's 8 MiB window
            sent = origin.body_bytes_sent
            sid = await client.request("/big?n=4194304")
            with trio.fail_after(10):
                while origin.body_bytes_sent - sent < 1024 * 1024:  # the stream window
                    await client.pump(0.05, grant=False)
            await client.reset(sid)
        await client.aclose()
        async with h2c_client() as c:
            with trio.fail_after(10):
                r = await c.get(f"{f.url}/big?n=1048576")
            assert r.status_code == 200 and len(r.content) == 1024 * 1024


async def test_request_bodies_left_unread_give_the_clients_window_back(
        nursery: trio.Nursery) -> None:
    """Uploads refused part way (over max_body_bytes, no Content-Length): what the client
    sent beyond the refusal is dropped with its stream, and its window goes back to the
    client's connection (8 MiB), or a few such uploads would stall the connection."""
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    limits = Limits(max_body_bytes=100_000)
    async with running_front([RouteSpec(None, "/", route_to(port))], limits) as f:
        client = await RawH2.connect(f.port)
        await client.pump(0.2, grant=True)  # the front's SETTINGS and connection window
        sids = []
        for _ in range(12):  # ~12 MiB sent, over the connection's 8 MiB window
            sid = client.conn.get_next_available_stream_id()
            client.conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"),
                                           (b":authority", b"app.test"), (b":path", b"/up")])
            for _ in range(63):
                client.conn.send_data(sid, b"u" * 16384)
            await client.flush()
            sids.append(sid)
            await client.wait_for(lambda s=sid: s in client.status or s in client.resets)
        assert all(client.status.get(s) == 413 for s in sids), client.status
        await client.pump(0.5, grant=True)
        assert client.conn.outbound_flow_control_window > 4 * 1024 * 1024
        await client.aclose()
