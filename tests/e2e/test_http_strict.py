"""The HTTP front's strict reading of what a proxy in front of it could read otherwise,
against a real `nodeagent server` and agent: each refusal is a 400 that closes the
connection, counted by reason in `nodeagent_http_front` and logged at most once a minute
per reason."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Certs, Upstream, http_port, start_pair

pytestmark = pytest.mark.needs("root")


def front_counter(server: NodeagentProcess, counter: str) -> float:
    transport = httpx.HTTPTransport(uds=str(server.socket))
    with httpx.Client(transport=transport, timeout=5) as client:
        text = client.get("http://debug/metrics").text
    want = f'nodeagent_http_front{{counter="{counter}",listener="http:public"}}'
    for line in text.splitlines():
        if line.startswith(want):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def exchange(port: int, data: bytes) -> bytes:
    """Send the bytes, read until the front closes the connection (a timeout fails)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


@pytest.fixture
def pair(tmp_path: Path, certs: Certs, upstream: Upstream):  # type: ignore[no-untyped-def]
    server, agent = start_pair(tmp_path, certs, upstream)
    yield server
    for proc in (server, agent):
        proc.kill()
    for proc in (server, agent):
        assert "Traceback" not in proc.logs(), proc.logs()


def test_chunk_sizes_of_2_to_the_64_and_more_are_refused(pair: NodeagentProcess) -> None:
    """2^64 + 5 is 5 to a proxy that reads sizes modulo 2^64: the bytes after "hello" would
    be a second request to it, and one body to us."""
    server = pair
    port = http_port(server)
    for size in (b"10000000000000005", b"ffffffffffffffff", b"5 ", b"5;a b"):
        out = exchange(port, b"POST / HTTP/1.1\r\nHost: app.test\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n%b\r\nhello\r\n0\r\n\r\n"
                             b"GET /smuggled HTTP/1.1\r\nHost: app.test\r\n\r\n" % size)
        assert out.startswith(b"HTTP/1.1 400 "), out
        assert out.count(b"HTTP/1.1 ") == 1 and b"bad chunk size line" in out
        assert b"connection: close" in out.lower()
    assert front_counter(server, "refused_bad_chunk_size") == 4
    assert server.logs().count("reason=bad_chunk_size") + server.logs().count(
        '"reason": "bad_chunk_size"') == 1
    # A chunked body within the rule still goes through the tunnel.
    out = exchange(port, b"GET /ok HTTP/1.1\r\nHost: app.test\r\nConnection: close\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 ") and b"path=/ok" in out, out


def test_a_host_port_that_is_not_one_is_refused(pair: NodeagentProcess) -> None:
    """`app.test:abc` routes as app.test here; a backend or a proxy in front may read it
    otherwise. Refused, not forwarded as sent; an empty port is the default one."""
    server = pair
    port = http_port(server)
    for head in (b"GET / HTTP/1.1\r\nHost: app.test:abc\r\n\r\n",
                 b"GET / HTTP/1.1\r\nHost: app.test:65536\r\n\r\n",
                 b"GET http://app.test:1x/ HTTP/1.1\r\nHost: app.test\r\n\r\n"):
        out = exchange(port, head)
        assert out.startswith(b"HTTP/1.1 400 "), out
        assert b"bad Host: the port is not" in out and b"connection: close" in out.lower()
    assert front_counter(server, "refused_bad_host") == 3
    assert server.logs().count("reason=bad_host") + server.logs().count(
        '"reason": "bad_host"') == 1
    out = exchange(port, b"GET / HTTP/1.1\r\nHost: app.test:\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 ") and b"host=app.test xff" in out, out
    out = exchange(port, b"GET / HTTP/1.1\r\nHost: app.test:8080\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 ") and b"host=app.test:8080 xff" in out, out
