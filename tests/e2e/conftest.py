"""Fixtures for end-to-end tests: certificates, a sample upstream, server/agent configs."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nodeagent import pki

TOKEN = "e2e-token-0123456789abcdef"



class QuietHTTPServer(ThreadingHTTPServer):
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


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("pki")
    ca = pki.create_ca("nodeagent-test-ca")
    ca.write(d / "ca.crt", d / "ca.key")
    server = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1", "::1"])
    server.write(d / "server.crt", d / "server.key")
    agent = pki.issue_client_certificate(ca, "edge-1")
    agent.write(d / "edge-1.crt", d / "edge-1.key")
    return Certs(d / "ca.crt", d / "server.crt", d / "server.key", d / "edge-1.crt",
                 d / "edge-1.key")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = (f"hello from upstream path={self.path} host={self.headers.get('Host')} "
                f"xff={self.headers.get('X-Forwarded-For')}").encode()
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


def _echo_server(sock: socket.socket) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return

        def serve(c: socket.socket) -> None:
            with c:
                while data := c.recv(65536):
                    c.sendall(data)

        threading.Thread(target=serve, args=(conn,), daemon=True).start()


@pytest.fixture(scope="session")
def upstream() -> Iterator[Upstream]:
    """A plain HTTP service and a TCP echo service on 127.0.0.1 (threads: they stand for
    ordinary programs on the node, not for nodeagent code)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    echo = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_echo_server, args=(echo,), daemon=True).start()
    try:
        yield Upstream(httpd.server_address[1], echo.getsockname()[1])
    finally:
        httpd.shutdown()
        httpd.server_close()
        echo.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
