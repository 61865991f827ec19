"""The CONNECT front end to end: real `nodeagent server` and `nodeagent agent` processes,
real TLS, a fake kubelet (HTTPS requiring a client certificate, like the real one) on the
node side, and the clients kube-apiserver's egress selector and Prometheus stand for —
raw CONNECT over the Unix socket, and curl through the mutual-TLS listener."""

from __future__ import annotations

import os
import re
import socket
import ssl
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import TOKEN, Certs, Upstream, free_port

# The agent marks its sockets (SO_MARK), which needs CAP_NET_ADMIN.
pytestmark = pytest.mark.needs("root")


# ------------------------------------------------------------------ the fake kubelet


class _Kubelet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path.startswith("/containerLogs/"):  # like `kubectl logs -f`
            lines = int(self.path.rsplit("lines=", 1)[1]) if "lines=" in self.path else 10
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(lines):
                line = f"log line {i}\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
                time.sleep(0.1)
            self.wfile.write(b"0\r\n\r\n")
            return
        body = b"kubelet_up 1\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _HeaderEcho(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = f"{self.requestline}\n{self.headers}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def header_echo() -> Iterator[int]:
    """Plain HTTP on 127.0.0.1 answering with the request line and headers it got."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _HeaderEcho)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


@dataclass
class ApiserverPki:
    ca: Path  # signs the kubelet's serving and kube-apiserver's client certificates
    client_cert: Path  # kube-apiserver's (the egress client's and the kubelet client's)
    client_key: Path

    def kubelet_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


@pytest.fixture(scope="module")
def apiserver_pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiserverPki,
                                                                           trustme.CA]]:
    d = tmp_path_factory.mktemp("apiserver-pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    # kubeadm's apiserver-kubelet-client.crt: the CONNECT front's default allow list.
    client = ca.issue_cert("kube-apiserver", common_name="kube-apiserver-kubelet-client",
                           organization_name="system:masters")
    client.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
    client.private_key_pem.write_to_path(str(d / "client.key"))
    yield ApiserverPki(d / "ca.pem", d / "client.pem", d / "client.key"), ca


@pytest.fixture(scope="module")
def kubelet(apiserver_pki: tuple[ApiserverPki, trustme.CA]) -> Iterator[int]:
    """HTTPS on 127.0.0.1 requiring a client certificate from the apiserver CA."""
    pki_, ca = apiserver_pki
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Kubelet)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki_.ca))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ca.issue_cert("edge-1", "127.0.0.1").configure_cert(ctx)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def hanging_port() -> Iterator[int]:
    """A port whose accept queue is full: a connect() to it hangs (SYNs are dropped)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(2):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    time.sleep(0.2)
    try:
        yield port
    finally:
        for s in fillers:
            s.close()
        listener.close()


# ------------------------------------------------------------------ the stack


@dataclass
class Stack:
    server: NodeagentProcess
    agent: NodeagentProcess
    uds: Path
    tls_port: int
    kubelet: int
    echo: int
    hang: int
    forbidden_by_agent: int
    exporter: int  # a plain-HTTP service on the node, like node-exporter
    header_echo: int


@pytest.fixture
def stack(tmp_path: Path, certs: Certs, upstream: Upstream, kubelet: int, hanging_port: int,
          header_echo: int, apiserver_pki: tuple[ApiserverPki, trustme.CA]) -> Iterator[Stack]:
    pki_, _ = apiserver_pki
    tunnel_port, tls_port = free_port(), free_port()
    uds = tmp_path / "run" / "konnectivity.sock"
    forbidden_by_agent = free_port()  # the server's routes allow it, the agent's rules not
    node_ports = [kubelet, upstream.echo_port, hanging_port, upstream.http_port,
                  forbidden_by_agent, header_echo]
    server_cfg: dict[str, Any] = {
        "server_id": "cloud-test",
        "tunnel": f"tls://127.0.0.1:{tunnel_port}",
        "tls": {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)},
        "tokens": [{"node": "edge-1", "token": TOKEN}],
        "debug_socket": str(tmp_path / "server.sock"),
        "keepalive": {"interval": 1, "timeout": 2},
        "dial_timeout": 3.0,
        "connect": {"uds": str(uds), "listen": f"127.0.0.1:{tls_port}",
                    "tls": {"client_ca_file": str(pki_.ca)}, "head_timeout": 1.0},
        "connect_nodes": {
            "edge-1": {"addresses": ["127.0.0.1", "edge-1.site.test"], "ports": node_ports},
            "edge-2": {"addresses": ["127.0.0.2"]},  # never connects
        },
    }
    server = NodeagentProcess("server", server_cfg, tmp_path, "server").start()
    procs = [server]
    try:
        server.wait_ready()
        agent_cfg: dict[str, Any] = {
            "node": "edge-1", "server": server_cfg["tunnel"], "token": TOKEN,
            "tls": {"ca_file": str(certs.ca)},
            # The ordinary allow list does not count for control-plane streams.
            "allow": [f"127.0.0.1:{forbidden_by_agent}"],
            "control_plane": [f"127.0.0.1:{kubelet}", f"127.0.0.1:{upstream.echo_port}",
                              f"127.0.0.1:{hanging_port}", f"127.0.0.1:{upstream.http_port}",
                              f"127.0.0.1:{header_echo}"],
            "debug_socket": str(tmp_path / "agent.sock"),
            "keepalive": {"interval": 1, "timeout": 2},
            "reconnect": {"initial": 0.1, "maximum": 1.0},
        }
        agent = NodeagentProcess("agent", agent_cfg, tmp_path, "agent").start()
        procs.append(agent)
        agent.wait_ready()
        server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                        what="edge-1 connected")
        yield Stack(server, agent, uds, tls_port, kubelet, upstream.echo_port, hanging_port,
                    forbidden_by_agent, upstream.http_port, header_echo)
    finally:
        for proc in procs:
            proc.kill()
    for proc in procs:
        assert "Traceback" not in proc.logs(), proc.logs()


def connect_uds(path: Path, request: bytes) -> tuple[socket.socket, int, bytes]:
    """Send a request head on the Unix socket; the socket, the status and the rest read
    (a refusal's body, nothing after a 200)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    sock.sendall(request)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)  # byte by byte: nothing past the head is consumed
        if not chunk:
            break
        head += chunk
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", head)
    assert match, head
    status = int(match.group(1))
    if status == 200:
        return sock, status, b""
    body = b""
    while chunk := sock.recv(65536):
        body += chunk
    sock.close()
    return sock, status, body


def connect(target: str) -> bytes:
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()



# ------------------------------------------------------------------ tests


def test_the_unix_socket_is_private(stack: Stack) -> None:
    st = os.stat(stack.uds)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


def test_logs_follow_through_the_unix_socket_shows_on_both_sides(
        stack: Stack, apiserver_pki: tuple[ApiserverPki, trustme.CA]) -> None:
    """kube-apiserver's egress dialer: CONNECT by node name, then its own TLS (client
    certificate) to the kubelet end to end, and a `logs -f` that streams for a while."""
    # Byte for byte what kube-apiserver's HTTPConnect dialer sends (egressselector's
    # tunnelHTTPConnect), which then refuses any byte buffered past the 200's head.
    sock, status, _ = connect_uds(
        stack.uds, f"CONNECT edge-1:{stack.kubelet} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        .encode())
    assert status == 200
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(1)  # nothing after the head
    sock.setblocking(True)
    sock.settimeout(10)
    tls = apiserver_pki[0].kubelet_context().wrap_socket(sock, server_hostname="edge-1")
    tls.sendall(b"GET /containerLogs/default/web/app?follow=true&lines=25 HTTP/1.1\r\n"
                b"Host: edge-1\r\n\r\n")
    got = b""
    while b"log line 3\n" not in got:
        got += tls.recv(65536)
    # While it streams: the server and the agent both show the stream, with bytes so far.
    server_streams = stack.server.status()["connect"]["streams"]
    assert [(s["node"], s["target"]) for s in server_streams] == [
        ("edge-1", f"edge-1:{stack.kubelet}")]
    assert server_streams[0]["client"].startswith("uds uid=0")
    assert server_streams[0]["bytes_in"] > 0 and server_streams[0]["bytes_out"] > 0
    agent_streams = stack.agent.status()["control_plane_streams"]
    assert [(s["node"], s["target"]) for s in agent_streams] == [
        ("edge-1", f"tcp://127.0.0.1:{stack.kubelet}")], agent_streams
    assert agent_streams[0]["bytes_in"] > 0 and agent_streams[0]["bytes_out"] > 0
    assert agent_streams[0]["client"].startswith("uds uid=0")
    while not got.endswith(b"0\r\n\r\n"):
        chunk = tls.recv(65536)
        assert chunk, got
        got += chunk
    assert got.count(b"log line ") == 25
    tls.close()
    stack.server.wait_for(lambda s: s["connect"]["streams"] == [], what="stream gone")
    assert stack.server.metric("nodeagent_connect_requests_total",
                  outcome="established") == 1


def test_exec_like_session_half_closes_and_an_idle_stream_lives_past_the_head_timeout(
        stack: Stack) -> None:
    sock, status, _ = connect_uds(stack.uds, connect(f"127.0.0.1:{stack.echo}"))
    assert status == 200
    time.sleep(2.5)  # idle well past head_timeout (1 s): port-forward sits like this
    payload = os.urandom(1 << 20)
    sock.sendall(payload)
    sock.shutdown(socket.SHUT_WR)  # stdin closed; the output keeps coming
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    assert got == payload
    sock.close()


@pytest.mark.parametrize(("request_bytes", "status", "reason"), [
    (b"CONNECT edge-1:22 HTTP/1.1\r\nHost: edge-1:22\r\n\r\n", 403, "port_not_allowed"),
    (b"CONNECT edge-9:10250 HTTP/1.1\r\nHost: x\r\n\r\n", 502, "unknown_node"),
    (b"CONNECT 10.0.0.1:10250 HTTP/1.1\r\nHost: x\r\n\r\n", 502, "unknown_node"),
    (b"CONNECT 127.0.0.2:10250 HTTP/1.1\r\nHost: x\r\n\r\n", 502, "node_not_connected"),
    (b"CONNECT nonsense HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed"),
    (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", 400, "malformed"),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400, "not_proxy_request"),
    (b"CONNECT edge-1", 408, "head_timeout"),
])
def test_refusals_answer_a_status_and_one_line(stack: Stack, request_bytes: bytes, status: int,
                                               reason: str) -> None:
    _, got, body = connect_uds(stack.uds, request_bytes)
    assert got == status, body
    assert body.endswith(b"\n") and body.count(b"\n") == 1, body
    assert stack.server.metric("nodeagent_connect_requests_total", outcome=reason) == 1
    assert stack.server.status()["connect"]["by_outcome"] == {reason: 1}


def test_a_dial_that_hangs_is_504_and_the_agent_refuses_what_its_own_rules_do_not_allow(
        stack: Stack) -> None:
    started = time.monotonic()
    _, status, body = connect_uds(stack.uds, connect(f"edge-1.site.test:{stack.hang}"))
    assert status == 504, body
    # It waited out its dial timeout (a lower bound: load only lengthens it); the 504
    # says it was a timeout, the socket's 10 s timeout is the hang guard.
    assert time.monotonic() - started > 2.5
    # The server's routes allow this port on edge-1; the agent's control_plane rules do
    # not (its ordinary allow list does, which must not count): the agent refuses.
    _, status, body = connect_uds(stack.uds, connect(f"edge-1:{stack.forbidden_by_agent}"))
    assert status == 403 and b"agent refused" in body, body
    stack.agent.wait_for(
        lambda s: s["streams_by_outcome"].get("control_plane_forbidden") == 1,
        what="the agent counted its refusal")
    stack.agent.wait_for_log("stream refused: target not allowed on this node for "
                             "control-plane streams")
    assert stack.server.metric("nodeagent_connect_requests_total",
                  outcome="agent_forbidden") == 1


def curl(stack: Stack, certs: Certs, pki_: ApiserverPki, url: str, *extra: str,
         client_cert: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["curl", "-sS", "--max-time", "10", "-x", f"https://127.0.0.1:{stack.tls_port}",
           "--proxy-cacert", str(certs.ca), "--cacert", str(pki_.ca),
           "--cert", str(pki_.client_cert), "--key", str(pki_.client_key), *extra, url]
    if client_cert:
        cmd[1:1] = ["--proxy-cert", str(pki_.client_cert), "--proxy-key", str(pki_.client_key)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.mark.needs("curl")
def test_curl_through_the_mutual_tls_listener(
        stack: Stack, certs: Certs, apiserver_pki: tuple[ApiserverPki, trustme.CA]) -> None:
    pki_ = apiserver_pki[0]
    # CONNECT (curl --proxytunnel), the kubelet's TLS inside.
    done = curl(stack, certs, pki_, f"https://edge-1:{stack.kubelet}/metrics", "-p")
    assert done.returncode == 0 and done.stdout == "kubelet_up 1\n", done.stderr
    # No client certificate: refused in the handshake, counted, nothing reaches a node.
    done = curl(stack, certs, pki_, f"https://edge-1:{stack.kubelet}/metrics", "-p",
                client_cert=False)
    assert done.returncode != 0 and "kubelet_up" not in done.stdout
    stack.server.wait_for_log("CONNECT client refused: TLS handshake failed")
    assert stack.server.metric("nodeagent_connect_handshake_failures_total") >= 1
    assert stack.server.metric("nodeagent_connect_requests_total",
                  outcome="established") == 1


@pytest.mark.needs("curl")
def test_curl_as_an_http_proxy_client_like_prometheus(
        stack: Stack, certs: Certs, apiserver_pki: tuple[ApiserverPki, trustme.CA]) -> None:
    """Prometheus with proxy_url sends absolute-form requests: forwarded to the node's
    target by the same rules, the response carried back."""
    pki_ = apiserver_pki[0]
    done = curl(stack, certs, pki_, f"http://edge-1:{stack.exporter}/metrics")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"hello from upstream path=/metrics host=edge-1:"
                                  f"{stack.exporter}"), done.stdout
    done = curl(stack, certs, pki_, "http://edge-1:22/metrics", "-w", "%{http_code}")
    assert done.stdout.endswith("403"), done.stdout
    assert "port 22 of node edge-1 is not in allowedNodePorts" in done.stdout
    assert stack.server.metric("nodeagent_connect_requests_total", outcome="forwarded") == 1
    assert stack.server.metric("nodeagent_connect_requests_total",
                  outcome="port_not_allowed") == 1


def test_absolute_form_get_over_the_unix_socket(stack: Stack) -> None:
    """Forwarded in origin form with Connection: close; hop-by-hop headers and the
    proxy's own credentials stay behind; the response comes back until the target closes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(stack.uds))
    sock.sendall(f"GET http://127.0.0.1:{stack.header_echo}/metrics?x=1 HTTP/1.1\r\n"
                 f"Host: 127.0.0.1:{stack.header_echo}\r\n"
                 f"Proxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\n"
                 f"Connection: keep-alive\r\nAccept: text/plain\r\n\r\n".encode())
    got = b""
    while chunk := sock.recv(65536):  # the target closes (Connection: close)
        got += chunk
    sock.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 ") or head.startswith(b"HTTP/1.1 200 "), got
    lines = body.decode().lower().splitlines()
    assert lines[0] == "get /metrics?x=1 http/1.1"
    assert f"host: 127.0.0.1:{stack.header_echo}" in lines
    assert "accept: text/plain" in lines and "connection: close" in lines
    assert not any(line.startswith(("proxy-", "connection: keep-alive")) for line in lines)


async def test_200_concurrent_streams_to_one_node(stack: Stack) -> None:
    payload = os.urandom(64 * 1024)
    results: list[bytes] = []

    async def one() -> None:
        stream = await trio.open_unix_socket(str(stack.uds))
        async with stream:
            await stream.send_all(connect(f"edge-1:{stack.echo}"))
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive_some(1)
            assert head.startswith(b"HTTP/1.1 200 "), head
            await stream.send_all(payload)
            await stream.send_eof()
            got = bytearray()
            while data := await stream.receive_some(65536):
                got += data
            results.append(bytes(got))

    started = time.monotonic()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(200):
                nursery.start_soon(one)
    print(f"200 concurrent CONNECT streams x 64 KiB echoed in "
          f"{time.monotonic() - started:.2f}s")
    assert len(results) == 200 and all(r == payload for r in results)
    assert stack.server.metric("nodeagent_connect_requests_total",
                  outcome="established") == 200
