"""`nodeagent debug tunnels` and `streams` against real `nodeagent server` and `agent`
processes: a live stream through a TCP mapping shows on both sides with its target and
bytes, in tables and JSON; `--watch` redraws until SIGINT and exits 0; a node whose agent
died shows as disconnected, with why, on the server."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    Certs,
    Upstream,
    http_port,
    listen_port,
    run_cli,
    start_pair,
)

# The agent marks its tunnel socket (SO_MARK), which needs CAP_NET_ADMIN.
pytestmark = pytest.mark.needs("root")

PAYLOAD = b"0123456789" * 100  # 1000 bytes


@pytest.fixture
def pair(tmp_path: Path, certs: Certs,
         upstream: Upstream) -> Iterator[tuple[NodeagentProcess, NodeagentProcess]]:
    server, agent = start_pair(tmp_path, certs, upstream)
    try:
        yield server, agent
    finally:
        for proc in (server, agent):
            proc.kill()
        for proc in (server, agent):
            assert "Traceback" not in proc.logs(), proc.logs()


def debug_json(sock: Path, *args: str) -> Any:
    result = run_cli("debug", *args, "--socket", str(sock), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def debug_text(sock: Path, *args: str) -> str:
    result = run_cli("debug", *args, "--socket", str(sock))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def test_an_http_clients_upstream_stream_names_the_client_on_both_sides(
        pair: tuple[NodeagentProcess, NodeagentProcess], upstream: Upstream) -> None:
    # A kept-alive HTTP connection holds its upstream stream between requests: the server
    # says which route and client, and the agent, from the OPEN, which client.
    server, agent = pair
    target = f"tcp://127.0.0.1:{upstream.http_port}"
    conn = http.client.HTTPConnection("127.0.0.1", http_port(server), timeout=5)
    try:
        conn.request("GET", "/", headers={"host": "app.test"})
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        [row] = [r for r in debug_json(server.socket, "streams")["streams"]
                 if r["target"] == target]
        assert row["opened_by"].startswith("http route ")
        assert row["opened_by"].endswith(" client 127.0.0.1")
        [arow] = [r for r in debug_json(agent.socket, "streams")["streams"]
                  if r["target"] == target]
        assert arow["id"] == row["id"] and arow["opened_by"] == "client 127.0.0.1"
        assert arow["age_seconds"] >= 0
    finally:
        conn.close()


def test_a_live_stream_shows_on_both_sides_with_its_target_and_bytes(
        pair: tuple[NodeagentProcess, NodeagentProcess], upstream: Upstream) -> None:
    server, agent = pair
    target = f"tcp://127.0.0.1:{upstream.echo_port}"
    with socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=5) as sock:
        sock.sendall(PAYLOAD)
        got = b""
        while len(got) < len(PAYLOAD):
            got += sock.recv(65536)
        assert got == PAYLOAD
        host, port = sock.getsockname()[:2]
        client = f"{host}:{port}"

        # The server: every node's streams, and edge-1's alone.
        doc = debug_json(server.socket, "streams")
        assert doc["role"] == "server" and doc["server_id"] == "cloud-test"
        [row] = [r for r in doc["streams"] if r["target"] == target]
        assert row["node"] == "edge-1" and row["direction"] == "to-node"
        assert row["state"] == "open"
        assert row["bytes_to_target"] == 1000 and row["bytes_from_target"] == 1000
        assert row["opened_by"] == f"tcp mapping echo client {client}"
        assert row["age_seconds"] >= 0
        assert debug_json(server.socket, "streams", "--node", "edge-1")["streams"] == [
            {**row, "age_seconds": pytest.approx(row["age_seconds"], abs=30)}]
        assert debug_json(server.socket, "streams", "--node", "edge-9")["streams"] == []
        text = debug_text(server.socket, "streams", "--node", "edge-1")
        line = next(ln for ln in text.splitlines() if target in ln)
        assert line.split()[:5] == ["edge-1", str(row["id"]), "to-node", target, "open"]
        assert line.count("1000 B") == 2 and line.endswith(f"tcp mapping echo client {client}")

        # The agent: the same stream, from its end.
        doc = debug_json(agent.socket, "streams")
        assert doc["role"] == "agent" and doc["node"] == "edge-1"
        [arow] = [r for r in doc["streams"] if r["target"] == target]
        assert arow["id"] == row["id"] and arow["server_id"] == "cloud-test"
        assert arow["direction"] == "to-node"
        assert arow["bytes_to_target"] == 1000 and arow["bytes_from_target"] == 1000
        assert arow["opened_by"] == f"client {client}"
        text = debug_text(agent.socket, "streams")
        line = next(ln for ln in text.splitlines() if target in ln)
        assert line.split()[:4] == ["cloud-test", str(row["id"]), "to-node", target]
        assert line.count("1000 B") == 2

        # Tunnels: the agent holds one to cloud-test; the server has edge-1's.
        doc = debug_json(agent.socket, "tunnels")
        [tunnel] = doc["tunnels"]
        assert tunnel["server_id"] == "cloud-test" and tunnel["state"] == "open"
        assert tunnel["streams_open"] >= 1 and tunnel["bytes_out"] > 1000
        text = debug_text(agent.socket, "tunnels")
        assert text.startswith("agent edge-1: connected, 1 of 1 server(s) held")
        assert "cloud-test" in text and "open" in text
        doc = debug_json(server.socket, "tunnels", "--node", "edge-1")
        [tunnel] = doc["tunnels"]
        assert tunnel["node"] == "edge-1" and tunnel["state"] == "open"
        assert tunnel["streams_open"] >= 1 and tunnel["bytes_in"] > 1000
    # The stream ends with the client's connection: gone from both views.
    server.wait_for(lambda s: not [r for r in debug_json(server.socket, "streams")["streams"]
                                   if r["target"] == target], what="stream gone")
    # Its setup was timed (OPEN -> accepted, to-node) and keepalive round trips measured.
    metrics = debug_text(server.socket, "metrics")
    assert _sample(metrics, 'nodeagent_stream_setup_seconds_count{direction="to-node"}') >= 1
    agent.wait_for(lambda s: _sample(debug_text(agent.socket, "metrics"),
                                     "nodeagent_tunnel_ping_rtt_seconds_count") >= 1,
                   what="a keepalive round trip observed")


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_watch_redraws_until_sigint_and_a_dead_agent_shows_why(
        pair: tuple[NodeagentProcess, NodeagentProcess]) -> None:
    server, agent = pair
    watch = subprocess.Popen(
        [sys.executable, "-m", "nodeagent", "debug", "tunnels", "--socket",
         str(server.socket), "--watch", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert watch.stdout is not None
        frames = 0
        deadline = time.monotonic() + 20
        while frames < 3 and time.monotonic() < deadline:
            if "server cloud-test:" in watch.stdout.readline():
                frames += 1
        assert frames == 3
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=10)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 0 and "Traceback" not in err and err == ""

    # The agent dies: its tunnel is gone, the server says so and why.
    agent.kill()
    server.wait_for(
        lambda s: [t for t in debug_json(server.socket, "tunnels", "--node", "edge-1")
                   ["tunnels"] if t["state"] == "disconnected"], what="edge-1 disconnected")
    [row] = debug_json(server.socket, "tunnels", "--node", "edge-1")["tunnels"]
    assert row["state"] == "disconnected" and row["last_error"]
    assert row["last_error"].split(":")[0] in ("connection_lost", "keepalive_timeout")
    # The agent's socket is dead: one line, exit 1, with --watch too.
    result = run_cli("debug", "streams", "--socket", str(agent.socket), "--watch", "0.2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
