"""Controller mode end to end, with real processes: the fake API server, two controllers
(leader-elected), a server and an agent started only with flags, and an HTTP service as the
"pod". Kubernetes objects go in through the API; HTTP comes out of the server's Ingress
listener, through the agent's tunnel.

The controllers' config stream is TLS and authorizes by client certificate: the test gets
node and server certificates from them with projected ServiceAccount tokens (the fake's
TokenReview) through the production client, as agents and servers do."""

from __future__ import annotations

import functools
import json
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio

from nodeagent.controller.bootstrap import certificate_names, secret_value
from nodeagent.controller.clustertunnel import CLUSTER_TUNNELS
from nodeagent.kube.resources import (
    CONFIGMAPS,
    ENDPOINTSLICES,
    EVENTS,
    INGRESSCLASSES,
    INGRESSES,
    LEASES,
    NODES,
    PODS,
    SECRETS,
    SERVICES,
    Resource,
)
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Certs, Upstream, free_port
from nodeagent.trust import pki
from tests.controller.identity import obtain_identity

# The agent marks its tunnel socket (SO_MARK), which needs CAP_NET_ADMIN.
pytestmark = pytest.mark.needs("root")

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "e2e-admin-token"
AGENT_TOKEN = "e2e-agent-token-0123456789"
SERVER_TOKEN = "e2e-server-token-0123456789"
NS = "shop"


class Api:
    """Just enough of a Kubernetes client for the test to play the user."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"},
                                 timeout=5)

    def create(self, resource: Resource, obj: dict[str, Any]) -> dict[str, Any]:
        ns = obj["metadata"].get("namespace")
        obj = {"apiVersion": resource.api_version, "kind": resource.kind, **obj}
        response = self.http.post(resource.path(ns), json=obj)
        assert response.status_code == 201, response.text
        return dict(response.json())

    def get(self, resource: Resource, name: str, ns: str | None = None) -> dict[str, Any]:
        response = self.http.get(resource.path(ns, name))
        response.raise_for_status()
        return dict(response.json())

    def replace(self, resource: Resource, obj: dict[str, Any]) -> None:
        ns, name = obj["metadata"].get("namespace"), obj["metadata"]["name"]
        current = self.get(resource, name, ns)
        obj = {"apiVersion": resource.api_version, "kind": resource.kind, **obj}
        obj["metadata"] = {**obj["metadata"],
                           "resourceVersion": current["metadata"]["resourceVersion"]}
        response = self.http.put(resource.path(ns, name), json=obj)
        assert response.status_code == 200, response.text

    def replace_status(self, resource: Resource, name: str, ns: str | None,
                       status: dict[str, Any]) -> None:
        current = self.get(resource, name, ns)
        response = self.http.put(resource.path(ns, name, "status"),
                                 json=dict(current, status=status))
        assert response.status_code == 200, response.text

    def delete(self, resource: Resource, name: str, ns: str | None = None) -> None:
        self.http.delete(resource.path(ns, name)).raise_for_status()

    def list(self, resource: Resource, ns: str | None = None) -> list[dict[str, Any]]:
        response = self.http.get(resource.path(ns))
        response.raise_for_status()
        return list(response.json()["items"])


def get(port: int, host: str, path: str) -> httpx.Response:
    with httpx.Client(timeout=5) as client:
        return client.get(f"http://127.0.0.1:{port}{path}", headers={"host": host})


def wait_for(check: Any, what: str, timeout: float = 10.0) -> float:
    """Poll until `check()` is truthy; returns the seconds it took."""
    start = time.monotonic()
    last: Any = None
    while time.monotonic() - start < timeout:
        try:
            last = check()
            if last:
                return time.monotonic() - start
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")


def ingress(name: str, host: str, path: str, service: str = "web") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS}, "spec": {
        "ingressClassName": "nodeagent", "rules": [{"host": host, "http": {"paths": [
            {"path": path, "pathType": "Prefix", "backend": {"service": {
                "name": service, "port": {"name": "http"}}}}]}}]}}


def endpoint_slice(port: int, endpoints: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"name": "web-1", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": port,
                                              "protocol": "TCP"}],
            "endpoints": endpoints}


def web_endpoint(api: Api, name: str = "web-0", address: str = "127.0.0.1",
                 node: str = "edge-1") -> dict[str, Any]:
    """A ready endpoint of Pod `name` (created in the shop namespace on `node`, holding
    `address`, unless it exists): the controller believes an endpoint only for the Pod
    its targetRef names."""
    if not any(p["metadata"]["name"] == name for p in api.list(PODS, NS)):
        api.create(PODS, {"metadata": {"name": name, "namespace": NS}, "spec": {
            "nodeName": node, "containers": [{"name": "web", "image": "web"}]}})
        api.replace_status(PODS, name, NS, {"phase": "Running", "podIP": address,
                                            "podIPs": [{"ip": address}]})
    return {"addresses": [address], "nodeName": node, "conditions": {"ready": True},
            "targetRef": {"kind": "Pod", "namespace": NS, "name": name}}


def add_token(api: Api, token: str, **claims: Any) -> None:
    """A projected ServiceAccount token the fake's TokenReview knows (control endpoint)."""
    response = api.http.post("/_fake/tokens", json={"token": token, **claims})
    assert response.status_code == 200, response.text


@pytest.fixture
def controllers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The fake API server and two controller replicas (c1 leads), their config streams on
    TLS with 127.0.0.1 in their certificates."""
    kubeconfig = tmp_path / "kubeconfig"
    marker = request.node.get_closest_marker("controller_args")
    extra_args: tuple[str, ...] = tuple(marker.args) if marker else ()
    fake = subprocess.Popen(
        [sys.executable, "-m", "nodeagent.testing.fakekube", "--port", "0", "--token", ADMIN,
         "--kubeconfig", str(kubeconfig), "--bookmark-interval", "0.5",
         "--namespace", "nodeagent", "--namespace", NS],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    procs: list[NodeagentProcess] = []
    api: Api | None = None
    try:
        assert fake.stdout is not None
        ready = json.loads(fake.stdout.readline())
        api = Api(ready["url"])
        api.create(INGRESSCLASSES, {"metadata": {"name": "nodeagent"},
                                    "spec": {"controller": "nodeagent.io/ingress-controller"}})
        ports = {name: free_port() for name in ("c1", "c2")}
        for name in ("c1", "c2"):
            proc = NodeagentProcess("controller", {"debug_socket": ""}, tmp_path, name, args=[
                "--kubeconfig", str(kubeconfig), "--namespace", "nodeagent",
                "--listen", f"127.0.0.1:{ports[name]}", "--identity", name,
                "--lease-seconds", "3", "--tls-name", "127.0.0.1", *extra_args]).start()
            procs.append(proc)
            proc.wait_for_log("controller ready", timeout=20)
            if name == "c1":
                proc.wait_for_log("leading", timeout=10)
        yield {"api": api, "procs": procs, "ports": ports, "fake": fake}
    finally:
        for proc in procs:
            proc.kill()
        if api is not None:
            api.http.close()
        fake.kill()
        fake.wait()
        if fake.stdout is not None:
            fake.stdout.close()
    for proc in procs:
        assert "Traceback" not in proc.logs(), proc.logs()


def seed_identities(api: Api, tmp_path: Path, certs: Certs) -> None:
    """What a cluster gives edge-1's agent and server pod s1 before they start: the CA
    bundles they verify with (cluster-ca.crt; agent-ca.crt, which adds the test CA of the
    tunnel's certificate), Node edge-1, and each pod's projected token (agent-token,
    server-token)."""
    wait_for(lambda: "ca.crt" in (api.get(CONFIGMAPS, "nodeagent-ca", "nodeagent").get(
        "data") or {}), "the leader published the CA")
    cluster_ca = api.get(CONFIGMAPS, "nodeagent-ca", "nodeagent")["data"]["ca.crt"]
    (tmp_path / "cluster-ca.crt").write_text(cluster_ca)
    # The agent verifies the tunnel server's certificate (the test CA's, for 127.0.0.1)
    # and the controller's (the cluster CA's): a bundle of both, as --ca-file.
    (tmp_path / "agent-ca.crt").write_text(cluster_ca + certs.ca.read_text())
    # Servers admit agents only of known Nodes: edge-1 exists before its agent dials.
    api.create(NODES, {"metadata": {"name": "edge-1"}})
    uid = pod(api, "nodeagent-agent-x1", "edge-1", "nodeagent-agent")
    add_token(api, AGENT_TOKEN, namespace="nodeagent", service_account="nodeagent-agent",
              pod_name="nodeagent-agent-x1", pod_uid=uid, node_name="edge-1", node_uid="n1",
              audiences=["nodeagent"])
    (tmp_path / "agent-token").write_text(AGENT_TOKEN)
    uid = pod(api, "s1", "cloud-1", "nodeagent-server")
    add_token(api, SERVER_TOKEN, namespace="nodeagent", service_account="nodeagent-server",
              pod_name="s1", pod_uid=uid, audiences=["nodeagent"])
    (tmp_path / "server-token").write_text(SERVER_TOKEN)


def start_cluster_server(tmp_path: Path, controller_url: str, tunnel_port: int,
                         cert: Path, key: Path, *extra: str) -> NodeagentProcess:
    """Server pod s1 as seed_identities prepared it: its token and the cluster CA, its
    tunnel listener on 127.0.0.1 with the given certificate, its debug socket s.sock;
    `extra` adds flags (listeners, workers, ...). Started and ready."""
    server = NodeagentProcess("server", {"debug_socket": str(tmp_path / "s.sock")},
                              tmp_path, "server", args=[
        "--controller", controller_url, "--token-file", str(tmp_path / "server-token"),
        "--ca-file", str(tmp_path / "cluster-ca.crt"),
        "--tunnel-listen", f"tls://127.0.0.1:{tunnel_port}",
        "--tls-cert", str(cert), "--tls-key", str(key), "--server-id", "s1",
        "--debug-socket", str(tmp_path / "s.sock"), *extra]).start()
    return server


def start_cluster_agent(tmp_path: Path, controller_url: str, tunnel_port: int,
                        node: str = "edge-1", token: str = "agent-token",
                        name: str = "agent", sock: str = "a.sock") -> NodeagentProcess:
    """The agent of `node` with its projected token (a file in tmp_path) and the CA bundle
    seed_identities wrote, dialing the tunnel on 127.0.0.1; `name` names its log, `sock`
    its debug socket. Started, not yet waited for."""
    return NodeagentProcess("agent", {"debug_socket": str(tmp_path / sock)},
                            tmp_path, name, args=[
        "--node", node, "--server", f"tls://127.0.0.1:{tunnel_port}",
        "--token-file", str(tmp_path / token), "--ca-file", str(tmp_path / "agent-ca.crt"),
        "--controller", controller_url, "--debug-socket", str(tmp_path / sock)]).start()


def serve_shop_on_edge(api: Api, upstream: Upstream) -> None:
    """Ingress shop.test/ → Service web → the upstream's HTTP port on edge-1 (127.0.0.1)."""
    api.replace(NODES, {"metadata": {"name": "edge-1"}, "spec": {
        "podCIDRs": ["10.1.0.0/24"]}})
    api.replace_status(NODES, "edge-1", None, {"addresses": [
        {"type": "InternalIP", "address": "127.0.0.1"}]})
    api.create(SERVICES, {"metadata": {"name": "web", "namespace": NS}, "spec": {
        "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
    ready = web_endpoint(api)
    api.create(ENDPOINTSLICES, endpoint_slice(upstream.http_port, [ready]))
    api.create(INGRESSES, ingress("shop", "shop.test", "/"))


def serve_a_test(api: Api, upstream: Upstream) -> None:
    """Ingress a.test/ → Service web → the upstream's HTTP port on edge-1 (127.0.0.1,
    its InternalIP), the endpoint naming its Pod."""
    api.replace_status(NODES, "edge-1", None, {"addresses": [
        {"type": "InternalIP", "address": "127.0.0.1"}]})
    api.create(SERVICES, {"metadata": {"name": "web", "namespace": NS}, "spec": {
        "ports": [{"name": "http", "port": 80}]}})
    api.create(ENDPOINTSLICES, endpoint_slice(upstream.http_port, [web_endpoint(api)]))
    api.create(INGRESSES, ingress("a", "a.test", "/"))


@pytest.fixture
def cluster(controllers: dict[str, Any], tmp_path: Path, certs: Certs,
            upstream: Upstream) -> Iterator[dict[str, Any]]:
    """A server replica and an agent on edge-1, started only with flags and projected
    ServiceAccount tokens: each gets its certificate from the controller (the agent
    through a bootstrap tunnel connection), then watches its config over TLS."""
    api, procs = controllers["api"], controllers["procs"]
    ports = {name: free_port() for name in ("tunnel", "http")}
    seed_identities(api, tmp_path, certs)
    # Its own copy of the tunnel certificate: a test may rotate it (the server reloads it).
    (tmp_path / "tunnel.crt").write_bytes(certs.server_cert.read_bytes())
    (tmp_path / "tunnel.key").write_bytes(certs.server_key.read_bytes())
    # Server and agent watch the standby (c2): when the leader dies, they keep going.
    controller_url = f"https://127.0.0.1:{controllers['ports']['c2']}"
    server = start_cluster_server(
        tmp_path, controller_url, ports["tunnel"], tmp_path / "tunnel.crt",
        tmp_path / "tunnel.key", "--ingress-http", f"127.0.0.1:{ports['http']}",
        "--connect-uds", str(tmp_path / "connect.sock"),
        "--state-dir", str(tmp_path / "server-state"))
    procs.append(server)
    server.wait_ready()
    agent = start_cluster_agent(tmp_path, controller_url, ports["tunnel"])
    procs.append(agent)
    agent.wait_ready(timeout=30)
    server.wait_for(lambda s: s["agents"], what="agent connected")
    # The agent's first certificate came through a bootstrap connection, which the
    # server registered as no node; both now hold certificates from the controller.
    status = server.status()
    assert status["bootstrap"]["served"] >= 1
    assert status["identity"]["not_after"] and agent.status()["identity"]["not_after"]
    assert [a["node"] for a in status["agents"]] == ["edge-1"]
    yield {"api": api, "http": ports["http"], "procs": procs, "server": server,
           "fake": controllers["fake"],
           "agent": agent, "upstream": upstream, "connect": tmp_path / "connect.sock"}


def pod(api: Api, name: str, node: str, account: str) -> str:
    created = api.create(PODS, {"metadata": {"name": name, "namespace": "nodeagent"}, "spec": {
        "serviceAccountName": account, "nodeName": node,
        "containers": [{"name": "c", "image": "nodeagent"}]}})
    return str(created["metadata"]["uid"])


def read_config(port: int, path: str, context: ssl.SSLContext) -> tuple[int, bytes]:
    """GET a config path over TLS: the status and the first chunk (a watch never ends)."""
    async def go() -> tuple[int, bytes]:
        stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), context,
                                server_hostname="127.0.0.1")
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            await stream.send_all(conn.send(h11.Request(method="GET", target=path, headers=[
                ("host", "127.0.0.1")])) + conn.send(h11.EndOfMessage()))
            status = 0
            with trio.fail_after(5):
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(bytes(await stream.receive_some(65536)))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, h11.Data):
                        return status, bytes(event.data)
                    elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                        return status, b""
    return trio.run(go)


def test_agents_and_servers_get_certificates_and_read_only_their_config(
        controllers: dict[str, Any]) -> None:
    api, ports = controllers["api"], controllers["ports"]
    wait_for(lambda: "ca.crt" in (api.get(CONFIGMAPS, "nodeagent-ca", "nodeagent").get(
        "data") or {}), "the leader published the CA")
    ca_pem = api.get(CONFIGMAPS, "nodeagent-ca", "nodeagent")["data"]["ca.crt"]
    api.create(NODES, {"metadata": {"name": "edge-1"}, "spec": {"podCIDRs": ["10.1.0.0/24"]},
                       "status": {"addresses": [{"type": "InternalIP",
                                                 "address": "192.168.7.10"}]}})
    uid = pod(api, "nodeagent-agent-x1", "edge-1", "nodeagent-agent")
    add_token(api, "e2e-projected-agent-0123456789", namespace="nodeagent",
              service_account="nodeagent-agent", pod_name="nodeagent-agent-x1", pod_uid=uid,
              node_name="edge-1", node_uid="n1", audiences=["nodeagent"])
    uid = pod(api, "nodeagent-server-s1", "cloud-1", "nodeagent-server")
    add_token(api, "e2e-projected-server-0123456789", namespace="nodeagent",
              service_account="nodeagent-server", pod_name="nodeagent-server-s1", pod_uid=uid,
              audiences=["nodeagent"])
    # The standby (c2) signs too: it reads the CA from its cache, like the leader.
    url = f"https://127.0.0.1:{ports['c2']}"
    node = trio.run(functools.partial(obtain_identity, url, ca_pem,
                                      "e2e-projected-agent-0123456789", "node"))
    server = trio.run(functools.partial(obtain_identity, url, ca_pem,
                                        "e2e-projected-server-0123456789", "server"))
    node_tls, server_tls = node.client_context(), server.client_context()
    for port in ports.values():  # both replicas, same CA, same rules
        status, body = read_config(port, "/v1/config/nodes/edge-1", node_tls)
        assert status == 200 and b'"version"' in body, body
        assert read_config(port, "/v1/config/nodes/edge-2", node_tls)[0] == 403
        assert read_config(port, "/v1/config/servers/s1", node_tls)[0] == 403
        assert read_config(port, "/v1/config/servers/s1", server_tls)[0] == 200
        assert read_config(port, "/v1/config/nodes/edge-1",
                           pki.client_ssl_context(ca_pem.encode()))[0] == 403
    # No shared token is bootstrapped any more.
    assert "nodeagent-agent-token" not in {
        s["metadata"]["name"] for s in api.list(SECRETS, "nodeagent")}


def test_ingress_reaches_the_edge_pod_and_follows_every_change(
        cluster: dict[str, Any]) -> None:
    api, port, upstream = cluster["api"], cluster["http"], cluster["upstream"]
    # The leader bootstrapped the PKI the manifests mount: a CA, its certificate for
    # agents, and the servers' tunnel certificate for the in-cluster Service names.
    wait_for(lambda: {s["metadata"]["name"] for s in api.list(SECRETS, "nodeagent")} >= {
        "nodeagent-ca", "nodeagent-server-tls"}, "CA and server certificate Secrets")
    ca_pem = api.get(CONFIGMAPS, "nodeagent-ca", "nodeagent")["data"]["ca.crt"]
    assert "BEGIN CERTIFICATE" in ca_pem
    # The "pod" is the test's upstream on 127.0.0.1: an address of the node (an endpoint
    # only reaches a node's allow list with an address of that node's).
    api.replace(NODES, {"metadata": {"name": "edge-1"}, "spec": {
        "podCIDRs": ["10.1.0.0/24"]}})
    api.replace_status(NODES, "edge-1", None, {"addresses": [
        {"type": "InternalIP", "address": "127.0.0.1"},
        {"type": "ExternalIP", "address": "192.168.7.10"}]})
    api.create(SERVICES, {"metadata": {"name": "web", "namespace": NS}, "spec": {
        "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
    ready = web_endpoint(api)
    api.create(ENDPOINTSLICES, endpoint_slice(upstream.http_port, [ready]))
    api.create(INGRESSES, ingress("shop", "shop.test", "/"))
    took = wait_for(lambda: get(port, "shop.test", "/cart").status_code == 200,
                    "Ingress routed through the agent")
    print(f"Ingress created → served through the tunnel in {took:.2f}s")
    assert "path=/cart host=shop.test" in get(port, "shop.test", "/cart").text
    status = cluster["agent"].status()
    assert status["config_watch"]["config_version"] >= 1

    # The servers' public address (their LoadBalancer Service) goes into Ingress status.
    api.create(SERVICES, {"metadata": {"name": "nodeagent-server", "namespace": "nodeagent"},
                          "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}})
    api.replace_status(SERVICES, "nodeagent-server", "nodeagent",
                       {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}})
    wait_for(lambda: api.get(INGRESSES, "shop", NS).get("status", {}).get("loadBalancer", {})
             .get("ingress") == [{"ip": "203.0.113.7"}], "Ingress status shows the address")

    # Change the path: /api only.
    api.replace(INGRESSES, ingress("shop", "shop.test", "/api"))
    wait_for(lambda: get(port, "shop.test", "/cart").status_code == 404, "old path gone")
    assert get(port, "shop.test", "/api/x").status_code == 200

    # Endpoints scaled to zero: 503 with a readable body.
    api.replace(ENDPOINTSLICES, endpoint_slice(upstream.http_port, []))
    wait_for(lambda: get(port, "shop.test", "/api/x").status_code == 503, "no endpoints")
    assert "no ready backends" in get(port, "shop.test", "/api/x").text
    api.replace(ENDPOINTSLICES, endpoint_slice(upstream.http_port, [ready]))
    wait_for(lambda: get(port, "shop.test", "/api/x").status_code == 200, "endpoints back")

    # A bad Ingress: an Event on it and a log line; the good one keeps working.
    api.create(INGRESSES, ingress("broken", "broken.test", "/", service="ghost"))
    wait_for(lambda: any(e.get("reason") == "ServiceNotFound"
                         for e in api.list(EVENTS, NS)), "Event for the bad Ingress")
    assert get(port, "shop.test", "/api/x").status_code == 200
    # A TLS Secret that does not exist and a path the API accepts but HTTP cannot match
    # (a space): Events too, and the rest of the same Ingress is still served (over plain
    # HTTP for the TLS host).
    odd = ingress("odd", "odd.test", "/")
    odd["spec"]["tls"] = [{"hosts": ["odd.test"], "secretName": "missing-tls"}]
    odd["spec"]["rules"][0]["http"]["paths"].append(
        {"path": "/has space", "pathType": "ImplementationSpecific",
         "backend": {"service": {"name": "web", "port": {"name": "http"}}}})
    api.create(INGRESSES, odd)
    wait_for(lambda: {"TLSSecretMissing", "InvalidRule"} <= {
        e.get("reason") for e in api.list(EVENTS, NS)}, "Events for TLS and path problems")
    assert get(port, "odd.test", "/").status_code == 200
    assert get(port, "shop.test", "/api/x").status_code == 200

    # The Ingress removed: 404.
    api.delete(INGRESSES, "shop", NS)
    wait_for(lambda: get(port, "shop.test", "/api/x").status_code == 404, "Ingress removed")

    # The Node deleted: its endpoints are no node's any more (no backends: 503) and its
    # agent's config loses the targets.
    api.create(INGRESSES, ingress("shop2", "shop2.test", "/"))
    wait_for(lambda: get(port, "shop2.test", "/").status_code == 200, "second Ingress")
    api.delete(NODES, "edge-1")
    wait_for(lambda: get(port, "shop2.test", "/").status_code == 503,
             "node deleted: its endpoints are no backends")
    # Revocation: the server closes the deleted Node's tunnel and refuses it back.
    server = cluster["server"]
    failures = server.status()["handshake_failures"]
    took = wait_for(lambda: not server.status()["agents"], "deleted Node's tunnel closed")
    print(f"Node deleted → its tunnel closed within {took:.2f}s")
    wait_for(lambda: server.status()["handshake_failures"] > failures,
             "the agent's re-registration refused", timeout=20)
    assert not server.status()["agents"]
    assert "node_not_admitted" in server.logs()


def test_standby_takes_over_and_agents_keep_their_config(cluster: dict[str, Any]) -> None:
    api, port, upstream = cluster["api"], cluster["http"], cluster["upstream"]
    c1 = cluster["procs"][0]
    serve_a_test(api, upstream)
    wait_for(lambda: get(port, "a.test", "/").status_code == 200, "first route")
    c1.kill()
    wait_for(lambda: api.get(LEASES, "nodeagent-controller", "nodeagent")["spec"]
             ["holderIdentity"] == "c2", "standby holds the Lease", timeout=15)
    assert get(port, "a.test", "/").status_code == 200  # config kept throughout
    api.create(INGRESSES, ingress("b", "b.test", "/"))
    wait_for(lambda: get(port, "b.test", "/").status_code == 200, "updates after failover")
    # ClusterTunnels: the leader adds its finalizer and keeps the status current; deleting
    # one waits for the finalizer, which goes once its rules are out of the node configs.
    api.create(CLUSTER_TUNNELS, {"metadata": {"name": "edge"}, "spec": {
        "allowedNodePorts": [10250], "serverUrl": "wss://tunnel.example.net:8443/tunnel"}})
    # The agent watches c2; c2 is the leader now and also reads the other replicas' reports.
    wait_for(lambda: (api.get(CLUSTER_TUNNELS, "edge").get("status") or {}).get(
        "nodesConnected") == 1, "ClusterTunnel status", timeout=15)
    tunnel = api.get(CLUSTER_TUNNELS, "edge")
    assert tunnel["metadata"]["finalizers"] == ["nodeagent.io/cleanup"]
    assert tunnel["status"]["conditions"][0]["status"] == "True"
    assert tunnel["status"]["nodesCovered"] == 1
    # The servers' certificate is re-issued to carry the tunnel's public name.
    wait_for(lambda: "tunnel.example.net" in certificate_names(secret_value(
        api.get(SECRETS, "nodeagent-server-tls", "nodeagent"), "tls.crt")),
        "server certificate names the public host")
    api.delete(CLUSTER_TUNNELS, "edge")
    wait_for(lambda: not any(t["metadata"]["name"] == "edge"
                             for t in api.list(CLUSTER_TUNNELS)), "finalizer released")
    # The new leader reports problems of ClusterTunnels: an Event on the object, in the API
    # (cluster-scoped objects' Events live in "default"), not only a log line.
    api.create(CLUSTER_TUNNELS, {"metadata": {"name": "t"}, "spec": {"serverUrl": "http://x"}})

    def tunnel_event() -> dict[str, Any] | None:
        return next((e for e in api.list(EVENTS, "default") if e.get("reason") == "InvalidSpec"
                     and e["involvedObject"].get("kind") == "ClusterTunnel"
                     and e["involvedObject"].get("name") == "t"), None)

    wait_for(tunnel_event, "an Event on the invalid ClusterTunnel")
    event = tunnel_event()
    assert event is not None and event["type"] == "Warning"
    assert "serverUrl" in event["message"] or "server_url" in event["message"], event
    assert event["involvedObject"]["uid"] == api.get(CLUSTER_TUNNELS, "t")["metadata"]["uid"]


def test_static_stability_the_controller_gone_a_server_restarted_and_catching_up(
        cluster: dict[str, Any], tmp_path: Path) -> None:
    """Both controllers and the API server gone (the API server frozen with SIGSTOP: it
    neither answers nor closes, as behind a partition): traffic keeps flowing; a server
    restarted meanwhile serves the routes it persisted (mode 0600) at once; a change made
    once the API is back, while no controller runs, applies when a controller returns,
    although the new process numbers its versions from 1 again."""
    api, port, upstream = cluster["api"], cluster["http"], cluster["upstream"]
    procs, server, agent = cluster["procs"], cluster["server"], cluster["agent"]
    serve_a_test(api, upstream)
    wait_for(lambda: get(port, "a.test", "/").status_code == 200, "first route")
    state = tmp_path / "server-state" / "routes.json"
    wait_for(state.exists, "routes persisted")
    assert state.stat().st_mode & 0o777 == 0o600
    assert state.parent.stat().st_mode & 0o777 == 0o700
    c1, c2 = procs[0], procs[1]
    c1.kill()
    c2.kill()
    fake: subprocess.Popen[bytes] = cluster["fake"]
    fake.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 3
    served = 0
    while time.monotonic() < deadline:  # the controller gone: traffic keeps flowing
        assert get(port, "a.test", "/").status_code == 200
        served += 1
    assert server.status()["config_watch"]["state"] != "watching"

    server.kill()  # restarted while the controller is away
    back = NodeagentProcess("server", server.config, tmp_path, "server-back",
                            args=server.args).start()
    procs.append(back)
    back.wait_ready()
    back.wait_for(lambda s: s["agents"], what="agent back on the restarted server",
                  timeout=15)
    took = wait_for(lambda: get(port, "a.test", "/").status_code == 200,
                    "persisted routes served")
    assert "serving the routes persisted before the restart" in back.logs()
    print(f"\n{served} requests served with the controller gone; restarted server "
          f"serving its persisted routes {took:.2f}s after the agent was back")

    fake.send_signal(signal.SIGCONT)  # the API back; the controllers still gone
    api.create(INGRESSES, ingress("b", "b.test", "/"))  # while no controller runs
    time.sleep(1)
    assert get(port, "b.test", "/").status_code == 404
    again = NodeagentProcess("controller", {"debug_socket": ""}, tmp_path, "c2-back",
                             args=c2.args).start()
    procs.append(again)
    again.wait_for_log("controller ready", timeout=20)
    took = wait_for(lambda: get(port, "b.test", "/").status_code == 200,
                    "the change made meanwhile applied", timeout=30)
    print(f"change made while the controller was gone applied {took:.2f}s after it was "
          f"ready again")
    assert get(port, "a.test", "/").status_code == 200
    agent.wait_for(lambda st: st["config_watch"]["state"] == "watching",
                   what="the agent's watch back", timeout=15)
    for proc in (back, agent):
        assert "PRIVATE KEY" not in proc.logs()


def test_an_agent_whose_certificate_requests_fail_keeps_trying_and_enrolls(
        cluster: dict[str, Any], tmp_path: Path) -> None:
    """A restarted agent asks for its certificate through a bootstrap connection while
    the API server fails the controller's TokenReviews: each attempt is refused (503,
    inside the bootstrap connection's nursery), and the agent neither exits nor logs a
    traceback; it retries with backoff and enrolls once the reviews succeed."""
    api, procs, server, agent = cluster["api"], cluster["procs"], cluster["server"], \
        cluster["agent"]
    assert agent.stop() == 0
    response = api.http.post("/_fake/fail", json={
        "count": 3, "status": 500, "method": "POST",
        "path": "/apis/authentication.k8s.io/v1/tokenreviews"})
    response.raise_for_status()
    again = NodeagentProcess("agent", agent.config, tmp_path, "agent-again",
                             args=agent.args).start()
    procs.append(again)
    again.wait_for_log("certificate request failed; retrying", timeout=20)
    took = wait_for(lambda: again.logs().count("certificate issued") >= 1,
                    "the agent enrolled after the failures", timeout=30)
    assert again.logs().count("certificate request failed; retrying") >= 3, again.logs()
    assert again.proc is not None and again.proc.poll() is None, again.logs()
    assert "Traceback" not in again.logs(), again.logs()
    server.wait_for(lambda s: [a["node"] for a in s["agents"]] == ["edge-1"],
                    what="the agent connected", timeout=15)
    print(f"\nenrolled {took:.2f} s after the first refusal")


# How long both controllers stay away. The issue's figure is 30 s (`-m slow` runs that);
# the default run keeps it shorter but long enough for a doubling backoff to reach
# seconds between attempts, which is what this test guards against.
OUTAGE_SECONDS = [12.0, pytest.param(30.0, marks=pytest.mark.slow)]


@pytest.mark.parametrize("outage", OUTAGE_SECONDS)
def test_a_change_reaches_the_server_and_the_agent_within_2s_of_the_controllers_return(
        cluster: dict[str, Any], tmp_path: Path, outage: float) -> None:
    """Both controllers gone for `outage` seconds, a change made meanwhile (an Ingress for
    the server, a ClusterTunnel port for the agent): from the moment a controller is
    ready again, both watches reconnect and apply it within about a second (printed),
    because neither waits more than a second between attempts while it cannot reach
    the controller."""
    api, port, upstream = cluster["api"], cluster["http"], cluster["upstream"]
    procs, agent = cluster["procs"], cluster["agent"]
    serve_a_test(api, upstream)
    wait_for(lambda: get(port, "a.test", "/").status_code == 200, "first route")
    c1, c2 = procs[0], procs[1]
    c1.kill()
    c2.kill()
    time.sleep(outage)
    api.create(INGRESSES, ingress("b", "b.test", "/"))
    api.create(CLUSTER_TUNNELS, {"metadata": {"name": "edge"}, "spec": {
        "allowedNodePorts": [10250]}})
    applied = agent.logs().count("config applied")
    again = NodeagentProcess("controller", {"debug_socket": ""}, tmp_path, "c2-back",
                             args=c2.args).start()
    procs.append(again)
    again.wait_for_log("controller ready", timeout=20)
    server_took = wait_for(lambda: get(port, "b.test", "/").status_code == 200,
                           "the server applied the change", timeout=15)
    agent_took = server_took + wait_for(lambda: agent.logs().count("config applied") > applied,
                                        "the agent applied the change", timeout=15)
    print(f"\nafter a {outage:g} s outage: the server applied the change {server_took:.2f} s "
          f"and the agent {agent_took:.2f} s after a controller was ready")
    # What bounds those times, checked as behaviour rather than as a timing: while the
    # controller could not be reached, neither watch ever waited more than a second.
    for proc in (cluster["server"], agent):
        delays = [float(line.rsplit("delay=", 1)[1].rstrip("s"))
                  for line in proc.logs().splitlines()
                  if "config watch interrupted" in line and "cannot reach" in line]
        assert len(delays) >= outage / 2, (proc.name, delays)  # it kept trying
        assert max(delays) <= 1.0, (proc.name, delays)


def _connect(path: Path, target: str) -> tuple[socket.socket, int]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head and (byte := sock.recv(1)):
        head += byte
    return sock, int(head[9:12] or b"0")


def _connect_status(path: Path, target: str) -> int:
    sock, status = _connect(path, target)
    sock.close()
    return status


def test_the_connect_front_follows_nodes_and_cluster_tunnels(cluster: dict[str, Any]) -> None:
    """kube-apiserver's egress selector reaching a kubelet by node name: the controller puts
    the Node's addresses and the ClusterTunnel's allowedNodePorts into the servers' routes
    and the agent's control-plane rules; nothing is reachable before a tunnel covers it."""
    api, path, agent = cluster["api"], cluster["connect"], cluster["agent"]
    kubelet = cluster["upstream"].echo_port  # stands for the kubelet on the node's address
    api.replace_status(NODES, "edge-1", None, {"addresses": [
        {"type": "InternalIP", "address": "127.0.0.1"},
        {"type": "Hostname", "address": "edge-1.lan"}]})
    assert _connect_status(path, f"edge-1:{kubelet}") == 502  # no tunnel covers edge-1
    api.create(CLUSTER_TUNNELS, {"metadata": {"name": "edge"}, "spec": {
        "allowedNodePorts": [kubelet]}})
    wait_for(lambda: _connect_status(path, f"edge-1:{kubelet}") == 200, "CONNECT by name")
    sock, status = _connect(path, f"edge-1.lan:{kubelet}")  # by its Hostname address
    assert status == 200
    sock.sendall(b"x" * 100_000)
    agent.wait_for(lambda s: [c["target"] for c in s["control_plane_streams"]] == [
        f"tcp://127.0.0.1:{kubelet}"], what="the agent shows the control-plane stream")
    sock.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    assert got == b"x" * 100_000
    assert _connect_status(path, "edge-1:10250") == 403  # not in allowedNodePorts
    api.delete(CLUSTER_TUNNELS, "edge")
    wait_for(lambda: _connect_status(path, f"edge-1:{kubelet}") == 502,
             "the tunnel's nodes leave the CONNECT front")


@pytest.mark.controller_args("--certificate-hours", "0.006")  # 21.6 s: renewed at ~11 s
def test_certificates_renew_while_requests_run_without_a_failure(
        cluster: dict[str, Any]) -> None:
    """Node and server certificates renew at half-life while traffic flows through the
    agent's tunnel: renewal swaps the TLS contexts for the next connections and never
    breaks a running one, so not one request fails."""
    api, port, upstream = cluster["api"], cluster["http"], cluster["upstream"]
    serve_shop_on_edge(api, upstream)
    wait_for(lambda: get(port, "shop.test", "/").status_code == 200, "served")
    agent, server = cluster["agent"], cluster["server"]
    first = agent.status()["identity"]["not_after"]
    statuses: list[int] = []
    deadline = time.monotonic() + 40
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"host": "shop.test"},
                      timeout=10) as client:
        while time.monotonic() < deadline:
            statuses.append(client.get("/renewal").status_code)
            if (agent.status()["identity"]["renewals"] >= 1
                    and server.status()["identity"]["renewals"] >= 1
                    and len(statuses) > 50):
                break
    assert agent.status()["identity"]["renewals"] >= 1, agent.status()["identity"]
    assert agent.status()["identity"]["not_after"] != first
    assert server.status()["identity"]["renewals"] >= 1
    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    # The tunnel that carried them stayed up through the renewal.
    assert agent.status()["tunnel"]["connects"] == 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_every_role_in_controller_mode_exits_0_on_a_signal_without_a_traceback(
        cluster: dict[str, Any], signum: int) -> None:
    """A rollout stops each process with SIGTERM (a terminal with SIGINT): the agent
    (idle, its config watch open), then the server, then the standby controller and the
    leader all exit 0 and log no traceback."""
    for proc in reversed(cluster["procs"]):
        assert proc.proc is not None
        proc.signal(signum)
        rc = proc.proc.wait(timeout=30)
        assert rc == 0, f"{proc.name} exited {rc}:\n{proc.logs()}"
        assert "Traceback" not in proc.logs(), proc.logs()
        if proc.role == "agent":  # idle: its own config watch is no traffic to wait for
            assert "drained: nothing left in flight" in proc.logs(), proc.logs()


def test_a_grpc_service_behind_an_ingress(cluster: dict[str, Any]) -> None:
    """A Service port with `appProtocol: grpc` behind an Ingress: the controller carries
    the backend protocol into the server's routes, and a stock grpcio client reaches the
    service through the Ingress listener (h2c to the front, one shared h2c connection
    to the pod through the tunnel), every kind of call and the statuses intact."""
    import grpc

    from nodeagent.testing.grpcservice import GrpcEcho, channel, method

    api, port = cluster["api"], cluster["http"]
    echo = GrpcEcho("pod").start()
    ch = channel(f"127.0.0.1:{port}", "g.test")
    try:
        api.replace_status(NODES, "edge-1", None, {"addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"}]})
        api.create(SERVICES, {"metadata": {"name": "greeter", "namespace": NS}, "spec": {
            "ports": [{"name": "grpc", "port": 50051, "appProtocol": "grpc"}]}})
        es = endpoint_slice(echo.port, [web_endpoint(api)])
        es["metadata"] = {"name": "greeter-1", "namespace": NS,
                          "labels": {"kubernetes.io/service-name": "greeter"}}
        es["ports"][0]["name"] = "grpc"
        api.create(ENDPOINTSLICES, es)
        ing = ingress("g", "g.test", "/", service="greeter")
        ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"] = {
            "name": "grpc"}
        api.create(INGRESSES, ing)
        unary = method(ch, "Unary")

        def served() -> bool:
            try:
                return bool(unary(b"hi", timeout=5) == b"pod:hi")
            except grpc.RpcError:
                return False

        wait_for(served, "the gRPC route", timeout=20)
        assert list(method(ch, "ServerStream", "unary_stream")(b"3", timeout=10)) == [
            b"pod:0", b"pod:1", b"pod:2"]
        assert list(method(ch, "Bidi", "stream_stream")(iter([b"a", b"b"]), timeout=10)) == [
            b"a", b"b"]
        with pytest.raises(grpc.RpcError) as info:
            method(ch, "Fail")(b"k", timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        routes = cluster["server"].status()
        assert routes["http"]["ingress-http"]["grpc_requests"] >= 4
    finally:
        ch.close()
        echo.stop()
