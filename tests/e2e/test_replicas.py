"""Several server replicas behind one address, with real processes and sockets: a tiny TCP
balancer (threads, real sockets: it stands for the cloud's L4 load balancer) alternates
new connections between two servers; one agent dials the balancer.

What is asserted is what the issue asks: the agent ends up with a tunnel to each replica;
a replica killed leaves the node reachable through the other at once; a replica rolled
with SIGTERM hands new streams to the other while its own in-flight stream finishes; a
replica that has no tunnel from a node answers 502 at once with a body that says so."""

from __future__ import annotations

import itertools
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    Certs,
    Upstream,
    agent_config,
    echo_through,
    free_port,
    http_port,
    listen_port,
    server_config,
)
from tests.e2e.test_failures import no_tracebacks

pytestmark = pytest.mark.needs("root")  # the agent marks its socket (SO_MARK)


class Balancer:
    """Accepts on one port and splices each connection to the next backend in turn (a
    backend that refuses: the client's connection is closed, as an L4 balancer without
    health checks does)."""

    def __init__(self, backends: list[int]) -> None:
        self.backends = backends
        self._turn = itertools.cycle(range(len(backends)))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            port = self.backends[next(self._turn)]
            try:
                backend = socket.create_connection(("127.0.0.1", port), timeout=2)
            except OSError:
                client.close()
                continue
            backend.settimeout(None)
            for a, b in ((client, backend), (backend, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def replica_config(tmp: Path, certs: Certs, upstream: Upstream, name: str) -> dict[str, Any]:
    cfg = server_config(tmp, certs, upstream)
    cfg["server_id"] = name
    cfg["replicas"] = 2
    cfg["debug_socket"] = str(tmp / f"{name}.sock")
    return cfg


def tunnel_port(cfg: dict[str, Any]) -> int:
    return int(cfg["tunnel"].rsplit(":", 1)[1])


def holds(server: NodeagentProcess) -> bool:
    return any(a["node"] == "edge-1" and not a["draining"]
               for a in server.status()["agents"])


@pytest.fixture
def replicas(tmp_path: Path, certs: Certs,
             upstream: Upstream) -> Iterator[tuple[NodeagentProcess, NodeagentProcess,
                                                   Balancer, dict[str, Any]]]:
    a = NodeagentProcess("server", replica_config(tmp_path, certs, upstream, "replica-a"),
                         tmp_path, "replica-a", extra_args=["--drain-seconds", "20"])
    b = NodeagentProcess("server", replica_config(tmp_path, certs, upstream, "replica-b"),
                         tmp_path, "replica-b")
    lb = Balancer([tunnel_port(a.config), tunnel_port(b.config)])
    acfg = agent_config(tmp_path, certs, upstream, f"tls://127.0.0.1:{lb.port}")
    try:
        a.start()
        b.start()
        a.wait_ready()
        b.wait_ready()
        yield a, b, lb, acfg
    finally:
        a.kill()
        b.kill()
        lb.close()


def start_agent(tmp_path: Path, acfg: dict[str, Any]) -> NodeagentProcess:
    agent = NodeagentProcess("agent", acfg, tmp_path, "agent").start()
    agent.wait_ready()
    return agent


def wait_both(agent: NodeagentProcess, a: NodeagentProcess, b: NodeagentProcess) -> float:
    started = time.monotonic()
    status = agent.wait_for(
        lambda s: {t["server_id"] for t in s["tunnels"] if t["state"] == "open"}
        == {"replica-a", "replica-b"}, timeout=15, what="a tunnel to each replica")
    assert status["tunnel"]["replicas"] == 2
    a.wait_for(lambda s: holds(a), what="edge-1 on replica-a")
    b.wait_for(lambda s: holds(b), what="edge-1 on replica-b")
    return time.monotonic() - started


def test_a_replica_without_the_nodes_tunnel_answers_502_at_once_saying_so(
        tmp_path: Path, replicas: Any) -> None:
    """The node's only tunnel is to replica-a: replica-b does not forward to its peer
    (replicas never carry each other's traffic), it says at once that the node is not
    connected to it."""
    a, b, _, acfg = replicas
    acfg["server"] = f"tls://127.0.0.1:{tunnel_port(a.config)}"
    acfg["server_replicas"] = 1
    agent = start_agent(tmp_path, acfg)
    try:
        a.wait_for(lambda s: holds(a), what="edge-1 on replica-a")
        through_a = httpx.get(f"http://127.0.0.1:{http_port(a)}/",
                              headers={"host": "app.test"}, timeout=5)
        assert through_a.status_code == 200, through_a.text
        before = b.status()["streams_by_outcome"]
        started = time.monotonic()
        r = httpx.get(f"http://127.0.0.1:{http_port(b)}/", headers={"host": "app.test"},
                      timeout=5)
        print(f"\n502 from replica-b in {(time.monotonic() - started) * 1000:.0f} ms")
        # At once: replica-b knows it holds no tunnel from edge-1 and says so (502, not
        # the 504 of a timeout), counted as refused there (unreachable), not as a
        # timeout nor a stream opened through a peer.
        assert r.status_code == 502, r.text
        assert "node edge-1 is not connected to server replica-b" in r.text
        after = b.status()["streams_by_outcome"]
        assert after == {**before, "unreachable": before.get("unreachable", 0) + 1}, after
        assert not holds(b)
    finally:
        agent.kill()
    no_tracebacks(agent, a, b)


def test_the_agent_holds_a_tunnel_to_each_replica_and_survives_one_killed(
        tmp_path: Path, replicas: Any) -> None:
    a, b, lb, acfg = replicas
    agent = start_agent(tmp_path, acfg)
    try:
        elapsed = wait_both(agent, a, b)
        print(f"\ntunnels to both replicas {elapsed:.2f}s after the agent was ready; "
              f"balancer accepted {lb.accepted} connection(s)")
        for server in (a, b):
            assert echo_through(listen_port(server, 0), b"hi " + server.name.encode()) \
                == b"hi " + server.name.encode()
        # The agent stays at two: dials that reach a replica it holds are refused
        # politely (ALREADY_CONNECTED), never replacing the tunnel it holds.
        assert a.status()["handshake_refusals"].get("already_connected", 0) + \
            b.status()["handshake_refusals"].get("already_connected", 0) == \
            agent.status()["tunnel"]["already_connected"]
        assert "replaced" not in agent.logs()

        connects = agent.status()["tunnel"]["connects"]
        a.kill()  # kill -9: no GOAWAY
        started = time.monotonic()
        assert echo_through(listen_port(b, 0), b"after") == b"after"
        print(f"node reachable through replica-b {time.monotonic() - started:.3f}s after "
              f"replica-a was killed")
        # At once: through the tunnel it already held, no new one dialed for it.
        assert agent.status()["tunnel"]["connects"] == connects
        status = agent.wait_for(lambda s: [t["server_id"] for t in s["tunnels"]]
                                == ["replica-b"], what="replica-a's tunnel gone")
        assert status["tunnel"]["state"] == "connected"
        # It keeps dialing for the missing replica at a bounded pace: a few attempts in
        # 3 s (the extra dials back off from 1 s toward 30 s), never a storm.
        before = lb.accepted
        time.sleep(3)
        assert lb.accepted - before <= 4, lb.accepted - before
        assert holds(b)
    finally:
        agent.kill()
    no_tracebacks(agent, b)


def test_sigterm_on_one_replica_moves_new_streams_to_the_other_while_old_ones_finish(
        tmp_path: Path, replicas: Any) -> None:
    a, b, _, acfg = replicas
    agent = start_agent(tmp_path, acfg)
    stream = None
    try:
        wait_both(agent, a, b)
        stream = socket.create_connection(("127.0.0.1", listen_port(a, 0)), timeout=5)
        stream.sendall(b"before")
        assert stream.recv(6) == b"before"

        a.signal(signal.SIGTERM)
        agent.wait_for(lambda s: any(t["server_id"] == "replica-a" and
                                     t["state"] == "draining" for t in s["tunnels"]),
                       what="replica-a's tunnel draining")
        # New streams: through replica-b at once (the agent's tunnel to it was up).
        for i in range(5):
            payload = f"new {i}".encode()
            assert echo_through(listen_port(b, 0), payload) == payload
        # The stream in flight on replica-a finishes through its draining tunnel.
        stream.sendall(b"during the drain")
        got = b""
        while len(got) < 16:
            got += stream.recv(64)
        assert got == b"during the drain"
        assert a.proc is not None and a.proc.poll() is None
        stream.close()
        stream = None
        assert a.proc.wait(10) == 0
        agent.wait_for(lambda s: [t["server_id"] for t in s["tunnels"]] == ["replica-b"],
                       what="only replica-b left")
        assert holds(b)
    finally:
        if stream is not None:
            stream.close()
        agent.kill()
    assert "drain grace period over" not in a.logs()
    no_tracebacks(agent, a, b)


def test_an_agent_dials_a_replica_listed_directly(
        tmp_path: Path, replicas: Any) -> None:
    """`direct_servers`: a replica reachable at its own address gets a tunnel even when
    the public address only ever reaches the other one."""
    a, b, _, acfg = replicas
    acfg["server"] = f"tls://127.0.0.1:{tunnel_port(a.config)}"
    acfg["direct_servers"] = [f"tls://127.0.0.1:{tunnel_port(b.config)}"]
    agent = start_agent(tmp_path, acfg)
    try:
        wait_both(agent, a, b)
        assert echo_through(listen_port(b, 0), b"direct") == b"direct"
    finally:
        agent.kill()
    no_tracebacks(agent, a, b)


def test_standalone_replicas_need_distinct_server_ids(tmp_path: Path, certs: Certs,
                                                      upstream: Upstream) -> None:
    cfg = server_config(tmp_path, certs, upstream)
    cfg["server_id"] = "nodeagent-server"
    cfg["replicas"] = 2
    cfg["metrics_listen"] = f"127.0.0.1:{free_port()}"
    server = NodeagentProcess("server", cfg, tmp_path, "bad", extra_args=["--check"])
    server.start()
    assert server.proc is not None
    assert server.proc.wait(30) != 0
    assert "distinct server_id per replica" in server.logs()
    assert "Traceback" not in server.logs()


def test_the_agents_config_says_how_many_replicas_to_hold(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    """`server_replicas` in the agent's config (controller mode: pushed from the server
    Service's ready endpoints) wins over the servers' handshake: here the servers announce
    nothing, and the agent still holds a tunnel to each."""
    servers = []
    for name in ("replica-a", "replica-b"):
        cfg = replica_config(tmp_path, certs, upstream, name)
        del cfg["replicas"]
        servers.append(NodeagentProcess("server", cfg, tmp_path, name))
    a, b = servers
    lb = Balancer([tunnel_port(a.config), tunnel_port(b.config)])
    acfg = agent_config(tmp_path, certs, upstream, f"tls://127.0.0.1:{lb.port}",
                        server_replicas=2)
    agent = NodeagentProcess("agent", acfg, tmp_path, "agent")
    try:
        for server in servers:
            server.start().wait_ready()
        agent.start().wait_ready()
        wait_both(agent, a, b)
    finally:
        for proc in (agent, a, b):
            proc.kill()
        lb.close()
    no_tracebacks(agent, a, b)
