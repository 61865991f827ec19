"""PROXY protocol in controller mode: a server started only with flags, trusting a load
balancer by `--proxy-protocol-from`, with HAProxy (send-proxy-v2) in front of its Ingress
listener. The Ingress's backend sees the client HAProxy saw in X-Forwarded-For; the
balancer's address without a header, and a client's forged header, are refused."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.proxyprotocol import build_header
from nodeagent.testing.standalone import Certs, Upstream, free_port
from tests.e2e.test_kubernetes import (
    controllers,
    seed_identities,
    serve_a_test,
    start_cluster_agent,
    start_cluster_server,
    wait_for,
)
from tests.e2e.test_proxy_protocol import BALANCER, CLIENT, http_get, start_haproxy

pytestmark = [pytest.mark.needs("root", "haproxy")]
__all__ = ["controllers"]  # the fixture, shared with test_kubernetes


@pytest.fixture
def balanced(controllers: dict[str, Any], tmp_path: Path, certs: Certs,
             upstream: Upstream) -> Iterator[dict[str, Any]]:
    api, procs = controllers["api"], controllers["procs"]
    ports = {name: free_port() for name in ("tunnel", "http", "lb")}
    seed_identities(api, tmp_path, certs)
    controller_url = f"https://127.0.0.1:{controllers['ports']['c1']}"
    server = start_cluster_server(
        tmp_path, controller_url, ports["tunnel"], certs.server_cert, certs.server_key,
        "--ingress-http", f"127.0.0.1:{ports['http']}",
        "--proxy-protocol-from", f"{BALANCER}/32",
        "--state-dir", str(tmp_path / "server-state"))
    procs.append(server)
    server.wait_ready()
    agent = start_cluster_agent(tmp_path, controller_url, ports["tunnel"])
    procs.append(agent)
    agent.wait_ready(timeout=30)
    server.wait_for(lambda s: s["agents"], what="agent connected")
    haproxy = start_haproxy(tmp_path, {ports["lb"]: ports["http"]})
    try:
        yield {"api": api, "server": server, "ports": ports, "upstream": upstream}
    finally:
        haproxy.terminate()
        haproxy.wait(10)


def test_ingress_behind_a_proxy_protocol_balancer(balanced: dict[str, Any]) -> None:
    api, ports, server = balanced["api"], balanced["ports"], balanced["server"]
    serve_a_test(api, balanced["upstream"])
    wait_for(lambda: http_get(ports["lb"], "a.test", source=CLIENT)[0]
             .startswith(b"HTTP/1.1 200"), "Ingress served through the balancer")
    answer, _ = http_get(ports["lb"], "a.test", source=CLIENT)
    assert f"xff={CLIENT}".encode() in answer, answer
    # Straight to the listener: a client is served as itself...
    answer, _ = http_get(ports["http"], "a.test")
    assert answer.startswith(b"HTTP/1.1 200") and b"xff=127.0.0.1" in answer
    # ...its forged header is refused, and the balancer's address must send one.
    forged = build_header("v2", ("198.51.100.9", 1), ("127.0.0.1", ports["http"]))
    assert http_get(ports["http"], "a.test", prefix=forged)[0] == b""
    assert http_get(ports["http"], "a.test", source=BALANCER)[0] == b""
    status = server.wait_for(lambda s: s["proxy_protocol"]["headers"].get("untrusted"),
                             what="refusal counted")
    headers = status["proxy_protocol"]["headers"]
    assert headers["untrusted"] == 1 and headers["bad_signature"] == 1
    assert headers["accepted"] >= 2
    with socket.create_connection(("127.0.0.1", ports["http"]), timeout=5):
        pass  # the listener still serves after the refusals
    assert "Traceback" not in server.logs()
