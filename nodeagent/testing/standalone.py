"""A standalone server and agent as real processes, and what they talk to: test
certificates, a sample upstream (HTTP and TCP echo on loopback), the config files of the
pair, and small clients. The e2e tests, the soak and the benchmarks build on these."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.trust import pki

TOKEN = "e2e-token-0123456789abcdef"



class SampleHTTPServer(ThreadingHTTPServer):
    """The sample upstream's server: a thread per connection, and a listen backlog of a
    real service's size. socketserver's default backlog is 5: when a woken Service's 100
    held requests are released together (tests/e2e/test_scale_to_zero.py), the agent's
    100 dials overflow the accept queue, the kernel drops their handshakes and they are
    retried after 1, 3, 7, 15 and 31 s (the SYN retransmission backoff), so the last ones
    outlast a 30 s client timeout. The kernel caps the backlog at net.core.somaxconn."""

    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that cuts its connection (a reset stream, a test's fault) is no error
        # of the sample service; any other exception is still printed.
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


class QuietHTTPServer(SampleHTTPServer):
    """A sample upstream for fault tests and the soak: a client the test cuts on purpose
    is no traceback on stderr."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass

@dataclass
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    agent_cert: Path
    agent_key: Path


def make_certs(d: Path) -> Certs:
    """A CA, a server certificate for localhost and a node certificate for edge-1, as PEM
    files in `d`."""
    ca = pki.create_ca("nodeagent-test-ca")
    ca.write(d / "ca.crt", d / "ca.key")
    server = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1", "::1"])
    server.write(d / "server.crt", d / "server.key")
    agent = pki.issue_client_certificate(ca, "edge-1")
    agent.write(d / "edge-1.crt", d / "edge-1.key")
    return Certs(d / "ca.crt", d / "server.crt", d / "server.key", d / "edge-1.crt",
                 d / "edge-1.key")


class UpstreamHandler(BaseHTTPRequestHandler):
    """The sample HTTP service: answers every GET with what it saw (path, Host, XFF, the
    identity a route's authentication passed on)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = (f"hello from upstream path={self.path} host={self.headers.get('Host')} "
                f"xff={self.headers.get('X-Forwarded-For')} "
                f"identity={self.headers.get('X-Nodeagent-Identity')}").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class Upstream:
    http_port: int
    echo_port: int


def serve_echo(sock: socket.socket) -> None:
    """Accept on `sock` and echo each connection back, a thread per connection, until
    `sock` is closed."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return

        def serve(c: socket.socket) -> None:
            # A client may reset its connection (a refused or cut stream): that ends
            # this echo, it is no error of the sample service.
            with c, contextlib.suppress(ConnectionResetError, BrokenPipeError):
                while data := c.recv(65536):
                    c.sendall(data)

        threading.Thread(target=serve, args=(conn,), daemon=True).start()


@contextlib.contextmanager
def run_upstream() -> Iterator[Upstream]:
    """A plain HTTP service and a TCP echo service on 127.0.0.1 (threads: they stand for
    ordinary programs on the node, not for nodeagent code)."""
    httpd = SampleHTTPServer(("127.0.0.1", 0), UpstreamHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    echo = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve_echo, args=(echo,), daemon=True).start()
    try:
        yield Upstream(httpd.server_address[1], echo.getsockname()[1])
    finally:
        httpd.shutdown()
        httpd.server_close()
        echo.close()


# Ports for the processes a test starts come from below the kernel's ephemeral range.
# A port asked of the kernel (bind to port 0) is free only until the probe closes it: the
# kernel hands it out again to the next socket that binds port 0 or connects (a test's
# client, another test run on the same machine), and the process the test starts then
# exits with "address already in use" (fatal by design). Below the ephemeral range the
# kernel hands out nothing: only a socket binding that port by number can take it, and
# the probe checks that none does.
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000
_given: set[tuple[int, int]] = set()  # (socket type, port) handed out by this process


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    """A port on 127.0.0.1 for a process to listen on (TCP, or UDP with SOCK_DGRAM):
    nothing listens there now, the kernel will not give it to a socket binding port 0 or
    connecting, and this process has not handed it out before."""
    try:
        first_ephemeral = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 0
    if first_ephemeral - _LOWEST < 1000:  # no room below it: ask the kernel
        with socket.socket(socket.AF_INET, kind) as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port
    for _ in range(1000):
        port = random.randrange(_LOWEST, first_ephemeral)
        if (kind, port) in _given:
            continue
        with socket.socket(socket.AF_INET, kind) as s:
            try:  # no SO_REUSEADDR: a port with a listener or in TIME_WAIT fails too
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add((kind, port))
        return port
    raise RuntimeError(f"no free port in {_LOWEST}-{first_ephemeral - 1}")


def server_config(tmp: Path, certs: Certs, upstream: Upstream, *, scheme: str = "tls",
                  tunnel_port: int | None = None, mtls: bool = False) -> dict[str, Any]:
    tunnel_port = tunnel_port or free_port()
    path = "/tunnel" if scheme == "wss" else ""
    cfg: dict[str, Any] = {
        "server_id": "cloud-test",
        "tunnel": f"{scheme}://127.0.0.1:{tunnel_port}{path}",
        "tls": {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)},
        "tokens": [{"node": "edge-1", "token": TOKEN}],
        "tcp": [{"name": "echo", "listen": f"127.0.0.1:{free_port()}", "node": "edge-1",
                 "target": f"127.0.0.1:{upstream.echo_port}"},
                {"name": "forbidden", "listen": f"127.0.0.1:{free_port()}", "node": "edge-1",
                 "target": "127.0.0.1:1"}],
        "http": [{"name": "public", "listen": f"127.0.0.1:{free_port()}", "routes": [
            {"host": "app.test", "node": "edge-1",
             "target": f"127.0.0.1:{upstream.http_port}"},
            {"host": "ghost.test", "node": "edge-404",
             "target": f"127.0.0.1:{upstream.http_port}"},
            {"host": "closed.test", "node": "edge-1", "target": "127.0.0.1:9"},
        ]}],
        "debug_socket": str(tmp / "server.sock"),
        "keepalive": {"interval": 1, "timeout": 2},
    }
    if mtls:
        cfg["tls"]["client_ca_file"] = str(certs.ca)
    return cfg


def agent_config(tmp: Path, certs: Certs, upstream: Upstream, server_url: str,
                 **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "node": "edge-1", "server": server_url, "token": TOKEN,
        "tls": {"ca_file": str(certs.ca)},
        "allow": [f"127.0.0.1:{upstream.echo_port}", f"127.0.0.1:{upstream.http_port}",
                  "127.0.0.1:9"],
        "debug_socket": str(tmp / "agent.sock"),
        "keepalive": {"interval": 1, "timeout": 2},
        "reconnect": {"initial": 0.1, "maximum": 1.0},
    }
    cfg.update(extra)
    return cfg


def start_pair(tmp: Path, certs: Certs, upstream: Upstream, scheme: str = "tls",
               **agent_extra: Any) -> tuple[NodeagentProcess, NodeagentProcess]:
    scfg = server_config(tmp, certs, upstream, scheme=scheme)
    server = NodeagentProcess("server", scfg, tmp, "server").start()
    server.wait_ready()
    agent = NodeagentProcess("agent", agent_config(tmp, certs, upstream, scfg["tunnel"],
                                                   **agent_extra), tmp, "agent").start()
    agent.wait_ready()
    server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                    what="edge-1 connected")
    return server, agent


def listen_port(server: NodeagentProcess, index: int) -> int:
    port: int = server.config["tcp"][index]["listen"].rsplit(":", 1)[1]
    return int(port)


def http_port(server: NodeagentProcess) -> int:
    return int(server.config["http"][0]["listen"].rsplit(":", 1)[1])


def echo_through(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        return got


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True,
                          text=True, timeout=30)
