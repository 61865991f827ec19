"""What a namespace user can make the servers dial, end to end with real processes (the fake
API server and two controller replicas): the direct-backends opt-in is the cluster
admin's (a ClusterTunnel's `directBackendNamespaces`), and an EndpointSlice is believed
only for a Pod of the Service's own namespace on the endpoint's node. What the servers and
the node would be told is read from the controllers' config stream with a server's and
the node's certificates; what the user is told, from the Events in the API."""

from __future__ import annotations

import functools
import json
import ssl
import uuid
from collections import Counter
from typing import Any

import h11
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
from nodeagent.trust import pki
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


async def post_csr(port: int, context: ssl.SSLContext, body: bytes, token: str
                   ) -> tuple[int, dict[str, str]]:
    """POST /v1/certificates over TLS (with the context's client certificate, if any):
    the status and the headers."""
    stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), context,
                            server_hostname="127.0.0.1", https_compatible=True)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        await stream.send_all(conn.send(h11.Request(
            method="POST", target="/v1/certificates", headers=[
                ("host", "127.0.0.1"), ("authorization", f"Bearer {token}"),
                ("content-type", "application/json"), ("content-length", str(len(body))),
                ("connection", "close")])) + (conn.send(h11.Data(data=body)) or b"")
            + (conn.send(h11.EndOfMessage()) or b""))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(bytes(await stream.receive_some(65536)))
            elif isinstance(event, h11.Response):
                return event.status_code, {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.ConnectionClosed):
                return 0, {}


def csr_body(kind: str) -> bytes:
    return json.dumps({"kind": kind, "csr": pki.key_signing_request(
        pki.generate_key(), kind).decode()}).encode()


def test_an_anonymous_flood_takes_no_renewal_and_delays_a_new_agent_only_as_retry_later(
        controllers: dict[str, Any]) -> None:  # noqa: F811 (the fixture)
    """~As many certificate requests with forged tokens as one client can send (each a
    fresh token, so each would cost a TokenReview) hold the anonymous budget at zero;
    meanwhile a node renewing with its still-valid certificate is signed at the first
    try (no TokenReview, no slot). A new agent's first request competes with the flood
    for that budget (its token is unknown until reviewed): it is refused at most as
    "retry later" (429, Retry-After), which the agent rides out, and signed once the
    flood ends. (Through the servers, the bootstrap caps bound such a flood: see
    test_enrollment_flood.py.)"""
    api = controllers["api"]
    port = controllers["ports"]["c1"]
    api.create(NODES, {"metadata": {"name": "edge-1"}})
    api.create(NODES, {"metadata": {"name": "edge-2"}})
    reader = Reader(api, port)  # edge-1's certificate, obtained before the flood
    ca_pem = api.get(CONFIGMAPS, "nodeagent-ca", "nodeagent")["data"]["ca.crt"]
    uid = pod(api, "nodeagent-agent-x2", "edge-2", "nodeagent-agent")
    add_token(api, "e2e-trust-agent2-token-0123456789", namespace="nodeagent",
              service_account="nodeagent-agent", pod_name="nodeagent-agent-x2", pod_uid=uid,
              node_name="edge-2", node_uid="n2", audiences=["nodeagent"])
    anonymous = pki.client_ssl_context(ca_pem.encode())
    flood_body = csr_body("node")
    counts: Counter[int] = Counter()
    figures: dict[str, float] = {}

    async def main() -> None:
        stop, spent = trio.Event(), trio.Event()

        async def flood(worker: int) -> None:
            sent = 0
            while not stop.is_set():
                sent += 1
                try:
                    status, _ = await post_csr(port, anonymous, flood_body,
                                               f"forged-{worker}-{sent}-{uuid.uuid4()}")
                except (OSError, trio.BrokenResourceError):
                    status = 0
                counts[status] += 1
                if counts[429] >= 20:  # the anonymous budget is spent
                    spent.set()

        async with trio.open_nursery() as nursery:
            for worker in range(16):
                nursery.start_soon(flood, worker)
            with trio.fail_after(10):
                await spent.wait()
            # A renewal by certificate: signed at once, whatever the flood.
            started = trio.current_time()
            status, _ = await post_csr(port, reader.node, csr_body("node"),
                                       AGENT)
            figures["renewal"] = trio.current_time() - started
            assert status == 200, status
            # A new agent's first request competes with the flood for the anonymous
            # budget (its token is not known yet): it may be refused, but only as
            # "retry later" (429 with Retry-After), never as a failure of its own.
            status, headers = await post_csr(
                port, anonymous, csr_body("node"), "e2e-trust-agent2-token-0123456789")
            assert status in (200, 429), status
            if status == 429:
                assert float(headers["retry-after"]) > 0
            stop.set()
        # The flood over, the same agent retrying as told is signed.
        started = trio.current_time()
        attempts = 1
        with trio.fail_after(60):  # a bound against a hang, not a timing
            while status != 200:
                await trio.sleep(float(headers.get("retry-after", "1")))
                attempts += 1
                status, headers = await post_csr(
                    port, anonymous, csr_body("node"), "e2e-trust-agent2-token-0123456789")
                assert status in (200, 429), status
        figures["enroll"] = trio.current_time() - started
        figures["attempts"] = attempts

    trio.run(main)
    print(f"\nflood: {dict(counts)}; renewal by certificate {figures['renewal']:.2f}s; "
          f"new agent enrolled {figures['enroll']:.2f}s after the flood "
          f"({figures['attempts']:.0f} attempts)")
    assert counts[401] > 0 and counts[429] > 0
