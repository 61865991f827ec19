"""The server's Ingress listeners with real processes: routes in the shape the controller
computes (RoutesConfig.ingress), given here through the server's file, served over HTTP
and HTTPS (certificates by SNI) into the agent's tunnel, and changed by a reload without a
restart."""

from __future__ import annotations

import signal
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Certs, Upstream, agent_config, free_port, server_config
from nodeagent.trust import pki

# The agent marks its tunnel socket (SO_MARK), which needs CAP_NET_ADMIN.
pytestmark = pytest.mark.needs("root")


def raw_get(port: int, host: str, path: str, *, tls_ca: Path | None = None) -> tuple[int, str]:
    """One GET with `host` as Host (and SNI with TLS); (status, whole response)."""
    sock: socket.socket = socket.create_connection(("127.0.0.1", port), timeout=5)
    if tls_ca is not None:
        ctx = ssl.create_default_context(cafile=str(tls_ca))
        sock = ctx.wrap_socket(sock, server_hostname=host)
    with sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                     .encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    text = data.decode(errors="replace")
    return int(text.split(" ", 2)[1]), text


@pytest.fixture
def ingress_stack(tmp_path: Path, certs: Certs, upstream: Upstream
                  ) -> Iterator[dict[str, Any]]:
    ca = pki.create_ca("ingress test CA")
    ca.write(tmp_path / "ingress-ca.crt", tmp_path / "ingress-ca.key")
    leaf = pki.issue_server_certificate(ca, ["secure.test"])
    backend = [{"node": "edge-1", "target": f"127.0.0.1:{upstream.http_port}"}]
    cfg = server_config(tmp_path, certs, upstream)
    cfg.update({
        "ingress_http": f"127.0.0.1:{free_port()}",
        "ingress_https": f"127.0.0.1:{free_port()}",
        "ingress": {
            "rules": [
                {"name": "shop/web", "host": "shop.test", "path": "/api", "backends": backend},
                {"name": "shop/empty", "host": "empty.test", "backends": []},
                {"name": "shop/secure", "host": "secure.test", "backends": backend,
                 "tls_redirect": True},
            ],
            "default_backend": {"name": "shop/fallback", "backends": backend},
            "tls": [{"name": "shop/secure-tls", "hosts": ["secure.test"],
                     "cert_pem": leaf.certificate_pem.decode(),
                     "key_pem": leaf.key_pem.decode()}],
        },
    })
    server = NodeagentProcess("server", cfg, tmp_path, "server").start()
    agent = NodeagentProcess("agent", agent_config(tmp_path, certs, upstream, cfg["tunnel"]),
                             tmp_path, "agent")
    try:
        server.wait_ready()
        agent.start().wait_ready()
        server.wait_for(lambda s: s["agents"], what="agent connected")
        yield {"server": server, "http": int(cfg["ingress_http"].rsplit(":", 1)[1]),
               "https": int(cfg["ingress_https"].rsplit(":", 1)[1]),
               "ca": tmp_path / "ingress-ca.crt"}
    finally:
        server.kill()
        agent.kill()
    assert "Traceback" not in server.logs() + agent.logs()


def test_ingress_routes_http_https_redirect_default_and_503(
        ingress_stack: dict[str, Any]) -> None:
    http, https, ca = ingress_stack["http"], ingress_stack["https"], ingress_stack["ca"]
    status, text = raw_get(http, "shop.test", "/api/items")
    assert status == 200 and "path=/api/items host=shop.test" in text
    # No rule matches /elsewhere on shop.test: the default backend answers.
    status, text = raw_get(http, "shop.test", "/elsewhere")
    assert status == 200 and "path=/elsewhere" in text
    status, text = raw_get(http, "empty.test", "/")
    assert status == 503 and "shop/empty has no ready backends" in text
    status, text = raw_get(http, "secure.test", "/login?next=1")
    assert status == 308 and "location: https://secure.test/login?next=1" in text.lower()
    status, text = raw_get(https, "secure.test", "/login", tls_ca=ca)
    assert status == 200 and "path=/login host=secure.test" in text
    # A name without a certificate gets no TLS session at all.
    with pytest.raises(ssl.SSLError):
        raw_get(https, "shop.test", "/api", tls_ca=ca)


def test_reload_changes_routes_without_a_restart(ingress_stack: dict[str, Any]) -> None:
    server: NodeagentProcess = ingress_stack["server"]
    http = ingress_stack["http"]
    cfg = dict(server.config)
    ingress = dict(cfg["ingress"])
    ingress["rules"] = [dict(ingress["rules"][0], path="/v2")]
    ingress["default_backend"] = None
    cfg["ingress"], cfg["version"] = ingress, 7
    server.config = cfg
    server.write_config()
    pid = server.proc.pid if server.proc else None
    server.signal(signal.SIGHUP)
    server.wait_for_log("routes applied")
    assert raw_get(http, "shop.test", "/v2/x")[0] == 200
    assert raw_get(http, "shop.test", "/api/items")[0] == 404
    assert server.proc is not None and server.proc.pid == pid
    # A change the running server cannot take is refused, and the routes stay.
    cfg = dict(cfg, tcp=[])
    server.config = cfg
    server.write_config()
    server.signal(signal.SIGHUP)
    server.wait_for_log("config reload refused")
    assert raw_get(http, "shop.test", "/v2/x")[0] == 200
