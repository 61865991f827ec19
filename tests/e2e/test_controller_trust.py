"""What a namespace user can make the servers dial, end to end with real processes (the fake
API server and two controller replicas): the direct-backends opt-in is the cluster
admin's (a ClusterTunnel's `directBackendNamespaces`), and an EndpointSlice is believed
only for a Pod of the Service's own namespace on the endpoint's node. What the servers and
the node would be told is read from the controllers' config stream with a server's and
the node's certificates; what the user is told, from the Events in the API."""

from __future__ import annotations

import functools
import json
from typing import Any

import trio

from nodeagent.config import NodeConfig, RoutesConfig
from nodeagent.controller.clustertunnel import CLUSTER_TUNNELS
from nodeagent.kube.resources import (
    CONFIGMAPS,
    ENDPOINTSLICES,
    EVENTS,
    INGRESSES,
    NODES,
    PODS,
    SERVICES,
)
from tests.controller.identity import obtain_identity
from tests.e2e.test_kubernetes import (  # noqa: F401 (fixtures)
    NS,
    Api,
    add_token,
    controllers,
    pod,
    read_config,
    wait_for,
)

AGENT = "e2e-trust-agent-token-0123456789"
SERVER = "e2e-trust-server-token-0123456789"


def running_pod(api: Api, namespace: str, name: str, node: str, ip: str) -> None:
    api.create(PODS, {"metadata": {"name": name, "namespace": namespace}, "spec": {
        "nodeName": node, "containers": [{"name": "c", "image": "app"}]}})
    api.replace_status(PODS, name, namespace, {"phase": "Running", "podIP": ip,
                                               "podIPs": [{"ip": ip}]})


def endpoint(ip: str, ref: tuple[str, str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"addresses": [ip], "nodeName": "edge-1",
                           "conditions": {"ready": True}}
    if ref is not None:
        out["targetRef"] = {"kind": "Pod", "namespace": ref[0], "name": ref[1]}
    return out


class Reader:
    """The servers' and edge-1's config as a controller replica serves them."""

    def __init__(self, api: Api, port: int) -> None:
        wait_for(lambda: "ca.crt" in (api.get(CONFIGMAPS, "nodeagent-ca", "nodeagent").get(
            "data") or {}), "the leader published the CA")
        ca_pem = api.get(CONFIGMAPS, "nodeagent-ca", "nodeagent")["data"]["ca.crt"]
        uid = pod(api, "nodeagent-agent-x1", "edge-1", "nodeagent-agent")
        add_token(api, AGENT, namespace="nodeagent", service_account="nodeagent-agent",
                  pod_name="nodeagent-agent-x1", pod_uid=uid, node_name="edge-1",
                  node_uid="n1", audiences=["nodeagent"])
        uid = pod(api, "nodeagent-server-s1", "cloud-1", "nodeagent-server")
        add_token(api, SERVER, namespace="nodeagent", service_account="nodeagent-server",
                  pod_name="nodeagent-server-s1", pod_uid=uid, audiences=["nodeagent"])
        url = f"https://127.0.0.1:{port}"
        self.port = port
        self.node = trio.run(functools.partial(obtain_identity, url, ca_pem, AGENT,
                                               "node")).client_context()
        self.server = trio.run(functools.partial(obtain_identity, url, ca_pem, SERVER,
                                                 "server")).client_context()

    def routes(self) -> RoutesConfig:
        status, body = read_config(self.port, "/v1/config/servers/s1", self.server)
        assert status == 200, body
        return RoutesConfig.model_validate(json.loads(body)["config"])

    def edge(self) -> NodeConfig:
        status, body = read_config(self.port, "/v1/config/nodes/edge-1", self.node)
        assert status == 200, body
        return NodeConfig.model_validate(json.loads(body)["config"])

    def backends(self, host: str) -> set[tuple[str | None, str]]:
        return {(b.node, b.target.host) for r in self.routes().ingress.rules
                if r.host == host for b in r.backends}


def events(api: Api, name: str) -> dict[str, str]:
    return {e["reason"]: e.get("message", "") for e in api.list(EVENTS, NS)
            if (e.get("involvedObject") or e.get("regarding") or {}).get("name") == name}


def test_a_namespace_user_cannot_aim_the_server_without_the_admins_opt_in(
        controllers: dict[str, Any]) -> None:  # noqa: F811 (the fixture)
    api = controllers["api"]
    api.create(NODES, {"metadata": {"name": "edge-1"}, "spec": {"podCIDRs": ["10.1.0.0/24"]}})
    api.replace_status(NODES, "edge-1", None, {"addresses": [
        {"type": "InternalIP", "address": "192.168.7.10"}]})
    reader = Reader(api, controllers["ports"]["c1"])
    # The user's own pod, and a pod of another namespace (nodeagent's) on the same node.
    running_pod(api, NS, "web-0", "edge-1", "10.1.0.5")
    api.replace_status(PODS, "nodeagent-agent-x1", "nodeagent", {
        "phase": "Running", "podIP": "10.1.0.9", "podIPs": [{"ip": "10.1.0.9"}]})

    # The namespace user: a Service whose EndpointSlice names its own pod, the other
    # namespace's pod, and the node's own address (its sshd, say) with no Pod at all; an
    # ExternalName Service; and an Ingress that "opts in" with the annotation.
    api.create(SERVICES, {"metadata": {"name": "web", "namespace": NS}, "spec": {
        "ports": [{"name": "http", "port": 80}]}})
    api.create(SERVICES, {"metadata": {"name": "ext", "namespace": NS}, "spec": {
        "type": "ExternalName", "externalName": "10.20.0.1", "ports": [{"port": 80}]}})
    api.create(ENDPOINTSLICES, {
        "metadata": {"name": "web-1", "namespace": NS,
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 22, "protocol": "TCP"}],
        "endpoints": [endpoint("10.1.0.5", (NS, "web-0")),
                      endpoint("10.1.0.9", ("nodeagent", "nodeagent-agent-x1")),
                      endpoint("192.168.7.10", None)]})
    rule = {"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {"service": {
        "name": "web", "port": {"name": "http"}}}}]}}
    ext = {"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {"service": {
        "name": "ext", "port": {"number": 80}}}}]}}
    api.create(INGRESSES, {"metadata": {"name": "shop", "namespace": NS, "annotations": {
        "nodeagent.io/allow-direct-backends": "true"}}, "spec": {
        "ingressClassName": "nodeagent",
        "rules": [dict(rule, host="shop.test"), dict(ext, host="ext.test")]}})

    # Only the user's own pod is published; the node's allow list holds only it.
    wait_for(lambda: reader.backends("shop.test") == {("edge-1", "10.1.0.5")},
             "the shop route with its own pod")
    assert reader.backends("ext.test") == set()
    edge = reader.edge()
    assert edge.allows("10.1.0.5", 22)
    assert not edge.allows("10.1.0.9", 22) and not edge.allows("192.168.7.10", 22)
    # The user is told why, on the Ingress, through the API.
    wait_for(lambda: {"DirectBackendsNotAllowed", "DirectBackendRefused",
                      "EndpointRefused"} <= set(events(api, "shop")), "Events on the Ingress")
    told = events(api, "shop")
    assert "directBackendNamespaces" in told["DirectBackendsNotAllowed"]
    assert "other_namespace" in told["EndpointRefused"] or "no_target_ref" in told[
        "EndpointRefused"]

    # The cluster admin lists the namespace: both keys turn, the direct backend and the
    # endpoints without a Pod of their own are believed (still only on their node).
    api.create(CLUSTER_TUNNELS, {"metadata": {"name": "edge"}, "spec": {
        "directBackendNamespaces": [NS]}})
    wait_for(lambda: reader.backends("ext.test") == {(None, "10.20.0.1")},
             "the admin's opt-in opens the direct backend")
    assert reader.backends("shop.test") == {("edge-1", "10.1.0.5"), ("edge-1", "10.1.0.9"),
                                            ("edge-1", "192.168.7.10")}
    assert reader.edge().allows("192.168.7.10", 22)

