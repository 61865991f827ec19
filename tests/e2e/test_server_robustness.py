"""The server rides out what an operator or a client does to it: a second signal during
its drain, a reload of its file, a CONNECT client that goes away. Real server and agent
processes, real TLS, standalone."""

from __future__ import annotations

import select
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    Certs,
    Upstream,
    agent_config,
    free_port,
    listen_port,
    server_config,
)

pytestmark = pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)


@pytest.fixture
def procs() -> Iterator[list[NodeagentProcess]]:
    started: list[NodeagentProcess] = []
    yield started
    for proc in started:
        proc.kill()
    for proc in started:
        assert "Traceback" not in proc.logs(), proc.logs()


def start(procs: list[NodeagentProcess], role: str, cfg: dict[str, Any], tmp: Path,
          name: str, *extra_args: str) -> NodeagentProcess:
    proc = NodeagentProcess(role, cfg, tmp, name, extra_args=extra_args).start()
    procs.append(proc)
    proc.wait_ready()
    return proc


# ------------------------------------------------------------------ a second signal


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_ends_the_servers_drain_at_once(
        tmp_path: Path, certs: Certs, upstream: Upstream, procs: list[NodeagentProcess],
        signum: int) -> None:
    scfg = server_config(tmp_path, certs, upstream)
    server = start(procs, "server", scfg, tmp_path, "server",
                   "--drain-seconds", "60", "--shutdown-delay", "0")
    start(procs, "agent", agent_config(tmp_path, certs, upstream, scfg["tunnel"]),
          tmp_path, "agent")
    server.wait_for(lambda s: s["agents"], what="agent connected")
    # A stream in flight keeps the drain waiting (up to its 60 s).
    with socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=10) as held:
        drain_ended_by_a_second_signal(server, held, signum)


def drain_ended_by_a_second_signal(server: NodeagentProcess, held: socket.socket,
                                   signum: int) -> None:
    held.sendall(b"in flight")
    assert held.recv(9) == b"in flight"

    assert server.proc is not None
    server.signal(signum)
    server.wait_for_log("draining agents")
    time.sleep(0.5)
    assert server.proc.poll() is None  # still draining: the stream is open
    started = time.monotonic()
    server.signal(signum)
    # Ended by the signal, not by the 60 s drain: wait(10) bounds it (a hang guard, no
    # timing of this shared machine).
    code = server.proc.wait(timeout=10)
    print(f"\nexited {time.monotonic() - started:.2f}s after the second signal")
    assert code == 0, server.logs()
    assert "Traceback" not in server.logs()
    assert "second signal: not waiting for the drain" in server.logs()
    # The stream left is ended, not kept half-alive.
    held.settimeout(5)
    try:
        assert held.recv(1) == b""
    except ConnectionResetError:
        pass


# ------------------------------------------------------------------ CONNECT client gone


def debug_streams(proc: NodeagentProcess) -> list[dict[str, Any]]:
    """`nodeagent debug streams` on a process's debug socket."""
    transport = httpx.HTTPTransport(uds=str(proc.socket))
    with httpx.Client(transport=transport, timeout=5) as client:
        rows: list[dict[str, Any]] = client.get("http://debug/streams").json()["streams"]
        return rows


class Streamer:
    """A target on the node that streams and never reads, as `logs -f` does: a burst of
    BURST bytes, then quiet until the next line (30 s away). `ended` is set when its
    connection ends (a reset: POLLHUP/POLLERR; a half-close alone is not an end, the
    target never reads it)."""

    BURST = 256 * 1024

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.ended = threading.Event()
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            poller = select.poll()
            poller.register(conn, 0)  # POLLHUP and POLLERR are always reported
            while not self._stop.is_set():
                try:
                    conn.sendall(b"x" * self.BURST)
                except OSError:
                    self.ended.set()
                    return
                quiet_until = time.monotonic() + 30
                while time.monotonic() < quiet_until and not self._stop.is_set():
                    if poller.poll(100):
                        self.ended.set()
                        return

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


@pytest.fixture
def streamer() -> Iterator[Streamer]:
    target = Streamer()
    yield target
    target.close()


def connect_front_pair(tmp: Path, certs: Certs, upstream: Upstream,
                       procs: list[NodeagentProcess],
                       ports: list[int]) -> tuple[NodeagentProcess, NodeagentProcess, Path]:
    scfg = server_config(tmp, certs, upstream)
    uds = tmp / "connect.sock"
    scfg["connect"] = {"uds": str(uds)}
    scfg["connect_nodes"] = {"edge-1": {"addresses": ["127.0.0.1"], "ports": ports}}
    server = start(procs, "server", scfg, tmp, "server")
    acfg = agent_config(tmp, certs, upstream, scfg["tunnel"])
    acfg["control_plane"] = [f"127.0.0.1:{port}" for port in ports]
    agent = start(procs, "agent", acfg, tmp, "agent")
    server.wait_for(lambda s: s["agents"], what="agent connected")
    return server, agent, uds


def open_connect(uds: Path, target: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(uds))
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200 "), head
    return sock


def test_a_connect_client_that_closes_ends_the_stream_of_a_target_that_never_reads(
        tmp_path: Path, certs: Certs, upstream: Upstream, procs: list[NodeagentProcess],
        streamer: Streamer) -> None:
    server, agent, uds = connect_front_pair(tmp_path, certs, upstream, procs,
                                            [streamer.port, upstream.echo_port])
    # A half-close is still one: the echo target sees end of file and answers in full.
    with open_connect(uds, f"edge-1:{upstream.echo_port}") as echo:
        echo.sendall(b"stdin" * 1000)
        echo.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := echo.recv(65536):
            answer += chunk
        assert answer == b"stdin" * 1000
    server.wait_for(lambda s: s["connect"]["streams"] == [], what="echo stream done")

    sock = open_connect(uds, f"edge-1:{streamer.port}")
    got = 0
    while got < Streamer.BURST:  # all the target has streamed so far
        got += len(sock.recv(65536))
    assert len(debug_streams(server)) == 1 and len(debug_streams(agent)) == 1
    sock.close()  # a full close: the client is gone, it reads nothing more
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (debug_streams(server) or debug_streams(agent)
                                           or not streamer.ended.is_set()):
        time.sleep(0.1)
    assert debug_streams(server) == [], "the server still holds the stream"
    assert debug_streams(agent) == [], "the agent still holds the stream"
    assert streamer.ended.is_set(), "the target's connection is still open"
    server.wait_for(lambda s: s["connect"]["streams"] == [], what="CONNECT stream gone")


# ------------------------------------------------------------------ CONNECT clients


def connect_over_tls(port: int, certs: Certs, cert: Path, key: Path,
                     target: str) -> bytes:
    """A CONNECT through the mutual-TLS listener with a client certificate, then one HTTP
    request through it if it was established: everything the client read."""
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.load_cert_chain(str(cert), str(key))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = tls.recv(65536)
            if not chunk:
                return got
            got += chunk
        if got.startswith(b"HTTP/1.1 200 "):
            tls.sendall(b"GET /through HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while chunk := tls.recv(65536):  # the target closes
                got += chunk
        return got


def test_the_connect_front_takes_only_the_api_servers_identity_of_the_cluster_ca(
        tmp_path: Path, certs: Certs, upstream: Upstream,
        procs: list[NodeagentProcess]) -> None:
    """The cluster CA signs kube-apiserver's egress client certificate and every kubelet's
    client certificate: only the first may open streams; a kubelet's is refused with its
    reason, a metric and one log line."""
    cluster_ca = trustme.CA()
    cluster_ca.cert_pem.write_to_path(str(tmp_path / "cluster-ca.crt"))
    identities = {
        "apiserver": cluster_ca.issue_cert("kube-apiserver",
                                           common_name="kube-apiserver-kubelet-client",
                                           organization_name="system:masters"),
        "kubelet": cluster_ca.issue_cert("edge-2", common_name="system:node:edge-2",
                                         organization_name="system:nodes"),
    }
    for name, leaf in identities.items():
        leaf.cert_chain_pems[0].write_to_path(str(tmp_path / f"{name}.crt"))
        leaf.private_key_pem.write_to_path(str(tmp_path / f"{name}.key"))
    scfg = server_config(tmp_path, certs, upstream)
    tls_port = free_port()
    scfg["connect"] = {"listen": f"127.0.0.1:{tls_port}",
                       "tls": {"client_ca_file": str(tmp_path / "cluster-ca.crt")}}
    scfg["connect_nodes"] = {"edge-1": {"addresses": ["127.0.0.1"],
                                        "ports": [upstream.http_port]}}
    server = start(procs, "server", scfg, tmp_path, "server")
    acfg = agent_config(tmp_path, certs, upstream, scfg["tunnel"])
    acfg["control_plane"] = [f"127.0.0.1:{upstream.http_port}"]
    start(procs, "agent", acfg, tmp_path, "agent")
    server.wait_for(lambda s: s["agents"], what="agent connected")
    target = f"edge-1:{upstream.http_port}"

    got = connect_over_tls(tls_port, certs, tmp_path / "apiserver.crt",
                           tmp_path / "apiserver.key", target)
    assert got.startswith(b"HTTP/1.1 200 ") and b"path=/through" in got, got
    for _ in range(3):
        got = connect_over_tls(tls_port, certs, tmp_path / "kubelet.crt",
                               tmp_path / "kubelet.key", target)
        assert got.startswith(b"HTTP/1.1 403 "), got
        assert b"cn=system:node:edge-2 o=system:nodes" in got
    status = server.wait_for(lambda s: s["connect"]["streams"] == [], what="streams done")
    assert status["connect"]["by_outcome"] == {"established": 1, "client_not_allowed": 3}
    assert server.metric("nodeagent_connect_requests_total",
                  outcome="client_not_allowed") == 3
    # One line a minute per reason, whatever the flood.
    assert server.logs().count("reason=client_not_allowed") == 1, server.logs()



# ------------------------------------------------------------------ SIGHUP


def test_sighup_revokes_a_removed_token_and_names_what_needs_a_restart(
        tmp_path: Path, certs: Certs, upstream: Upstream,
        procs: list[NodeagentProcess]) -> None:
    scfg = server_config(tmp_path, certs, upstream)
    other = {"node": "edge-2", "token": "edge-2-token-0123456789"}
    scfg["tokens"] = [*scfg["tokens"], other]
    server = start(procs, "server", scfg, tmp_path, "server")
    agent = start(procs, "agent", agent_config(tmp_path, certs, upstream, scfg["tunnel"]),
                  tmp_path, "agent")
    server.wait_for(lambda s: s["agents"], what="agent connected")

    # edge-1's token removed; the tunnel port and metrics_listen changed too.
    server.config = dict(scfg, tokens=[other],
                         tunnel=f"tls://127.0.0.1:{free_port()}",
                         metrics_listen=f"127.0.0.1:{free_port()}")
    server.write_config()
    server.signal(signal.SIGHUP)
    server.wait_for(lambda s: not s["agents"], what="the removed token's tunnel closed")
    reload = server.status()["last_reload"]
    assert reload["outcome"] == "partly_applied", reload
    assert reload["applied"] == ["routes", "tokens"]
    assert reload["tunnels_closed"] == ["edge-1"]
    assert reload["needs_restart"] == ["tunnel.url", "metrics_listen"]
    failures = agent.status()["tunnel"]["failures"]
    agent.wait_for(lambda s: s["tunnel"]["failures"] > failures,
                   what="its redial (to the unchanged tunnel port) refused")
    assert server.status()["agents"] == []
    logs = server.logs()
    assert "agent disconnected: its token was removed" in logs
    assert "config reload: not applied: needs a restart" in logs
    assert "fields=tunnel.url,metrics_listen" in logs

    # An invalid file: refused whole, the reason shown, nothing changes.
    server.config = dict(scfg, tokens=[{"node": "edge-1", "token": "short"}])
    server.write_config()
    server.signal(signal.SIGHUP)
    status = server.wait_for(lambda s: s["last_reload"]["outcome"] == "refused",
                             what="refused")
    assert "token" in status["last_reload"]["error"]
    assert server.status()["agents"] == []

    # The token back: applied in full, and the agent registers again.
    server.config = scfg
    server.write_config()
    server.signal(signal.SIGHUP)
    server.wait_for(lambda s: s["last_reload"]["outcome"] == "applied", what="applied")
    server.wait_for(lambda s: s["agents"], what="edge-1 registers again", timeout=15)
