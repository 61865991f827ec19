"""The DNAT path in controller mode, with real processes in network namespaces: the
controller computes the cloud node's intercept rule (the edge nodes' addresses on
allowedNodePorts) and the servers' `control_plane_sources` from Nodes and a ClusterTunnel
with a `cloudNodeSelector`, and follows Nodes as they come and go.

    cloudnode: a client + agent cloud-1 (10.20.0.1)
      ── cloud: fake API server, controller, server (10.20.0.2 | 10.40.0.2)
      ── edge: agents edge-1 (10.40.0.1), edge-2 (10.40.0.5), the "kubelet" on :10250, :22

Nothing forwards between the links: a dial from the cloud node to an edge address has no
path but the one its agent's intercept rule gives it, through the server and the edge
node's agent. The test talks to the fake API server inside the cloud namespace.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.controller.clustertunnel import CLUSTER_TUNNELS
from nodeagent.kube.resources import CONFIGMAPS, NODES, PODS
from nodeagent.testing.netns import Topology, in_netns, netns_available
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.trust import pki
from tests.e2e.test_connect_dnat import dial
from tests.e2e.test_kubernetes import ADMIN, Api, wait_for

pytestmark = [pytest.mark.netns, pytest.mark.needs("nft")]
ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = "https://127.0.0.1:9443"  # in the cloud namespace; agents reach it via tunnel
CLOUD_LABEL = {"nodeagent.io/cloud": "true"}


class NsApi:
    """The test's API client, its sockets made in the cloud namespace."""

    def __init__(self, api: Api, ns: str) -> None:
        self.api, self.ns = api, ns

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with in_netns(self.ns):
            return getattr(self.api, method)(*args, **kwargs)

    def identity(self, tmp_path: Path, name: str, node: str, account: str) -> Path:
        """A pod on `node` and a projected token for it (the fake's TokenReview)."""
        created = self("create", PODS, {
            "metadata": {"name": name, "namespace": "nodeagent"},
            "spec": {"serviceAccountName": account, "nodeName": node,
                     "containers": [{"name": "c", "image": "nodeagent"}]}})
        token = f"dnat-{name}-0123456789abcdef"
        claims: dict[str, Any] = {
            "token": token, "namespace": "nodeagent", "service_account": account,
            "pod_name": name, "pod_uid": created["metadata"]["uid"],
            "audiences": ["nodeagent"]}
        if account == "nodeagent-agent":
            claims.update(node_name=node, node_uid=f"uid-{node}")
        with in_netns(self.ns):
            response = self.api.http.post("/_fake/tokens", json=claims)
        assert response.status_code == 200, response.text
        path = tmp_path / f"{name}.token"
        path.write_text(token)
        return path

    def node(self, name: str, address: str, labels: dict[str, str] | None = None) -> None:
        self("create", NODES, {"metadata": {"name": name, "labels": labels or {}}})
        self("replace_status", NODES, name, None, {"addresses": [
            {"type": "InternalIP", "address": address},
            {"type": "Hostname", "address": name}]})


def rules(agent: NodeagentProcess) -> dict[str, Any]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(agent.socket)),
                      timeout=2) as client:
        response = client.get("http://debug/rules")
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result


def caught(agent: NodeagentProcess) -> list[str] | None:
    """The destinations of the cloud agent's control-plane rule, None without one."""
    try:
        found = [r for r in rules(agent).get("rules", [])
                 if r["name"] == "control-plane-0"]
    except (httpx.HTTPError, OSError):
        return None
    return found[0]["destinations"] if found else None


def reaches(topo: Topology, host: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            # The greeting names the edge agent's dial (from the edge's own addresses).
            return dial(topo, "cloudnode", host, 10250, timeout=1).startswith("peer=10.40.0.")
        except OSError:
            return False
    return check


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[dict[str, Any]]:
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)
    topo = Topology()
    others: list[subprocess.Popen[bytes]] = []
    procs: list[NodeagentProcess] = []
    api: Api | None = None
    try:
        for name in ("cloudnode", "cloud", "edge"):
            topo.add(name)
        topo.link("cloudnode", ["10.20.0.1/24"], "cloud", ["10.20.0.2/24"], forward=False)
        topo.link("cloud", ["10.40.0.2/24"], "edge", ["10.40.0.1/24", "10.40.0.5/24"],
                  forward=False)
        topo.exec("cloudnode", ["ip", "route", "replace", "default", "via", "10.20.0.2"])
        kubelet = topo.popen("edge", [sys.executable, "-m", "tests.e2e.peerecho",
                                      "0.0.0.0:10250", "0.0.0.0:22"],
                             stdout=subprocess.PIPE, cwd=str(ROOT))
        others.append(kubelet)
        assert kubelet.stdout is not None and kubelet.stdout.readline().strip() == b"ready"
        kubeconfig = tmp_path / "kubeconfig"
        fake = topo.popen("cloud", [
            sys.executable, "-m", "nodeagent.testing.fakekube", "--port", "0", "--token", ADMIN,
            "--kubeconfig", str(kubeconfig), "--bookmark-interval", "0.5",
            "--namespace", "nodeagent"], cwd=str(ROOT), stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL)
        others.append(fake)
        assert fake.stdout is not None
        api = Api(json.loads(fake.stdout.readline())["url"])
        kube = NsApi(api, topo.ns("cloud"))
        controller = NodeagentProcess("controller", {"debug_socket": ""}, tmp_path, "c1",
                                      netns=topo.ns("cloud"), args=[
            "--kubeconfig", str(kubeconfig), "--namespace", "nodeagent",
            "--listen", "127.0.0.1:9443", "--identity", "c1", "--lease-seconds", "3",
            "--tls-name", "127.0.0.1"]).start()
        procs.append(controller)
        controller.wait_for_log("leading", timeout=30)
        wait_for(lambda: "ca.crt" in (kube("get", CONFIGMAPS, "nodeagent-ca", "nodeagent")
                                      .get("data") or {}), "the leader published the CA")
        cluster_ca = kube("get", CONFIGMAPS, "nodeagent-ca", "nodeagent")["data"]["ca.crt"]
        (tmp_path / "cluster-ca.crt").write_text(cluster_ca)
        tunnel_ca = pki.create_ca("dnat tunnel CA")
        pki.issue_server_certificate(tunnel_ca, [], ["10.20.0.2", "10.40.0.2"]).write(
            tmp_path / "tunnel.crt", tmp_path / "tunnel.key")
        # Agents verify the tunnel server (tunnel CA) and the controller (cluster CA).
        (tmp_path / "agent-ca.crt").write_text(cluster_ca + tunnel_ca.certificate_pem.decode())
        kube.node("cloud-1", "10.20.0.1", CLOUD_LABEL)
        kube.node("edge-1", "10.40.0.1")
        kube("create", CLUSTER_TUNNELS, {"metadata": {"name": "edge"}, "spec": {
            "allowedNodePorts": [10250], "cloudNodeSelector": CLOUD_LABEL}})
        server = NodeagentProcess("server", {"debug_socket": str(tmp_path / "s.sock")},
                                  tmp_path, "server", netns=topo.ns("cloud"), args=[
            "--controller", CONTROLLER,
            "--token-file", str(kube.identity(tmp_path, "s1", "cloud-1", "nodeagent-server")),
            "--ca-file", str(tmp_path / "cluster-ca.crt"),
            "--tunnel-listen", "tls://0.0.0.0:8443", "--tls-cert", str(tmp_path / "tunnel.crt"),
            "--tls-key", str(tmp_path / "tunnel.key"), "--server-id", "s1",
            "--debug-socket", str(tmp_path / "s.sock")]).start()
        procs.append(server)
        server.wait_ready(timeout=30)

        def agent(node: str, ns: str, server_address: str) -> NodeagentProcess:
            token = kube.identity(tmp_path, f"agent-{node}", node, "nodeagent-agent")
            proc = NodeagentProcess("agent", {"debug_socket": str(tmp_path / f"{node}.sock")},
                                    tmp_path, node, netns=topo.ns(ns), args=[
                "--node", node, "--server", f"tls://{server_address}:8443",
                "--token-file", str(token), "--ca-file", str(tmp_path / "agent-ca.crt"),
                "--controller", CONTROLLER,
                "--debug-socket", str(tmp_path / f"{node}.sock")]).start()
            procs.append(proc)
            proc.wait_ready(timeout=30)
            return proc

        cloud_agent = agent("cloud-1", "cloudnode", "10.20.0.2")
        edge = agent("edge-1", "edge", "10.40.0.2")
        server.wait_for(lambda s: {a["node"] for a in s["agents"]} == {"cloud-1", "edge-1"},
                        timeout=30, what="both agents connected")
        yield {"topo": topo, "kube": kube, "server": server, "cloud_agent": cloud_agent,
               "edge": edge, "agent": agent}
    finally:
        for proc in procs:
            proc.kill()
        for other in others:
            other.kill()
            other.wait()
            if other.stdout is not None:
                other.stdout.close()
        if api is not None:
            api.http.close()
        topo.close()
    for proc in procs:
        assert "Traceback" not in proc.logs(), proc.logs()


def test_the_controller_gives_cloud_nodes_the_dnat_path_and_follows_nodes(
        lab: dict[str, Any]) -> None:
    topo, kube, server = lab["topo"], lab["kube"], lab["server"]
    cloud_agent, edge = lab["cloud_agent"], lab["edge"]
    # The controller's rule on the cloud node: edge-1's address on allowedNodePorts; not
    # the cloud node's own address.
    wait_for(lambda: caught(cloud_agent) == ["10.40.0.1/32"], "the cloud node's rule",
             timeout=15)
    assert rules(cloud_agent)["rules"][0]["ports"] == ["10250"]
    wait_for(reaches(topo, "10.40.0.1"), "a dial to edge-1:10250 from the cloud node")
    assert edge.status()["streams_by_outcome"]["control_plane_accepted"] >= 1
    # A port outside allowedNodePorts is not caught: no path at all.
    with pytest.raises(OSError):
        dial(topo, "cloudnode", "10.40.0.1", 22, timeout=1)

    # A stream in flight is listed on the server like a CONNECT stream.
    with in_netns(topo.ns("cloudnode")):
        sock = socket.create_connection(("10.40.0.1", 10250), timeout=5)
    with sock:
        greeting = b""
        while not greeting.endswith(b"\n"):
            greeting += sock.recv(1)
        sock.sendall(b"x" * 5000)
        echoed = b""
        while len(echoed) < 5000:
            echoed += sock.recv(65536)
        status = server.wait_for(lambda s: [
            (d["node"], d["target"], d["bytes_in"], d["bytes_out"]) for d in
            s["dnat"]["streams"]] == [("edge-1", "10.40.0.1:10250", 5000,
                                       5000 + len(greeting))],
            what="the DNAT stream listed with its bytes")
        (listed,) = status["dnat"]["streams"]
        assert listed["client"].startswith("cloud-1/10.20.0.1:"), listed
        assert listed["age_seconds"] >= 0
    server.wait_for(lambda s: s["dnat"]["streams"] == [], what="the stream leaves the list")
    established = server.status()["dnat"]["by_outcome"]["established"]
    assert established >= 2

    # A Node added: the cloud node's rule gains its address, no restart anywhere.
    kube.node("edge-2", "10.40.0.5")
    edge_2 = lab["agent"]("edge-2", "edge", "10.40.0.2")
    wait_for(lambda: caught(cloud_agent) == ["10.40.0.1/32", "10.40.0.5/32"],
             "edge-2's address caught", timeout=15)
    wait_for(reaches(topo, "10.40.0.5"), "a dial to edge-2:10250 from the cloud node")
    assert edge_2.status()["streams_by_outcome"]["control_plane_accepted"] >= 1
    # The Node removed: its address leaves the set (and its agent is disconnected).
    kube("delete", NODES, "edge-2")
    wait_for(lambda: caught(cloud_agent) == ["10.40.0.1/32"], "edge-2's address dropped",
             timeout=15)
    assert not reaches(topo, "10.40.0.5")()
    assert reaches(topo, "10.40.0.1")()
    # Same processes, same tunnel throughout.
    assert cloud_agent.status()["tunnel"]["connects"] == 1
    assert server.proc is not None and server.proc.poll() is None
