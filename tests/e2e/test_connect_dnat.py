"""The DNAT path in network namespaces, with the real kernel: a component on a cloud node
that cannot use an egress selector (metrics-server, a Prometheus without proxy settings)
dials <edge node IP>:10250 directly.

    cloudnode: client + agent cloud-1 (10.20.0.1) ── cloud: server (10.20.0.2 | 10.40.0.2)
        ── edge: agents edge-1 (10.40.0.1), edge-2 (10.40.0.5), the "kubelet" on :10250

Nothing forwards between the links: the cloud node has no path to the edge addresses.
Agent cloud-1's intercept rule REDIRECTs its host's dials to the edge nodes' addresses
(a set) to its transparent proxy, which opens a stream to the server; the server, which
lists cloud-1 in `control_plane_sources`, decides it like a CONNECT (allowedNodePorts) and
opens a control-plane stream to the agent of the node owning the address.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.testing.netns import Topology, in_netns, netns_available
from nodeagent.testing.procs import NodeagentProcess, kill_all, nodeagent_logs
from nodeagent.trust import pki

pytestmark = [pytest.mark.netns, pytest.mark.needs("nft")]
TOKEN = "netns-token-0123456789abcdef"


def dial(topo: Topology, ns: str, host: str, port: int, timeout: float = 5) -> str:
    """Connect from `ns`, echo 64 KiB; what the target says it saw ("peer=...")."""
    with in_netns(topo.ns(ns)):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with sock:
        sock.settimeout(timeout)
        sock.connect((host, port))
        first = b""
        while not first.endswith(b"\n"):
            chunk = sock.recv(1)
            if not chunk:
                raise ConnectionResetError(f"closed before the greeting: {first!r}")
            first += chunk
        payload = bytes(range(256)) * 256
        sock.sendall(payload)
        echoed = b""
        while len(echoed) < len(payload):
            chunk = sock.recv(65536)
            if not chunk:
                break
            echoed += chunk
        assert echoed == payload
        return first.decode().strip()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[dict[str, Any]]:
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)
    topo = Topology()
    procs: list[Any] = []
    try:
        for name in ("cloudnode", "cloud", "edge"):
            topo.add(name)
        topo.link("cloudnode", ["10.20.0.1/24"], "cloud", ["10.20.0.2/24"], forward=False)
        topo.link("cloud", ["10.40.0.2/24"], "edge", ["10.40.0.1/24", "10.40.0.5/24"],
                  forward=False)
        # A cloud node has a default route; the cloud does not forward to the edge.
        topo.exec("cloudnode", ["ip", "route", "replace", "default", "via", "10.20.0.2"])
        kubelet = topo.popen("edge", [sys.executable, "-m", "tests.e2e.peerecho",
                                      "0.0.0.0:10250", "0.0.0.0:22"],
                             stdout=subprocess.PIPE, cwd=str(Path(__file__).parents[2]))
        procs.append(kubelet)
        assert kubelet.stdout is not None and kubelet.stdout.readline().strip() == b"ready"
        ca = pki.create_ca("netns CA")
        ca.write(tmp_path / "ca.crt", tmp_path / "ca.key")
        pki.issue_server_certificate(ca, [], ["10.20.0.2", "10.40.0.2"]).write(
            tmp_path / "s.crt", tmp_path / "s.key")
        server_cfg: dict[str, Any] = {
            "tunnel": "tls://0.0.0.0:8443",
            "tls": {"cert_file": str(tmp_path / "s.crt"), "key_file": str(tmp_path / "s.key")},
            "tokens": [{"node": "*", "token": TOKEN}],
            "connect_nodes": {"edge-1": {"addresses": ["10.40.0.1"], "ports": [10250]}},
            "control_plane_sources": ["cloud-1"],
            # The CONNECT front kube-apiserver's egress selector dials (transport.uds).
            "connect": {"uds": str(tmp_path / "konnectivity.sock")},
            "debug_socket": str(tmp_path / "server.sock"),
        }
        server = NodeagentProcess("server", server_cfg, tmp_path, "server",
                                  netns=topo.ns("cloud")).start()
        procs.append(server)
        server.wait_ready()
        cloud_cfg: dict[str, Any] = {
            "node": "cloud-1", "server": "tls://10.20.0.2:8443", "token": TOKEN,
            "tls": {"ca_file": str(tmp_path / "ca.crt")},
            "debug_socket": str(tmp_path / "cloud-agent.sock"),
            "reconnect": {"initial": 0.1, "maximum": 1},
            "intercept": {"proxy_port": 15001, "rules": [
                {"name": "edge-kubelets", "destinations": ["10.40.0.1/32"],
                 "ports": [10250, 22], "host_traffic": True}]},
        }
        cloud_agent = NodeagentProcess("agent", cloud_cfg, tmp_path, "cloud-agent",
                                       netns=topo.ns("cloudnode")).start()
        procs.append(cloud_agent)

        def edge_agent(node: str, address: str) -> NodeagentProcess:
            agent = NodeagentProcess("agent", {
                "node": node, "server": "tls://10.40.0.2:8443", "token": TOKEN,
                "tls": {"ca_file": str(tmp_path / "ca.crt")},
                "control_plane": [f"{address}:10250", f"{address}:22"],
                "debug_socket": str(tmp_path / f"{node}.sock"),
                "reconnect": {"initial": 0.1, "maximum": 1},
            }, tmp_path, node, netns=topo.ns("edge")).start()
            procs.append(agent)
            agent.wait_ready()
            return agent

        edge = edge_agent("edge-1", "10.40.0.1")
        cloud_agent.wait_ready()
        server.wait_for(lambda s: {a["node"] for a in s["agents"]} == {"cloud-1", "edge-1"},
                        what="both agents connected")
        yield {"topo": topo, "server": server, "cloud_agent": cloud_agent, "edge": edge,
               "uds": tmp_path / "konnectivity.sock",
               "edge_agent": edge_agent, "server_cfg": server_cfg, "cloud_cfg": cloud_cfg}
    finally:
        kill_all(procs)
        topo.close()
        for logs in nodeagent_logs(procs):
            assert "Traceback" not in logs, logs


def test_a_cloud_node_reaches_an_edge_kubelet_by_its_address(lab: dict[str, Any]) -> None:
    topo, server = lab["topo"], lab["server"]
    # The kubelet sees the edge agent's own dial (from the node itself), not the cloud.
    assert dial(topo, "cloudnode", "10.40.0.1", 10250) == "peer=10.40.0.1"
    assert server.status()["streams_by_outcome"]["agent_opened:control_plane"] == 1
    assert lab["edge"].status()["streams_by_outcome"]["control_plane_accepted"] == 1
    # Not caught (port 7070): there is no path at all.
    with pytest.raises(OSError):
        dial(topo, "cloudnode", "10.40.0.1", 7070, timeout=1)
    # Caught but not in allowedNodePorts: the server refuses, the client sees a reset.
    with pytest.raises((ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        dial(topo, "cloudnode", "10.40.0.1", 22)
    server.wait_for_log("DNAT stream refused")
    assert server.status()["dnat"]["by_outcome"] == {"established": 1, "port_not_allowed": 1}
    assert lab["edge"].status()["streams_by_outcome"] == {"control_plane_accepted": 1}


def test_a_node_added_later_is_reachable_without_a_restart(lab: dict[str, Any]) -> None:
    topo, server, cloud_agent = lab["topo"], lab["server"], lab["cloud_agent"]
    edge_2 = lab["edge_agent"]("edge-2", "10.40.0.5")
    server.wait_for(lambda s: "edge-2" in {a["node"] for a in s["agents"]},
                    what="edge-2 connected")
    # The node list changes: the server's routes and the cloud agent's destination set.
    lab["server_cfg"]["connect_nodes"]["edge-2"] = {"addresses": ["10.40.0.5"]}
    server.config = lab["server_cfg"]
    server.write_config()
    server.signal(signal.SIGHUP)
    lab["cloud_cfg"]["intercept"]["rules"][0]["destinations"] = ["10.40.0.1/32",
                                                                "10.40.0.5/32"]
    cloud_agent.config = lab["cloud_cfg"]
    cloud_agent.write_config()
    cloud_agent.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        try:
            dial(topo, "cloudnode", "10.40.0.5", 10250, timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    # edge-2's agent dialed it (both agents share the edge namespace and its addresses).
    assert edge_2.status()["streams_by_outcome"] == {"control_plane_accepted": 1}
    assert dial(topo, "cloudnode", "10.40.0.1", 10250) == "peer=10.40.0.1"
    assert lab["edge"].status()["streams_by_outcome"] == {"control_plane_accepted": 1}
    assert server.proc is not None and server.proc.poll() is None
    assert cloud_agent.proc is not None and cloud_agent.proc.poll() is None


def test_the_egress_selector_reaches_a_kubelet_behind_nat_by_connect(
        lab: dict[str, Any]) -> None:
    """kube-apiserver's egress selector (HTTPConnect over the Unix socket) in front of an
    edge node behind NAT: nothing from outside may open a connection into the edge
    namespace, so the cloud cannot dial the kubelet, yet CONNECT by node name reaches it
    through the tunnel the agent dialed out; bytes flow both ways until a half-close."""
    topo = lab["topo"]
    topo.exec("edge", ["nft", "-f", "-"], input=(
        "table inet behind_nat {\n"
        "  chain input { type filter hook input priority 0; policy accept;\n"
        # A connection-opening SYN from outside is dropped (conntrack would misjudge
        # the tunnels opened before this table existed: their packets are not new).
        '    iifname != "lo" tcp flags & (syn | ack) == syn drop\n  }\n}\n'))
    with pytest.raises(OSError):  # the cloud (the server's namespace) has no way in
        dial(topo, "cloud", "10.40.0.1", 10250, timeout=1)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        sock.settimeout(10)
        sock.connect(str(lab["uds"]))
        sock.sendall(b"CONNECT edge-1:10250 HTTP/1.1\r\nHost: edge-1:10250\r\n\r\n")
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            chunk = sock.recv(1)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200 "), head
        greeting = b""
        while not greeting.endswith(b"\n"):
            greeting += sock.recv(1)
        assert greeting == b"peer=10.40.0.1\n"  # dialed by the edge agent, on the node
        payload = bytes(range(256)) * 1024
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)  # half-close: the answer still comes back whole
        echoed = b""
        while chunk := sock.recv(65536):
            echoed += chunk
        assert echoed == payload
    assert lab["edge"].status()["streams_by_outcome"]["control_plane_accepted"] == 1
