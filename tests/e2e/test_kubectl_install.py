"""The install and the user's steps with the real `kubectl` only, against the fake API server
as a process (`python -m nodeagent.testing.fakekube --tls --rbac`).

`kubectl apply -k manifests/` (validation on) installs everything; a controller, a server and
an agent then run as processes with the flags the applied Deployments and DaemonSet give
them — read back with `kubectl get -o json`, `$(VAR)`s expanded from their `fieldRef`s, and
only addresses, file paths and test-only flags substituted. The controller authenticates as
its ServiceAccount with a token the fake knows, so RBAC from `manifests/rbac.yaml` decides
every request it makes; the agent and server hold projected tokens bound to their pods. The
user then applies an Ingress, its Service and EndpointSlice and a ClusterTunnel, and reads
what the controller reports with `kubectl get`, `describe`, `delete`, `auth can-i`.

What the fake does not do, the test does in its place: there is no kubelet or Deployment
controller (the test creates the pods and writes Deployment status from the processes'
readiness probes), no cloud load balancer (the test writes the server Service's address),
and the server's tunnel certificate is the test CA's for 127.0.0.1 rather than the
controller's `nodeagent-server-tls` (which names the in-cluster Service)."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.testing.fakekube.kubectl import needs_kubectl
from nodeagent.testing.fakekube.localcluster import (
    MANIFESTS,
    FakeApiServer,
    Kubectl,
    container_command,
    pod,
    ready,
    wait_for,
)
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Certs, Upstream, free_port

# The agent marks its tunnel socket (SO_MARK), which needs CAP_NET_ADMIN.
pytestmark = [pytest.mark.needs("root"), needs_kubectl]

ADMIN = "kubectl-e2e-admin"
NS = "nodeagent"
CONTROLLER_SA = f"system:serviceaccount:{NS}:nodeagent-controller"
LB_ADDRESS = "203.0.113.7"


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeApiServer]:
    """`python -m nodeagent.testing.fakekube --tls --rbac`, an admin kubeconfig for it."""
    server = FakeApiServer(tmp_path / "kubeconfig", ADMIN)
    try:
        yield server
    finally:
        server.close()


def test_install_and_use_with_kubectl(fake: FakeApiServer, tmp_path: Path, certs: Certs,
                                      upstream: Upstream) -> None:
    k = Kubectl(fake.kubeconfig)
    procs: list[NodeagentProcess] = []
    try:
        run_the_steps(k, fake, tmp_path, certs, upstream, procs)
    finally:
        for proc in procs:
            proc.kill()
    for proc in procs:
        assert "Traceback" not in proc.logs(), proc.logs()


def run_the_steps(k: Kubectl, fake: FakeApiServer, tmp_path: Path, certs: Certs,
                  upstream: Upstream, procs: list[NodeagentProcess]) -> None:
    # 1. The install, validation on; applied again, nothing changes.
    out = k.ok("apply", "-k", str(MANIFESTS))
    for line in ("namespace/nodeagent created",
                 "customresourcedefinition.apiextensions.k8s.io/clustertunnels.nodeagent.io "
                 "created", "clusterrole.rbac.authorization.k8s.io/nodeagent-controller created",
                 "deployment.apps/nodeagent-controller created",
                 "deployment.apps/nodeagent-server created",
                 "daemonset.apps/nodeagent-agent created",
                 "ingressclass.networking.k8s.io/nodeagent created"):
        assert line in out, out
    again = k.ok("apply", "-k", str(MANIFESTS)).splitlines()
    assert again and all(line.endswith(" unchanged") for line in again), again

    # 2. The controller, as its ServiceAccount: RBAC decides each of its requests.
    controller_pod, server_pod, agent_pod = ("nodeagent-controller-0", "nodeagent-server-0",
                                             "nodeagent-agent-x1")
    k.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "edge-1"},
             "spec": {"podCIDRs": ["10.1.0.0/24"]}},
            pod(controller_pod, "nodeagent-controller", "cloud-1"),
            pod(server_pod, "nodeagent-server", "cloud-1"),
            pod(agent_pod, "nodeagent-agent", "edge-1"))
    # The "pod" the Ingress reaches is the test's upstream on 127.0.0.1: an address of the
    # node (an endpoint only enters a node's allow list with one of its addresses or
    # inside its podCIDRs), set as the kubelet would, on the status subresource.
    k.ok("patch", "node", "edge-1", "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]}}))
    uid = {name: k.ok("get", "pod", name, "-n", NS, "-o", "jsonpath={.metadata.uid}")
           for name in (controller_pod, server_pod, agent_pod)}
    token = fake.add_token("kubectl-e2e-controller-token", tmp_path / "controller" / "token",
                      namespace=NS, service_account="nodeagent-controller",
                      pod_name=controller_pod, pod_uid=uid[controller_pod])
    fake.kubeconfig_as(token, tmp_path / "controller" / "kubeconfig")
    ports = {name: free_port() for name in ("config", "c-metrics", "tunnel", "http", "https",
                                            "s-metrics", "a-metrics", "connect")}
    controller = NodeagentProcess("controller", {"debug_socket": ""}, tmp_path, "controller",
                                  args=[*container_command(
        k.json("deployment", "nodeagent-controller", "-n", NS), "controller",
        {"metadata.name": controller_pod, "metadata.namespace": NS},
        {"--listen": f"127.0.0.1:{ports['config']}",
         "--metrics-listen": f"127.0.0.1:{ports['c-metrics']}"}),
        # Outside a pod: the API through a kubeconfig, the config stream at 127.0.0.1.
        "--kubeconfig", str(tmp_path / "controller" / "kubeconfig"), "--tls-name", "127.0.0.1"])
    procs.append(controller.start())
    controller.wait_for_log("leading", timeout=20)
    cluster_ca = wait_for(lambda: k.ok("get", "configmap", "nodeagent-ca", "-n", NS, "-o",
                                       r"jsonpath={.data.ca\.crt}"), "the CA ConfigMap")
    (tmp_path / "ca.crt").write_text(cluster_ca)
    controller_url = f"https://127.0.0.1:{ports['config']}"

    # The server and the agent, with projected tokens bound to their pods.
    token = fake.add_token("kubectl-e2e-server-token", tmp_path / "server" / "token",
                      namespace=NS, service_account="nodeagent-server", pod_name=server_pod,
                      pod_uid=uid[server_pod], audiences=["nodeagent"])
    server = NodeagentProcess("server", {"debug_socket": str(tmp_path / "s.sock")}, tmp_path,
                              "server", args=[*container_command(
        k.json("deployment", "nodeagent-server", "-n", NS), "server",
        {"metadata.name": server_pod},
        {"--controller": controller_url, "--token-file": str(token),
         "--ca-file": str(tmp_path / "ca.crt"),
         "--tunnel-listen": f"wss://127.0.0.1:{ports['tunnel']}/tunnel",
         "--tls-cert": str(certs.server_cert), "--tls-key": str(certs.server_key),
         "--ingress-http": f"127.0.0.1:{ports['http']}",
         "--ingress-https": f"127.0.0.1:{ports['https']}",
         "--metrics-listen": f"127.0.0.1:{ports['s-metrics']}",
         "--connect-listen": f"127.0.0.1:{ports['connect']}",
         "--state-dir": str(tmp_path / "server-state"),
         "--connect-client-ca": str(tmp_path / "ca.crt")}),
        "--debug-socket", str(tmp_path / "s.sock")])
    procs.append(server.start())
    server.wait_ready()
    token = fake.add_token("kubectl-e2e-agent-token", tmp_path / "agent" / "token",
                      namespace=NS, service_account="nodeagent-agent", pod_name=agent_pod,
                      pod_uid=uid[agent_pod], node_name="edge-1", node_uid="n1",
                      audiences=["nodeagent"])
    # The agent trusts the cluster CA (the controller) and the test CA (the tunnel's).
    (tmp_path / "agent-ca.crt").write_text(cluster_ca + certs.ca.read_text())
    agent = NodeagentProcess("agent", {"debug_socket": str(tmp_path / "a.sock")}, tmp_path,
                             "agent", args=container_command(
        k.json("daemonset", "nodeagent-agent", "-n", NS), "agent",
        {"spec.nodeName": "edge-1"},
        {"--server": f"wss://127.0.0.1:{ports['tunnel']}/tunnel", "--token-file": str(token),
         "--ca-file": str(tmp_path / "agent-ca.crt"), "--controller": controller_url,
         "--debug-socket": str(tmp_path / "a.sock"),
         "--metrics-listen": f"127.0.0.1:{ports['a-metrics']}"}))
    procs.append(agent.start())
    agent.wait_ready(timeout=30)
    server.wait_for(lambda s: [a["node"] for a in s["agents"]] == ["edge-1"],
                    what="the agent of edge-1 connected", timeout=20)

    # 3. The user's app: an Ingress of class nodeagent, its Service and endpoints on edge-1,
    # and a ClusterTunnel; HTTP through the server's Ingress listener reaches it.
    k.ok("create", "namespace", "shop")
    # The app's Pod, which the endpoint names (its targetRef): the controller believes an
    # endpoint only for a Pod of the Service's namespace on that node with that address.
    k.apply(pod("web-0", "default", "edge-1", namespace="shop"))
    k.ok("patch", "pod", "web-0", "-n", "shop", "--subresource=status", "--type=merge",
         "-p", json.dumps({"status": {"podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}}))
    k.apply(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "shop"},
         "spec": {"ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "web-1", "namespace": "shop",
                      "labels": {"kubernetes.io/service-name": "web"}},
         "addressType": "IPv4",
         "ports": [{"name": "http", "port": upstream.http_port, "protocol": "TCP"}],
         "endpoints": [{"addresses": ["127.0.0.1"], "nodeName": "edge-1",
                        "conditions": {"ready": True},
                        "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-0"}}]},
        ingress("shop", "shop.test", "web"),
        {"apiVersion": "nodeagent.io/v1alpha1", "kind": "ClusterTunnel",
         "metadata": {"name": "edge"},
         "spec": {"serverUrl": f"wss://127.0.0.1:{ports['tunnel']}/tunnel",
                  "allowedNodePorts": [10250]}})

    def shop() -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{ports['http']}/cart", headers={"host": "shop.test"},
                         timeout=5)

    wait_for(lambda: shop().status_code == 200, "the Ingress served through the agent")
    assert "path=/cart host=shop.test" in shop().text

    # 4. What the controller reports, in kubectl's columns.
    def tunnel_row() -> list[str] | None:
        header, *rows = k.table("ct")
        assert header == ["NAME", "SERVER", "NODES", "VERSION", "READY", "AGE"], header
        row = rows[0]
        return row if len(row) == 6 and row[2] == "1" and row[4] == "True" else None

    row = wait_for(tunnel_row, "kubectl get ct shows the tunnel covered and ready")
    assert row[:2] == ["edge", f"wss://127.0.0.1:{ports['tunnel']}/tunnel"]
    assert int(row[3]) >= 1 and row[5].endswith("s")
    assert k.ok("get", "ct", "edge", "-o", "jsonpath={.status.nodesCovered}") == "1"
    # No Deployment controller here: its status from what the probes say of our processes.
    for name, port in (("nodeagent-controller", ports["c-metrics"]),
                       ("nodeagent-server", ports["s-metrics"])):
        assert wait_for(lambda port=port: ready(port), f"{name} ready")  # type: ignore[misc]
        k.ok("patch", "deployment", name, "-n", NS, "--subresource=status", "--type=merge",
             "-p", json.dumps({"status": {"replicas": 1, "readyReplicas": 1,
                                          "updatedReplicas": 1, "availableReplicas": 1}}))
    header, *rows = k.table("deploy", "-n", NS)
    assert header == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    assert sorted(r[:4] for r in rows) == [["nodeagent-controller", "1/2", "1", "1"],
                                           ["nodeagent-server", "1/2", "1", "1"]]

    # 5. The server Service's load balancer address goes into the Ingress status…
    k.ok("patch", "service", "nodeagent-server", "-n", NS, "--subresource=status",
         "--type=merge", "-p", json.dumps(
             {"status": {"loadBalancer": {"ingress": [{"ip": LB_ADDRESS}]}}}))
    wait_for(lambda: k.table("ingress", "shop", "-n", "shop")[1][3] == LB_ADDRESS,
             "kubectl get ingress shows the address")
    described = k.ok("describe", "ingress", "shop", "-n", "shop")
    assert re.search(rf"^Address:\s+{re.escape(LB_ADDRESS)}$", described, re.M), described
    assert re.search(r"^Ingress Class:\s+nodeagent$", described, re.M), described
    # …and a broken Ingress (no such Service, no such TLS Secret) gets Events.
    broken = ingress("broken", "broken.test", "ghost")
    broken["spec"]["tls"] = [{"hosts": ["broken.test"], "secretName": "missing-tls"}]
    k.apply(broken)

    def broken_events() -> str | None:
        text = k.ok("describe", "ingress", "broken", "-n", "shop")
        return text if "ServiceNotFound" in text and "TLSSecretMissing" in text else None

    described = wait_for(broken_events, "kubectl describe shows the controller's Events")
    events = described.partition("\nEvents:")[2]
    assert re.search(r"Warning\s+ServiceNotFound\s+.*ghost", events), described
    assert re.search(r"Warning\s+TLSSecretMissing\s+.*missing-tls", events), described
    assert shop().status_code == 200  # the good one is still served

    # 6. Deleting the ClusterTunnel waits for the controller to release its finalizer: with
    # the controller paused (SIGSTOP) the object stays, marked for deletion; resumed, it
    # releases it and the object is gone.
    finalizers = k.ok("get", "ct", "edge", "-o", "jsonpath={.metadata.finalizers}")
    assert json.loads(finalizers) == ["nodeagent.io/cleanup"]
    controller.signal(signal.SIGSTOP)
    try:
        k.ok("delete", "ct", "edge", "--wait=false")
        held = k.json("ct", "edge")
        assert held["metadata"]["deletionTimestamp"], held
        assert held["metadata"]["finalizers"] == ["nodeagent.io/cleanup"]
    finally:
        controller.signal(signal.SIGCONT)
    k.ok("wait", "--for=delete", "ct/edge", "--timeout=15s")
    gone = k.run("get", "ct", "edge")
    assert gone.returncode == 1
    assert 'clustertunnels.nodeagent.io "edge" not found' in gone.stderr, gone.stderr

    # 7. What the controller's ServiceAccount may do, as the README's RBAC says.
    for args, expected in ((("update", "ingresses", "--subresource=status", "-n", "shop"), "yes"),
                           (("update", "ingresses", "-n", "shop"), "no"),
                           (("create", "tokenreviews"), "yes"),
                           (("update", "clustertunnels/finalizers"), "yes"),
                           (("delete", "nodes"), "no"),
                           (("list", "secrets", "-n", "shop"), "yes"),
                           (("update", "secrets", "-n", NS), "no")):
        result = k.run("auth", "can-i", *args, f"--as={CONTROLLER_SA}")
        assert result.stdout.strip() == expected, (args, result)
    result = k.run("auth", "can-i", "get", "secrets", "-n", NS,
                   f"--as=system:serviceaccount:{NS}:nodeagent-agent")
    assert result.stdout.strip() == "no"

    # Nothing the controller asked for was refused: RBAC covers what it does.
    requests = fake.control.get("/_fake/requests").json()
    mine = [r for r in requests if r["user"] == CONTROLLER_SA]
    assert mine, "the controller did not authenticate as its ServiceAccount"
    refused = [f"{r['method']} {r['path']}" for r in mine if r["status"] == 403]
    assert not refused, refused


def ingress(name: str, host: str, service: str) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"ingressClassName": "nodeagent", "rules": [{"host": host, "http": {
                "paths": [{"path": "/", "pathType": "Prefix", "backend": {"service": {
                    "name": service, "port": {"name": "http"}}}}]}}]}}
