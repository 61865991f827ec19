"""PROXY protocol with real peers, standalone: HAProxy sends v2 to the server's public
listeners, nginx parses the v1 and v2 headers the server sends its backends.

    client 127.0.0.3 ── HAProxy (send-proxy-v2, from 127.0.0.2) ──► server ── tunnel ──►
        agent ──► nginx (listen proxy_protocol) answering $proxy_protocol_addr
                  the sample HTTP upstream answering X-Forwarded-For

The server trusts 127.0.0.2/32 only: the test's own direct connections (127.0.0.1) are
clients, their headers refused, and HAProxy's connections must carry one.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.proxyprotocol import build_header
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    TOKEN,
    agent_config,
    free_port,
    make_certs,
    run_upstream,
)
from nodeagent.trust import pki

pytestmark = pytest.mark.needs("haproxy", "nginx")

BALANCER = "127.0.0.2"
CLIENT = "127.0.0.3"


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def start_nginx(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    """nginx answering every request with the client its PROXY header named."""
    to = "to=$proxy_protocol_server_addr:$proxy_protocol_server_port"
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
user root;
pid {tmp}/nginx.pid;
error_log stderr;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    fastcgi_temp_path {tmp}/nginx-fastcgi;
    uwsgi_temp_path {tmp}/nginx-uwsgi;
    scgi_temp_path {tmp}/nginx-scgi;
    server {{
        listen 127.0.0.1:{port} proxy_protocol;
        location / {{
            return 200 "proxied=$proxy_protocol_addr:$proxy_protocol_port {to}\\n";
        }}
    }}
}}
""")
    proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(tmp), "-g", "daemon off;"],
                            stderr=(tmp / "nginx.log").open("wb"))
    wait_port(port)
    return proc


def start_haproxy(tmp: Path, fronts: dict[int, int]) -> subprocess.Popen[bytes]:
    """HAProxy in TCP mode: each front port → the server's port, with a v2 header, from
    the balancer's address."""
    sections = [
        "global\n    maxconn 100\n",
        "defaults\n    mode tcp\n    timeout connect 5s\n    timeout client 30s\n"
        "    timeout server 30s\n"]
    for front, back in fronts.items():
        sections.append(f"listen front{front}\n    bind 127.0.0.1:{front}\n"
                        f"    server s 127.0.0.1:{back} send-proxy-v2 source {BALANCER}\n")
    conf = tmp / "haproxy.cfg"
    conf.write_text("\n".join(sections))
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(conf)],
                            stderr=(tmp / "haproxy.log").open("wb"))
    for front in fronts:
        wait_port(front)
    return proc


def http_get(port: int, host: str, *, source: str = "127.0.0.1",
             prefix: bytes = b"", tls: ssl.SSLContext | None = None) -> tuple[bytes, int]:
    """The whole answer to one GET (connection: close), and the client's source port."""
    with socket.create_connection(("127.0.0.1", port), timeout=10,
                                  source_address=(source, 0)) as plain:
        sock = plain if tls is None else tls.wrap_socket(plain, server_hostname=host)
        sock.sendall(prefix + f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
                              f"\r\n".encode())
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        return got, sock.getsockname()[1]


class Lab:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.nodeagents: list[NodeagentProcess] = []

    def close(self) -> None:
        for na in self.nodeagents:
            na.stop()
        for proc in self.procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path)
    try:
        yield lab
    finally:
        lab.close()


def test_proxy_protocol_both_ways(lab: Lab) -> None:
    tmp = lab.tmp
    certs = make_certs(tmp)
    nginx_port = free_port()
    lab.procs.append(start_nginx(tmp, nginx_port))
    with run_upstream() as upstream:
        ports = {name: free_port() for name in ("http", "v1", "v2", "plain", "https", "lb")}
        ca = pki.create_ca("proxy protocol test CA")
        ca.write(tmp / "https-ca.crt", tmp / "https-ca.key")
        leaf = pki.issue_server_certificate(ca, ["secure.test"])
        scfg = {
            "server_id": "cloud-test",
            "tunnel": f"tls://127.0.0.1:{free_port()}",
            "tls": {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)},
            "tokens": [{"node": "edge-1", "token": TOKEN}],
            "proxy_protocol_from": [f"{BALANCER}/32"],
            "tcp": [
                {"name": "v1", "listen": f"127.0.0.1:{ports['v1']}", "node": "edge-1",
                 "target": f"127.0.0.1:{nginx_port}", "proxy_protocol": "v1"},
                {"name": "v2", "listen": f"127.0.0.1:{ports['v2']}", "node": "edge-1",
                 "target": f"127.0.0.1:{nginx_port}", "proxy_protocol": "v2"},
                {"name": "plain", "listen": f"127.0.0.1:{ports['plain']}",
                 "node": "edge-1", "target": f"127.0.0.1:{upstream.http_port}"},
            ],
            "http": [{"name": "public", "listen": f"127.0.0.1:{ports['http']}", "routes": [
                {"host": "app.test", "node": "edge-1",
                 "target": f"127.0.0.1:{upstream.http_port}"}]}],
            # A balanced port (a LoadBalancer Service's, from the file) sending v1.
            "load_balancer_host": "127.0.0.1",
            "load_balancers": [{"name": "app/web", "ports": [{
                "port": ports["lb"], "proxy_protocol": "v1", "backends": [
                    {"node": "edge-1", "target": f"127.0.0.1:{nginx_port}"}]}]}],
            # HTTPS: the balancer's header comes before the TLS handshake.
            "ingress_https": f"127.0.0.1:{ports['https']}",
            "ingress": {"rules": [{"name": "shop/secure", "host": "secure.test", "backends": [
                {"node": "edge-1", "target": f"127.0.0.1:{upstream.http_port}"}]}],
                "tls": [{"name": "shop/tls", "hosts": ["secure.test"],
                         "cert_pem": leaf.certificate_pem.decode(),
                         "key_pem": leaf.key_pem.decode()}]},
            "debug_socket": str(tmp / "server.sock"),
        }
        server = NodeagentProcess("server", scfg, tmp, "server").start()
        lab.nodeagents.append(server)
        server.wait_ready()
        acfg = agent_config(tmp, certs, upstream, scfg["tunnel"])
        acfg["allow"].append(f"127.0.0.1:{nginx_port}")
        agent = NodeagentProcess("agent", acfg, tmp, "agent").start()
        lab.nodeagents.append(agent)
        agent.wait_ready()
        server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                        what="edge-1 connected")
        lb = {name: free_port() for name in ("http", "v2", "plain", "https")}
        lab.procs.append(start_haproxy(tmp, {lb[name]: ports[name] for name in lb}))

        # The server → backend header, parsed by nginx: the client as the server saw it.
        for version in ("v1", "v2"):
            answer, client_port = http_get(ports[version], "any")
            assert (f"proxied=127.0.0.1:{client_port} to=127.0.0.1:{ports[version]}"
                    .encode()) in answer, answer

        answer, client_port = http_get(ports["lb"], "any")
        assert f"proxied=127.0.0.1:{client_port} to=127.0.0.1:{ports['lb']}".encode() in answer

        # HAProxy → server (v2), then server → nginx (v2): the client survives both hops.
        answer, client_port = http_get(lb["v2"], "any", source=CLIENT)
        # (and the address it reached: HAProxy's port, as HAProxy's header says).
        assert f"proxied={CLIENT}:{client_port} to=127.0.0.1:{lb['v2']}".encode() in answer

        # HAProxy → the HTTP front: the client is who X-Forwarded-For names.
        answer, _ = http_get(lb["http"], "app.test", source=CLIENT)
        assert answer.startswith(b"HTTP/1.1 200") and f"xff={CLIENT}".encode() in answer

        # HAProxy → the HTTPS Ingress listener: the header, then TLS end to end.
        client_tls = ssl.create_default_context(cafile=str(tmp / "https-ca.crt"))
        answer, _ = http_get(lb["https"], "secure.test", source=CLIENT, tls=client_tls)
        assert answer.startswith(b"HTTP/1.1 200") and f"xff={CLIENT}".encode() in answer

        # HAProxy → a mapping without a header to its backend: the PROXY header is the
        # server's to read, the backend sees plain HTTP.
        answer, _ = http_get(lb["plain"], "app.test", source=CLIENT)
        assert answer.startswith(b"HTTP/1.1 200"), answer

        # The balancer's address without a header: refused, nothing reaches a backend.
        answer, _ = http_get(ports["http"], "app.test", source=BALANCER)
        assert answer == b""
        answer, _ = http_get(ports["plain"], "app.test", source=BALANCER)
        assert answer == b""

        # A client that is not the balancer sending a header (to pass as someone else):
        # refused at the HTTP front.
        forged = build_header("v2", ("198.51.100.9", 1), ("127.0.0.1", ports["http"]))
        answer, _ = http_get(ports["http"], "app.test", prefix=forged)
        assert answer == b""
        answer, _ = http_get(ports["http"], "app.test", prefix=b"PROXY TCP4 1.2.3.4 "
                                                              b"5.6.7.8 1 2\r\n")
        assert answer == b""

        status = server.wait_for(
            lambda s: s["proxy_protocol"]["headers"].get("untrusted") == 2, what="refusals")
        headers = status["proxy_protocol"]["headers"]
        # HAProxy's own connections when the test waited for its ports count too.
        assert headers.pop("accepted") >= 3
        assert headers == {"bad_signature": 2, "untrusted": 2}
        assert status["proxy_protocol"]["from"] == [f"{BALANCER}/32"]
        assert server.metric("nodeagent_proxy_headers_total", result="untrusted") == 2
        assert "proxy header refused" in server.logs()
