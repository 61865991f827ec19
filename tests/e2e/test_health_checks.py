"""Active health checks with real processes, standalone: an Ingress rule with two
backends on edge-1, each an HTTP service whose /healthz the test turns on and off. The
agent checks them beside them and reports to the server, which then sends requests only
to the healthy one, before any request to the other fails; with both unhealthy it tries
them all as before. A TCP check of a closed port shows unhealthy in the debug views."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    Certs,
    QuietHTTPServer,
    Upstream,
    agent_config,
    echo_through,
    free_port,
    listen_port,
    run_cli,
    server_config,
)
from tests.e2e.test_proxy_protocol import http_get

pytestmark = pytest.mark.needs("root")  # the agent marks its sockets (SO_MARK)


class Backend:
    """An HTTP service that says who it is; /healthz answers 200 or 503 as told."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.healthy = True
        self.requests = 0
        backend = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    status, body = (200, b"ok") if backend.healthy else (503, b"down")
                else:
                    backend.requests += 1
                    status, body = 200, f"served by {backend.name}".encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stack(tmp_path: Path, certs: Certs, upstream: Upstream) -> Iterator[dict[str, Any]]:
    a, b = Backend("a"), Backend("b")
    closed = free_port()
    check = {"kind": "http", "path": "/healthz", "interval": 0.5, "timeout": 2,
             "healthy_threshold": 1, "unhealthy_threshold": 1}
    cfg = server_config(tmp_path, certs, upstream)
    cfg["ingress_http"] = f"127.0.0.1:{free_port()}"
    cfg["ingress"] = {"rules": [{
        "name": "shop/web", "host": "shop.test", "health_check": check, "backends": [
            {"node": "edge-1", "target": f"127.0.0.1:{a.port}"},
            {"node": "edge-1", "target": f"127.0.0.1:{b.port}"}]}]}
    cfg["tcp"][0]["health_check"] = {"kind": "tcp", "interval": 0.5,
                                     "unhealthy_threshold": 1}
    cfg["tcp"][0]["target"] = f"127.0.0.1:{closed}"
    server = NodeagentProcess("server", cfg, tmp_path, "server").start()
    acfg = agent_config(tmp_path, certs, upstream, cfg["tunnel"])
    acfg["allow"] += [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}", f"127.0.0.1:{closed}"]
    agent = NodeagentProcess("agent", acfg, tmp_path, "agent")
    try:
        server.wait_ready()
        agent.start().wait_ready()
        server.wait_for(lambda s: s["agents"], what="agent connected")
        yield {"server": server, "agent": agent, "a": a, "b": b, "closed": closed,
               "port": int(cfg["ingress_http"].rsplit(":", 1)[1])}
    finally:
        server.stop()
        agent.stop()
        a.close()
        b.close()
    assert "Traceback" not in server.logs() + agent.logs()


def states(status: dict[str, Any]) -> dict[str, str]:
    return {row["target"]: row["state"] for row in status["backend_health"]}


def test_requests_go_only_to_healthy_backends(stack: dict[str, Any]) -> None:
    server, agent, a, b = stack["server"], stack["agent"], stack["a"], stack["b"]
    port, closed = stack["port"], stack["closed"]
    target_a, target_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    b.healthy = False
    server.wait_for(lambda s: states(s).get(target_a) == "healthy"
                    and states(s).get(target_b) == "unhealthy"
                    and states(s).get(f"127.0.0.1:{closed}") == "unhealthy",
                    what="the agent's first reports")
    for _ in range(10):
        answer, _ = http_get(port, "shop.test")
        assert answer.startswith(b"HTTP/1.1 200") and b"served by a" in answer, answer
    assert b.requests == 0  # never sent to b: no request had to fail first

    # b recovers and a goes down: traffic follows the checks, not failed requests.
    b.healthy, a.healthy = True, False
    server.wait_for(lambda s: states(s).get(target_a) == "unhealthy"
                    and states(s).get(target_b) == "healthy", what="the states flipped")
    served_by_a = a.requests
    for _ in range(10):
        answer, _ = http_get(port, "shop.test")
        assert b"served by b" in answer, answer
    assert a.requests == served_by_a

    # Both unhealthy: both tried, as without checks (the services still answer).
    b.healthy = False
    server.wait_for(lambda s: states(s).get(target_b) == "unhealthy", what="b down")
    seen = {http_get(port, "shop.test")[0].rsplit(b" ", 1)[-1] for _ in range(6)}
    assert seen == {b"a", b"b"}
    assert "every backend of the route is unhealthy" in server.logs()

    # A TCP mapping's one target, unhealthy: still tried, and the server says so.
    with contextlib.suppress(ConnectionResetError):  # the target is closed: a reset
        echo_through(listen_port(server, 0), b"x")
    server.wait_for_log("the mapping's backend is unhealthy; trying it anyway")

    # The agent's view: its checks, their states, and why.
    rows = {row["target"]: row for row in agent.status()["health_checks"]}
    assert rows[target_a]["state"] == "unhealthy" and "503" in rows[target_a]["detail"]
    assert rows[f"127.0.0.1:{closed}"]["kind"] == "tcp"
    assert agent.metric("nodeagent_agent_health_checks_total", result="ok") > 0
    # `nodeagent debug status`: a table of the states on the server, of the checks on
    # the agent.
    shown = run_cli("debug", "status", "--socket", str(server.socket)).stdout
    assert "backend_health (3)" in shown and target_b in shown
    shown = run_cli("debug", "status", "--socket", str(agent.socket)).stdout
    assert "health_checks (3)" in shown and "GET /healthz answered 503" in shown
    # (labels in the order the exposition sorts them)
    assert server.metric("nodeagent_backend_health", node="edge-1", state="unhealthy",
                         target=target_b) == 1
