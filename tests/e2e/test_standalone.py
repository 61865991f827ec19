"""Standalone mode end to end: real `nodeagent server` and `nodeagent agent` processes,
real TLS and WebSocket, real sockets to services on loopback."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    TOKEN,
    Certs,
    Upstream,
    agent_config,
    echo_through,
    http_port,
    listen_port,
    run_cli,
    server_config,
    start_pair,
)
from tests.e2e.test_failures import BACK_TIMEOUT, retrying_soon

# The agent marks its tunnel socket (SO_MARK), which needs CAP_NET_ADMIN.
pytestmark = pytest.mark.needs("root")


@pytest.fixture
def stack(tmp_path: Path, certs: Certs, upstream: Upstream):  # type: ignore[no-untyped-def]
    procs: list[NodeagentProcess] = []

    def start(scheme: str = "tls", **agent_extra: Any) -> tuple[NodeagentProcess,
                                                                 NodeagentProcess]:
        server, agent = start_pair(tmp_path, certs, upstream, scheme, **agent_extra)
        procs.extend([server, agent])
        return server, agent

    yield start
    for proc in procs:  # every process first: a failed check must not leak the others
        proc.kill()
    for proc in procs:
        assert "Traceback" not in proc.logs(), proc.logs()


@pytest.mark.parametrize("scheme", ["tls", "wss"])
def test_tcp_port_and_host_routing_flow_through_the_tunnel(stack, scheme: str) -> None:  # type: ignore[no-untyped-def]
    server, agent = stack(scheme)
    payload = bytes(range(256)) * 4096  # 1 MiB, half-closed by the client
    assert echo_through(listen_port(server, 0), payload) == payload

    base = f"http://127.0.0.1:{http_port(server)}"
    with httpx.Client(timeout=5) as client:
        for _ in range(3):  # keep-alive: several requests on one connection
            r = client.get(base + "/some/path?q=1", headers={"Host": "app.test"})
            assert r.status_code == 200
            assert "path=/some/path?q=1 host=app.test xff=127.0.0.1" in r.text
        assert client.get(base + "/", headers={"Host": "nobody.test"}).status_code == 404
        r = client.get(base + "/", headers={"Host": "ghost.test"})
        assert r.status_code == 502 and "edge-404" in r.text
        r = client.get(base + "/", headers={"Host": "closed.test"})
        assert r.status_code == 502 and "refused" in r.text

    status = agent.status()
    assert status["tunnel"]["state"] == "connected"
    assert status["tunnel"]["rtt_ms"] is not None
    # The TCP mapping's stream, plus one for the HTTP requests: the front keeps its upstream
    # stream across the client's keep-alive requests.
    assert status["streams_by_outcome"]["accepted"] >= 2
    assert status["streams_by_outcome"]["refused"] >= 1
    server_status = server.status()
    (edge,) = server_status["agents"]
    assert edge["node"] == "edge-1" and edge["bytes_in"] > 1_000_000


def test_forbidden_target_is_refused_and_the_client_reset(stack) -> None:  # type: ignore[no-untyped-def]
    server, agent = stack(allow=["127.0.0.2:1"])  # nothing the server maps is allowed
    with socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=5) as sock:
        sock.sendall(b"x")
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            data = sock.recv(10)
            assert data == b""  # a clean EOF would hide the refusal
            raise AssertionError("expected a reset, got EOF")
    agent.wait_for(lambda s: s["streams_by_outcome"].get("forbidden", 0) >= 1,
                   what="forbidden counted")
    assert "stream refused: target not allowed on this node" in agent.logs()


def test_agent_reconnects_after_server_restart(tmp_path: Path, certs: Certs,
                                               upstream: Upstream) -> None:
    scfg = server_config(tmp_path, certs, upstream)
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    agent = NodeagentProcess("agent", agent_config(tmp_path, certs, upstream, scfg["tunnel"]),
                             tmp_path, "agent")
    try:
        server.wait_ready()
        agent.start().wait_ready()
        server.wait_for(lambda s: s["agents"], what="agent connected")
        # A stream that is open when the server dies must end promptly, not hang.
        sock = socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=5)
        sock.sendall(b"hello")
        assert sock.recv(5) == b"hello"
        server.kill()
        sock.settimeout(5)
        try:
            assert sock.recv(10) == b""
        except ConnectionResetError:
            pass
        sock.close()
        agent.wait_for(lambda s: s["tunnel"]["state"] != "connected", what="agent notices")
        time.sleep(1.5)  # the server stays down a while; the agent backs off meanwhile
        # It retries about every second while the server is unreachable (the timing
        # itself is not asserted: the machine is shared; see test_failures).
        row = retrying_soon(agent)
        restarted = NodeagentProcess("server", scfg, tmp_path, "server2").start()
        restarted.wait_ready()
        back = time.monotonic()
        restarted.wait_for(lambda s: s["agents"], timeout=BACK_TIMEOUT, what="agent back")
        assert echo_through(listen_port(restarted, 0), b"again") == b"again"
        elapsed = time.monotonic() - back
        print(f"\nagent served again {elapsed:.2f}s after the server was ready "
              f"(its retry delay then: {row['retry_in_seconds']}s)")
        restarted.stop()
    finally:
        server.kill()
        agent.kill()
    assert "Traceback" not in agent.logs()


def test_wrong_token_is_refused_with_clear_logs_and_backoff(tmp_path: Path, certs: Certs,
                                                            upstream: Upstream) -> None:
    scfg = server_config(tmp_path, certs, upstream)
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    agent = NodeagentProcess("agent", agent_config(
        tmp_path, certs, upstream, scfg["tunnel"], token="not-the-right-token-xyz",
        reconnect={"initial": 0.2, "maximum": 5}), tmp_path, "agent")
    try:
        server.wait_ready()
        agent.start().wait_ready()
        time.sleep(3)
        status = server.status()
        assert status["agents"] == []
        attempts = status["handshake_failures"]
        # 0.2 s doubling with jitter: at most ~5 tries in 3 s, never a storm.
        assert 1 <= attempts <= 6, attempts
    finally:
        agent.kill()
        server.kill()
    assert "agent handshake failed" in server.logs()
    assert "token not valid for node edge-1" in server.logs()
    assert "server refused our credentials" in agent.logs()
    assert "Traceback" not in server.logs() + agent.logs()


def test_mutual_tls_without_a_token(tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    scfg = server_config(tmp_path, certs, upstream, mtls=True)
    scfg["tokens"] = []
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    acfg = agent_config(tmp_path, certs, upstream, scfg["tunnel"])
    del acfg["token"]
    acfg["tls"].update(cert_file=str(certs.agent_cert), key_file=str(certs.agent_key))
    agent = NodeagentProcess("agent", acfg, tmp_path, "agent")
    try:
        server.wait_ready()
        agent.start().wait_ready()
        server.wait_for(lambda s: s["agents"], what="agent connected with its certificate")
        assert echo_through(listen_port(server, 0), b"mtls") == b"mtls"
        # A certificate for edge-1 cannot register another node.
        acfg2 = dict(acfg, node="edge-2", debug_socket=str(tmp_path / "a2.sock"))
        impostor = NodeagentProcess("agent", acfg2, tmp_path, "impostor").start()
        impostor.wait_ready()
        impostor.wait_for(lambda s: s["tunnel"]["failures"] >= 1, what="impostor refused")
        impostor.kill()
        assert "certificate is for node edge-1, HELLO claims edge-2" in server.logs()
    finally:
        agent.kill()
        server.kill()


def test_second_agent_with_the_same_name_replaces_the_first(stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The replaced agent waits its longest backoff (30 s here) before trying again, so
    # two live agents with one name do not evict each other in a loop.
    server, first = stack(reconnect={"initial": 0.1, "maximum": 30})
    cfg = dict(first.config, debug_socket=str(tmp_path / "second.sock"))
    second = NodeagentProcess("agent", cfg, tmp_path, "second").start()
    try:
        second.wait_ready()
        second.wait_for(lambda s: s["tunnel"]["state"] == "connected", what="second connected")
        assert "connected again; closing its previous connection" in server.logs()
        first.wait_for_log("replaced this connection; retrying at the slowest backoff")
        assert echo_through(listen_port(server, 0), b"x") == b"x"
    finally:
        second.kill()


def test_invalid_config_exits_2_with_one_clear_message(tmp_path: Path) -> None:
    bad = tmp_path / "agent.yaml"
    bad.write_text("node: edge-1\nserver: tls://x:1\ntoken: 0123456789abcdef0\n"
                   "allow: ['127.0.0.1:99999']\n")
    result = run_cli("agent", "--config", str(bad))
    assert result.returncode == 2
    assert "allow[0].ports[0]: port '99999' out of range 1-65535" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_cli("server", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "cannot read" in result.stderr
    result = run_cli("agent")
    assert result.returncode == 2 and "--config" in result.stderr
    result = run_cli("--bogus")
    assert result.returncode == 2 and "--help" in result.stderr


def test_debug_cli_prints_a_table_and_json(stack) -> None:  # type: ignore[no-untyped-def]
    server, agent = stack()
    result = run_cli("debug", "status", "--socket", str(agent.socket))
    assert result.returncode == 0, result.stderr
    assert "edge-1" in result.stdout and "connected" in result.stdout
    result = run_cli("debug", "status", "--socket", str(server.socket), "--json")
    doc = json.loads(result.stdout)
    assert doc["role"] == "server" and doc["agents"][0]["node"] == "edge-1"
    result = run_cli("debug", "status", "--socket", "/nonexistent/x.sock")
    assert result.returncode == 1 and "is the" in result.stderr
    # Config dumps redact secrets (the stack's server holds an inline agent token).
    result = run_cli("debug", "config", "--socket", str(server.socket), "--json")
    assert result.returncode == 0, result.stderr
    assert TOKEN not in result.stdout
    assert json.loads(result.stdout)["tokens"][0]["token"] == "[redacted]"


def test_sighup_reload_keeps_running_config_on_error(stack) -> None:  # type: ignore[no-untyped-def]
    server, agent = stack()
    agent.config_path.write_text("node: edge-1\nallow: [oops]\n")
    agent.signal(signal.SIGHUP)
    time.sleep(0.5)
    assert "config reload refused; keeping the running config" in agent.logs()
    assert echo_through(listen_port(server, 0), b"still") == b"still"


def test_http_limits_from_the_config_reach_the_front(tmp_path: Path, certs: Certs,
                                                     upstream: Upstream) -> None:
    """http_limits.max_connections_per_client caps one client address's connections."""
    scfg = server_config(tmp_path, certs, upstream)
    scfg["http_limits"] = {"max_connections_per_client": 1}
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    try:
        server.wait_ready()
        port = http_port(server)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as held:
            held.sendall(b"GET / HTTP/1.1\r\nHost: app.test\r\n")  # a head left open
            with socket.create_connection(("127.0.0.1", port), timeout=5) as second:
                answer = second.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503"), answer
    finally:
        server.kill()
