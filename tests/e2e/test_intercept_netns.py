"""Interception end to end in network namespaces, with the real kernel:

    pod (10.10.0.2) ── node: agent (10.10.0.1 | 10.20.0.1) ── cloud: server (10.20.0.2 |
    10.30.0.1) ── remote: destinations (10.30.0.2, 10.30.0.3)

A plain client in `pod` connects to a destination's IP:port. The agent's rules catch it,
the agent carries it through the tunnel, the server dials it (egress allow list), so the
destination sees the connection coming from the cloud (10.30.0.1), not from the pod.
"""

from __future__ import annotations

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

from nodeagent.testing.netns import Topology, in_netns
from tests.e2e.interceptlab import NODE_POD_IF, intercept_lab

pytestmark = [pytest.mark.netns, pytest.mark.needs("nft")]


@pytest.fixture
def lab(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The lab; parametrize indirectly with "legacy" to make `node` look like an
    iptables-legacy host (kube-proxy's chain in legacy iptables) before the agent starts."""
    def legacy(topo: Topology) -> None:
        topo.exec("node", ["iptables-legacy", "-t", "nat", "-N", "KUBE-SERVICES"])

    with intercept_lab(
        tmp_path,
        peer=["tests.e2e.peerecho", "0.0.0.0:8080", "0.0.0.0:7070", "0.0.0.0:9090",
              "0.0.0.0:6060", "[::]:8080"],
        egress=["10.30.0.0/24:8080", "10.30.0.0/24:9090", "[fd30::2]:8080"],
        intercept={"proxy_port": 15001, "rules": [
            {"name": "to-remote", "destinations": ["10.30.0.0/24", "fd30::/64"],
             "ports": [8080, 7070], "source_interfaces": [NODE_POD_IF],
             "exclude": ["10.30.0.3/32"]},
            {"name": "direct-9090", "destinations": ["10.30.0.2/32"], "ports": [9090],
             "via": "direct", "host_traffic": True},
        ]},
        before_agent=legacy if getattr(request, "param", "nftables") == "legacy" else None,
    ) as lab:
        yield {"topo": lab.topo, "server": lab.server, "agent": lab.agent,
               "node_pod_if": lab.node_pod_if}


def _expect_reset(topo: Topology, ns: str, host: str, port: int) -> None:
    """The connection is accepted (the agent's transparent listener) and then reset: a
    clean end (FIN) would tell the client the destination closed, which it did not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with in_netns(topo.ns(ns)):
        sock = socket.socket(family, socket.SOCK_STREAM)
    with sock:
        sock.settimeout(5)
        with pytest.raises(ConnectionResetError):
            # The reset may come before connect() returns: the agent learns at once.
            sock.connect((host, port))
            while sock.recv(65536):
                pass  # nothing is expected; a clean end leaves the loop without raising


def connect_from(topo: Topology, ns: str, host: str, port: int,
                 payload: bytes = b"ping") -> str:
    """Connect from namespace `ns`; return what the destination says it saw."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with in_netns(topo.ns(ns)):
        sock = socket.socket(family, socket.SOCK_STREAM)
    with sock:
        sock.settimeout(5)
        sock.connect((host, port))
        first = b""
        while not first.endswith(b"\n"):
            chunk = sock.recv(1)
            if not chunk:
                break
            first += chunk
        sock.sendall(payload)
        echoed = b""
        while len(echoed) < len(payload):
            chunk = sock.recv(65536)
            if not chunk:
                break
            echoed += chunk
        assert echoed == payload
        return first.decode().strip()


def nft_table(topo: Topology) -> subprocess.CompletedProcess[str]:
    return topo.exec("node", ["nft", "list", "table", "inet", "nodeagent"], check=False)


def test_pod_traffic_goes_through_the_tunnel_and_exits_at_the_cloud(lab: dict[str, Any]) -> None:
    topo = lab["topo"]
    # Intercepted: the destination sees the cloud's address.
    assert connect_from(topo, "pod", "10.30.0.2", 8080) == "peer=10.30.0.1"
    # IPv6 too.
    assert connect_from(topo, "pod", "fd30::2", 8080) == "peer=fd30::1"
    # Excluded destination: plain routing, the destination sees the pod itself.
    assert connect_from(topo, "pod", "10.30.0.3", 8080) == "peer=10.10.0.2"
    # Not a port the rules name: plain routing.
    assert connect_from(topo, "pod", "10.30.0.2", 6060) == "peer=10.10.0.2"
    status = lab["agent"].status()
    assert status["intercepted_by_outcome"]["tunnel"] >= 2


def test_agent_own_dials_are_marked_and_not_intercepted(lab: dict[str, Any]) -> None:
    """direct-9090 also catches the node's own traffic (host_traffic) and the agent then
    dials the same destination itself: without the mark that dial would be caught again
    and loop forever. The destination sees the node's address."""
    topo = lab["topo"]
    assert connect_from(topo, "pod", "10.30.0.2", 9090) == "peer=10.20.0.1"
    assert connect_from(topo, "node", "10.30.0.2", 9090) == "peer=10.20.0.1"
    assert lab["agent"].status()["intercepted_by_outcome"]["direct"] >= 2


def test_forbidden_destination_resets_promptly_and_logs_once(lab: dict[str, Any]) -> None:
    topo = lab["topo"]
    for _ in range(3):
        # Promptly: a reset, not the 5 s socket timeout of _expect_reset (no timing).
        _expect_reset(topo, "pod", "10.30.0.2", 7070)  # intercepted, not in egress
    agent = lab["agent"]
    agent.wait_for(lambda s: s["intercepted_by_outcome"].get("forbidden", 0) >= 3,
                   what="refusals counted")
    assert agent.logs().count("intercepted connection refused; client reset") == 1
    assert lab["server"].logs().count("agent stream refused: destination not allowed") == 1


def test_rule_removal_restores_direct_routing_and_debug_rules_reads_the_kernel(
        lab: dict[str, Any]) -> None:
    topo, agent = lab["topo"], lab["agent"]
    result = subprocess.run([sys.executable, "-m", "nodeagent", "debug", "rules", "--socket",
                             str(agent.socket)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "table inet nodeagent" in result.stdout and "applied in the kernel" in result.stdout
    cfg = dict(agent.config)
    cfg["intercept"] = dict(cfg["intercept"], rules=[cfg["intercept"]["rules"][1]])
    agent.config = cfg
    agent.write_config()
    agent.signal(signal.SIGHUP)
    agent.wait_for_log("intercept rules applied")
    assert connect_from(topo, "pod", "10.30.0.2", 8080) == "peer=10.10.0.2"
    # An invalid change is refused and the previous rules stay.
    cfg["intercept"] = dict(cfg["intercept"], rules=[dict(cfg["intercept"]["rules"][0],
                                                          source_interfaces=["nosuch0"])])
    agent.config = cfg
    agent.write_config()
    agent.signal(signal.SIGHUP)
    agent.wait_for_log("config reload refused")
    assert "nosuch0" in agent.logs()
    assert connect_from(topo, "pod", "10.30.0.2", 9090) == "peer=10.20.0.1"


def test_table_removed_on_shutdown_and_rebuilt_after_kill_9(lab: dict[str, Any]) -> None:
    topo, agent = lab["topo"], lab["agent"]
    assert nft_table(topo).returncode == 0
    agent.kill()  # SIGKILL: no cleanup
    assert nft_table(topo).returncode == 0, "a crashed agent leaves its table behind"
    agent.start()
    agent.wait_ready()
    lab["server"].wait_for(lambda s: s["agents"], what="agent back")
    assert "intercepting" in agent.logs()
    assert connect_from(topo, "pod", "10.30.0.2", 8080) == "peer=10.30.0.1"
    assert nft_table(topo).stdout.count("table inet nodeagent") == 1
    assert agent.stop() == 0
    assert nft_table(topo).returncode != 0, "clean shutdown removes the table"


@pytest.mark.parametrize("lab", ["legacy"], indirect=True)
@pytest.mark.needs("iptables-legacy", "iptables-legacy-restore")
def test_legacy_iptables_host_gets_chains_there_and_traffic_flows(lab: dict[str, Any]) -> None:
    """A host whose legacy iptables holds kube-proxy's chains gets NODEAGENT-* chains next
    to them, not an nftables table (never mix backends on one host)."""
    topo, agent = lab["topo"], lab["agent"]
    assert connect_from(topo, "pod", "10.30.0.2", 8080) == "peer=10.30.0.1"
    assert connect_from(topo, "pod", "fd30::2", 8080) == "peer=fd30::1"
    assert connect_from(topo, "pod", "10.30.0.3", 8080) == "peer=10.10.0.2"
    saved = topo.exec("node", ["iptables-legacy-save"]).stdout
    assert "NODEAGENT" in saved and "KUBE-SERVICES" in saved
    assert nft_table(topo).returncode != 0, "no nftables table on a legacy host"
    assert "kube-proxy's chains" in agent.logs()
    assert agent.stop() == 0
    saved = topo.exec("node", ["iptables-legacy-save"]).stdout
    assert "NODEAGENT" not in saved and "KUBE-SERVICES" in saved


def _open_intercepted(topo: Topology, host: str, port: int) -> socket.socket:
    """An intercepted connection held open: greeted, one echo done."""
    with in_netns(topo.ns("pod")):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect((host, port))
    assert _echo(sock, b"hello") == b"peer=10.30.0.1\nhello"
    return sock


def _echo(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while not got.endswith(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_sigterm_lets_intercepted_connections_in_flight_finish_and_hands_rules_over(
        lab: dict[str, Any]) -> None:
    """An agent restarting in place (a DaemonSet rollout, keep_rules_on_exit): SIGTERM
    closes the proxy listener, the connection in flight carries on until it ends, the
    agent then exits by itself; the rules stay, so a pod's new connection meanwhile is
    refused, never sent around the tunnel; the next agent takes over the same table."""
    topo, agent = lab["topo"], lab["agent"]
    agent.kill()
    agent.config.update(keep_rules_on_exit=True, drain_seconds=30)
    agent.start()
    agent.wait_ready()
    lab["server"].wait_for(lambda s: s["agents"], what="agent back")
    in_flight = _open_intercepted(topo, "10.30.0.2", 8080)
    with in_flight:
        agent.signal(signal.SIGTERM)
        agent.wait_for_log("draining")
        assert "intercepted=1" in agent.logs()
        # Still served, while the agent drains:
        for i in range(3):
            assert _echo(in_flight, f"still-{i}".encode()).endswith(f"still-{i}".encode())
        # A new intercepted connection is refused (the rule is there, the listener gone),
        # not carried around the tunnel:
        with pytest.raises(ConnectionRefusedError):
            connect_from(topo, "pod", "10.30.0.2", 8080)
        assert agent.proc is not None and agent.proc.poll() is None, "exited while busy"
    # The last connection closed: the agent exits by itself, well before drain_seconds.
    assert agent.proc.wait(15) == 0
    assert "drained: nothing left in flight" in agent.logs()
    assert "leaving intercept rules in place for the next agent" in agent.logs()
    assert nft_table(topo).returncode == 0, "the rules are left for the next agent"
    with pytest.raises(ConnectionRefusedError):
        connect_from(topo, "pod", "10.30.0.2", 8080)
    stopped = time.monotonic()
    agent.start()
    deadline = time.monotonic() + 20
    while True:
        try:
            seen = connect_from(topo, "pod", "10.30.0.2", 8080)
            break
        except (ConnectionRefusedError, ConnectionResetError, AssertionError, OSError):
            assert time.monotonic() < deadline, agent.logs()
            time.sleep(0.05)
    print(f"intercepted connections refused for {time.monotonic() - stopped:.2f}s while "
          f"the next agent started")
    assert seen == "peer=10.30.0.1", "the next agent carries it through the tunnel again"
    assert nft_table(topo).stdout.count("table inet nodeagent") == 1
    # Uninstalling: stop for good, then --cleanup removes what was kept.
    assert agent.stop() == 0
    assert nft_table(topo).returncode == 0
    cleanup = topo.exec("node", [sys.executable, "-m", "nodeagent", "agent", "--cleanup"],
                        check=False)
    assert cleanup.returncode == 0 and "nftables table" in cleanup.stdout, cleanup
    assert nft_table(topo).returncode != 0
    assert connect_from(topo, "pod", "10.30.0.2", 8080) == "peer=10.10.0.2", "direct again"


def test_sigterm_resets_what_outlives_the_drain_time_and_removes_the_rules(
        lab: dict[str, Any]) -> None:
    topo, agent = lab["topo"], lab["agent"]
    agent.kill()
    agent.config.update(drain_seconds=1)
    agent.start()
    agent.wait_ready()
    lab["server"].wait_for(lambda s: s["agents"], what="agent back")
    with _open_intercepted(topo, "10.30.0.2", 8080) as idle:
        agent.signal(signal.SIGTERM)
        assert agent.proc is not None and agent.proc.wait(15) == 0
        try:
            assert idle.recv(100) == b"", "closed, not hung"
        except ConnectionResetError:
            pass  # reset: not hung either
    assert "drain time over; resetting what is left" in agent.logs()
    assert "intercepted=1" in agent.logs()
    assert nft_table(topo).returncode != 0, "without keep_rules_on_exit the table goes"


def test_debug_streams_show_an_intercepted_connection_on_both_sides(
        lab: dict[str, Any]) -> None:
    """`nodeagent debug streams`: a pod's intercepted connection, held open, is a from-node
    stream naming the pod's address and the rule, with its bytes, on the agent and on the
    server."""
    topo = lab["topo"]
    payload = b"x" * 3000
    with in_netns(topo.ns("pod")):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with sock:
        sock.settimeout(5)
        sock.connect(("10.30.0.2", 8080))
        host, port = sock.getsockname()[:2]
        pod = f"{host}:{port}"
        first = b""
        while not first.endswith(b"\n"):
            first += sock.recv(1)
        sock.sendall(payload)
        echoed = b""
        while len(echoed) < len(payload):
            echoed += sock.recv(65536)
        for proc, peer in ((lab["agent"], {"server_id": "nodeagent-server"}),
                           (lab["server"], {"node": "edge-1"})):
            result = subprocess.run([sys.executable, "-m", "nodeagent", "debug", "streams",
                                     "--socket", str(proc.socket), "--json"],
                                    capture_output=True, text=True, timeout=30)
            assert result.returncode == 0, result.stderr
            rows = [r for r in json.loads(result.stdout)["streams"]
                    if r["target"] == "tcp://10.30.0.2:8080"]
            assert len(rows) == 1, rows
            row = rows[0]
            assert row["direction"] == "from-node" and row["id"] % 2 == 1, row
            assert row["opened_by"] == f"intercepted pod {pod} (rule to-remote)", row
            assert row["bytes_to_target"] == len(payload), row
            assert row["bytes_from_target"] == len(first) + len(payload), row
            assert peer.items() <= row.items(), row
