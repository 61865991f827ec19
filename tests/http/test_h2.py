"""The HTTP front speaking HTTP/2: h2c prior knowledge and ALPN h2 on the same ports as
HTTP/1.1, translation to HTTP/1.1 backends and from HTTP/1.1 clients to h2c backends, with
real sockets, httpx clients, an h11 origin and an `h2` origin."""

from __future__ import annotations

import hashlib
import ssl
from typing import Any

import httpx
import trio
import trustme

from nodeagent.http import Backend, CertStore, Route, RouteSpec, TlsConfig
from nodeagent.http.tls import context_from_pem
from tests.http.helpers import H2Origin, Upstream, running_front, start_tcp


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
