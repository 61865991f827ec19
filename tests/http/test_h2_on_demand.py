"""HTTP/2 on demand (`nodeagent/http/ondemand.py`): a front that has not seen HTTP/2 has not
loaded the `h2` library or its h2 modules, and loads them when first needed: the first
connection that speaks it (the h2c preface on plaintext, ALPN `h2` on TLS), or the first
HTTP/1.1 request to a route whose backend speaks h2c. The front runs in a fresh
interpreter (this test process has loaded h2 for its clients and origins); its route
table, asked once per request, tells whether h2 was loaded when the request was routed."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import trio
import trustme

from tests.http.helpers import H2Origin, Upstream, start_tcp

_FRONT = """
import sys, trio
from pathlib import Path
from nodeagent.http import Backend, CertStore, HttpFront, Route, RouteSpec, RouteTable, TlsConfig
from nodeagent.http.tls import context_from_pem
from tunnel.tcp import connect_tcp

H2 = ("h2", "hpack", "hyperframe", "nodeagent.http.h2connection", "nodeagent.http.h2pool",
      "nodeagent.http.h2session", "nodeagent.http.h2wire", "nodeagent.http.h2heads")

def route(name, port, protocol):
    return Route(name, (Backend(None, "127.0.0.1", port),), backend_protocol=protocol)

table = RouteTable.build([RouteSpec(None, "/", route("h1", int(sys.argv[1]), "h1")),
                          RouteSpec(None, "/h2c", route("h2c", int(sys.argv[2]), "h2c"))])

def routes():
    print("loaded" if any(m in sys.modules for m in H2) else "not-loaded", flush=True)
    return table

async def opener(backend, route, client=""):
    return await connect_tcp(backend.host, backend.port, connect_timeout=10.0)

async def main():
    tls = None
    if len(sys.argv) > 3:  # TLS: certificate chain and key files
        ctx = context_from_pem(Path(sys.argv[3]).read_bytes(), Path(sys.argv[4]).read_bytes())
        tls = TlsConfig(certs=CertStore({"app.test": ctx}))
    front = HttpFront(table=routes, open_upstream=opener, tls=tls)
    async with trio.open_nursery() as nursery:
        await nursery.start(front.run, "127.0.0.1", 0)
        print(front.port, flush=True)

trio.run(main)
"""


class FrontProcess:
    """The front in a fresh interpreter; `said()` is the next line it printed."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.buffer = b""

    async def said(self) -> str:
        assert self.proc.stdout is not None
        with trio.fail_after(30):
            while b"\n" not in self.buffer:
                chunk = await self.proc.stdout.receive_some()
                assert chunk, "the front exited"
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()


async def _with_front(nursery: trio.Nursery, check: object, *tls_files: Path) -> None:
    h1_port = await start_tcp(nursery, Upstream().handle)
    h2c_port = await start_tcp(nursery, H2Origin().handle)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", _FRONT, str(h1_port), str(h2c_port), *map(str, tls_files)],
        stdout=subprocess.PIPE)
    try:
        front = FrontProcess(proc)
        port = int(await front.said())
        await check(front, f"http://127.0.0.1:{port}")  # type: ignore[operator]
    finally:
        proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.aclose()


async def test_h2_loads_on_the_first_h2c_connection(nursery: trio.Nursery) -> None:
    async def check(front: FrontProcess, url: str) -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            r = await c.get(f"{url}/first")
            assert r.http_version == "HTTP/1.1" and r.json()["target"] == "/first"
        assert await front.said() == "not-loaded"
        async with httpx.AsyncClient(trust_env=False, timeout=10, http1=False,
                                     http2=True) as c:
            r = await c.get(f"{url}/over-h2")
            assert r.http_version == "HTTP/2" and r.json()["target"] == "/over-h2"
            assert await front.said() == "loaded"
            r = await c.post(f"{url}/h2c/both", content=b"abc")  # h2 to an h2c backend
            assert r.status_code == 200 and r.json()["body_length"] == 3
            assert await front.said() == "loaded"

    await _with_front(nursery, check)


async def test_h2_loads_on_the_first_request_to_an_h2c_backend(nursery: trio.Nursery) -> None:
    async def check(front: FrontProcess, url: str) -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            r = await c.post(f"{url}/h2c/from-h1", content=b"hello")
            assert r.http_version == "HTTP/1.1" and r.status_code == 200
            assert r.json()["target"] == "/h2c/from-h1" and r.json()["body_length"] == 5
            assert await front.said() == "not-loaded"  # routed before the pool was made
            r = await c.get(f"{url}/h2c/again")
            assert r.status_code == 200 and r.json()["target"] == "/h2c/again"
            assert await front.said() == "loaded"

    await _with_front(nursery, check)


async def test_h2_loads_on_the_first_alpn_h2_connection(nursery: trio.Nursery,
                                                         tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("app.test")
    chain, key = tmp_path / "chain.pem", tmp_path / "key.pem"
    chain.write_bytes(cert.private_key_and_cert_chain_pem.bytes())
    key.write_bytes(cert.private_key_pem.bytes())
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)

    async def check(front: FrontProcess, url: str) -> None:
        url = url.replace("http://", "https://")
        sni = {"sni_hostname": "app.test"}
        for http2, version, said in ((False, "HTTP/1.1", "not-loaded"),
                                     (True, "HTTP/2", "loaded")):
            transport = httpx.AsyncHTTPTransport(verify=client_ctx, http2=http2)
            async with httpx.AsyncClient(trust_env=False, timeout=10,
                                         transport=transport) as c:
                r = await c.get(f"{url}/tls", headers={"host": "app.test"}, extensions=sni)
                assert r.http_version == version and r.json()["target"] == "/tls"
            assert await front.said() == said

    await _with_front(nursery, check, chain, key)
