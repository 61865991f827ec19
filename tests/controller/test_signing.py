"""POST /v1/certificates against the fake API server's TokenReview, over real TLS sockets:
who gets which certificate, who is refused with which status and reason, and what the
certificates then let a client read from the config stream."""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import h11
import pytest
import trio
from cryptography import x509

from nodeagent.config import AllowRule, NodeConfig, RoutesConfig
from nodeagent.controller.compute import ConfigVersions
from nodeagent.controller.configserver import ConfigStreamServer
from nodeagent.controller.metrics import ControllerMetrics
from nodeagent.controller.servingtls import ServingTLS, service_names
from nodeagent.controller.signing import CertificateSigner, SigningPolicy
from nodeagent.kube import KubeClient
from nodeagent.testing.fakekube.fixtures import credentials_for, start_fake_kube
from nodeagent.testing.fakekube.server import FakeKube
from nodeagent.testing.fakekube.store import DEFAULT_NAMESPACES
from nodeagent.trust import pki
from nodeagent.trust.enrollment import CertificateRefused, IssuedIdentity
from nodeagent.trust.enrollment import request_certificate as request_identity
from tests.controller.identity import (
    NS,
    add_agent_token,
    add_pod,
    add_server_token,
    obtain_identity,
    request_certificate,
)
from tests.controller.test_configserver import get


@dataclass
class Rig:
    fake: FakeKube
    ca: pki.CertificateAuthority
    stream: ConfigStreamServer
    metrics: ControllerMetrics
    versions: ConfigVersions
    port: int
    denied: set[str]

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_pem(self) -> bytes:
        return self.ca.certificate_pem

    def count(self, kind: str, reason: str) -> float:
        outcome = "issued" if reason == "issued" else "refused"
        return self.metrics.registry.get_sample_value(
            "nodeagent_controller_certificate_requests_total",
            {"kind": kind, "outcome": outcome, "reason": reason}) or 0.0


@pytest.fixture
async def rig(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Rig]:
    fake = await start_fake_kube(nursery, namespaces=(*DEFAULT_NAMESPACES, NS))
    async with KubeClient(credentials_for(fake, tmp_path), timeout=10.0) as kube:
        ca = pki.create_ca("signing test CA")
        metrics = ControllerMetrics()
        denied: set[str] = set()
        signer = CertificateSigner(kube, lambda: ca, SigningPolicy(namespace=NS), metrics,
                                   denied_nodes=lambda: frozenset(denied))
        dns, ips = service_names("nodeagent-controller", NS, ("127.0.0.1",))
        versions = ConfigVersions()
        stream = ConfigStreamServer(versions, tls=ServingTLS(lambda: ca, dns, ips).context,
                                    signer=signer, metrics=metrics)
        listeners = await nursery.start(stream.run, "127.0.0.1", 0)
        yield Rig(fake, ca, stream, metrics, versions, listeners[0].socket.getsockname()[1],
                  denied)


async def post(rig: Rig, body: bytes, token: str | None) -> tuple[int, dict[str, str]]:
    """A raw POST /v1/certificates (any body) over TLS, without a client certificate."""
    context = pki.client_ssl_context(rig.ca_pem)
    stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", rig.port), context,
                            server_hostname="127.0.0.1")
    headers = [("host", "127.0.0.1"), ("content-length", str(len(body)))]
    if token is not None:
        headers.append(("authorization", f"Bearer {token}"))
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        await stream.send_all(conn.send(h11.Request(method="POST", target="/v1/certificates",
                                                    headers=headers))
                              + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        status, answer = 0, b""
        with trio.fail_after(10):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(65536)))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    answer += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    assert answer.count(b"\n") == 1, answer  # one line
                    return status, json.loads(answer)


def csr_body(kind: str, csr: bytes) -> bytes:
    return json.dumps({"kind": kind, "csr": csr.decode()}).encode()


def uris(pem: bytes) -> list[str]:
    cert = x509.load_pem_x509_certificate(pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return list(san.get_values_for_type(x509.UniformResourceIdentifier))


async def test_an_agent_token_gets_a_certificate_for_its_node_whatever_the_csr_says(
        rig: Rig) -> None:
    token = add_agent_token(rig.fake, "edge-1")
    key = pki.generate_key()
    # The CSR asks for another node: the certificate still names only the token's node.
    status, doc = await post(rig, csr_body("node", pki.certificate_signing_request(
        "edge-2", key)), token)
    assert status == 200, doc
    leaf = doc["certificate"].encode()
    assert uris(leaf) == ["nodeagent://node/edge-1"]
    cert = x509.load_pem_x509_certificate(leaf)
    assert cert.public_key() == key.public_key()
    assert doc["ca"].encode() == rig.ca_pem
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(hours=24) <= lifetime <= dt.timedelta(hours=24, minutes=6)
    assert doc["not_after"] == cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert rig.count("node", "issued") == 1


async def test_a_revoked_node_gets_no_certificate(rig: Rig) -> None:
    token = add_agent_token(rig.fake, "edge-1")
    rig.denied.add("edge-1")
    status, doc = await post(rig, csr_body("node", pki.certificate_signing_request(
        "edge-1", pki.generate_key())), token)
    assert (status, doc["reason"]) == (403, "node_denied"), doc
    assert rig.count("node", "node_denied") == 1
    rig.denied.clear()
    status, doc = await post(rig, csr_body("node", pki.certificate_signing_request(
        "edge-1", pki.generate_key())), token)
    assert status == 200, doc


async def test_without_the_node_claim_the_bound_pods_node_is_used(rig: Rig) -> None:
    token = add_agent_token(rig.fake, "edge-7", node_claim=False)
    pem = await request_certificate(rig.url, rig.ca_pem, token, "node", pki.generate_key())
    assert uris(pem) == ["nodeagent://node/edge-7"]


async def test_certificates_from_tokens_read_exactly_what_they_should(rig: Rig) -> None:
    rig.versions.update("node/edge-1", NodeConfig(allow=(AllowRule(host="10.1.0.5"),)))
    rig.versions.update("node/edge-2", NodeConfig(allow=(AllowRule(host="10.2.0.5"),)))
    rig.versions.update("servers", RoutesConfig(egress=(AllowRule(host="10.9.0.1"),)))
    node = await obtain_identity(rig.url, rig.ca_pem, add_agent_token(rig.fake, "edge-1"),
                                 "node")
    server = await obtain_identity(rig.url, rig.ca_pem,
                                   add_server_token(rig.fake, "nodeagent-server-0"), "server")
    assert uris(server.certificate_pem) == ["nodeagent://server/nodeagent-server-0"]
    assert isinstance(node, IssuedIdentity) and node.renew_at < node.not_after

    async def read(identity: IssuedIdentity, path: str) -> tuple[int, bytes]:
        return await get(rig.port, path, identity.client_context())

    status, body = await read(node, "/v1/config/nodes/edge-1")
    assert status == 200 and b"10.1.0.5" in body
    assert (await read(node, "/v1/config/nodes/edge-2"))[0] == 403
    assert (await read(node, "/v1/config/servers/s"))[0] == 403
    status, body = await read(server, "/v1/config/servers/nodeagent-server-0")
    assert status == 200 and b"10.9.0.1" in body
    assert (await read(server, "/v1/config/nodes/edge-1"))[0] == 403


def refused_token(rig: Rig, case: str) -> tuple[str, str]:
    """(token, kind) for each way a request must be refused."""
    fake = rig.fake
    if case == "wrong_audience":
        return add_agent_token(fake, "edge-1", audiences=("https://kubernetes.default.svc",)
                               ), "node"
    if case == "expired":
        return add_agent_token(fake, "edge-1", expires_at=time.time() - 60), "node"
    if case == "unknown":
        return "not-a-token-anyone-issued", "node"
    if case == "agent_asks_for_server":
        return add_agent_token(fake, "edge-1"), "server"
    if case == "server_asks_for_node":
        return add_server_token(fake, "nodeagent-server-0"), "node"
    if case == "other_account":
        return add_agent_token(fake, "edge-1", account="default"), "node"
    if case == "other_namespace":
        token = "elsewhere-token-0123456789"
        fake.add_service_account_token(token, namespace="kube-system",
                                       service_account="nodeagent-agent", node_name="edge-1",
                                       pod_name="p", pod_uid="u", audiences=["nodeagent"])
        return token, "node"
    if case in ("pod_deleted", "pod_replaced"):
        token = add_agent_token(fake, "edge-1", node_claim=False)
        pod = next(p for p in fake.objects("pods", namespace=NS)
                   if p["spec"].get("nodeName") == "edge-1")
        fake.delete_object("pods", pod["metadata"]["name"], NS)
        if case == "pod_replaced":  # same name, new uid: the token's pod is gone
            add_pod(fake, pod["metadata"]["name"], node="edge-1")
        return token, "node"
    if case == "pod_unknown":
        # A token bound to a pod the API has never had: the fake's TokenReview lets it
        # pass (lenient for pods it does not store), so the controller's own check of
        # the bound pod must refuse it.
        token = "unknown-pod-token-0123456789"
        fake.add_service_account_token(token, namespace=NS, service_account="nodeagent-agent",
                                       pod_name="ghost", pod_uid="ghost-uid",
                                       audiences=["nodeagent"])
        return token, "node"
    if case == "pod_not_scheduled":
        token = "unscheduled-token-0123456789"
        uid = add_pod(fake, "pending-agent", node=None)
        fake.add_service_account_token(token, namespace=NS, service_account="nodeagent-agent",
                                       pod_name="pending-agent", pod_uid=uid,
                                       audiences=["nodeagent"])
        return token, "node"
    if case == "not_pod_bound":
        token = "unbound-token-0123456789"
        fake.add_service_account_token(token, namespace=NS, service_account="nodeagent-agent",
                                       audiences=["nodeagent"])
        return token, "node"
    raise AssertionError(case)


@pytest.mark.parametrize(("case", "status", "reason"), [
    ("wrong_audience", 401, "token_invalid"),
    ("expired", 401, "token_invalid"),
    ("unknown", 401, "token_invalid"),
    ("agent_asks_for_server", 403, "wrong_service_account"),
    ("server_asks_for_node", 403, "wrong_service_account"),
    ("other_account", 403, "wrong_service_account"),
    ("other_namespace", 403, "wrong_service_account"),
    # A deleted or replaced pod's token no longer authenticates at all (the API server's
    # bound-token check); the controller's own pod check backs it up (pod_unknown).
    ("pod_deleted", 401, "token_invalid"),
    ("pod_replaced", 401, "token_invalid"),
    ("pod_unknown", 403, "pod_not_found"),
    ("pod_not_scheduled", 403, "pod_not_scheduled"),
    ("not_pod_bound", 403, "not_pod_bound"),
])
async def test_refusals_have_a_status_a_reason_a_metric_and_a_log_line(
        rig: Rig, caplog: pytest.LogCaptureFixture, case: str, status: int,
        reason: str) -> None:
    token, kind = refused_token(rig, case)
    caplog.set_level(logging.INFO)
    with pytest.raises(CertificateRefused) as info:
        await request_certificate(rig.url, rig.ca_pem, token, kind, pki.generate_key())
    assert (info.value.status, info.value.reason) == (status, reason)
    assert rig.count(kind, reason) == 1 and rig.count(kind, "issued") == 0
    lines = [(r.getMessage(), getattr(r, "nodeagent_fields", {})) for r in caplog.records]
    assert ("certificate refused", {"kind": kind, "status": status, "reason": reason,
                                    "error": str(info.value).split(": ", 1)[1]}) in lines
    assert token not in repr(lines)  # never a secret in the logs


@pytest.mark.parametrize(("body", "token", "status", "reason"), [
    (b"not json", "t", 400, "bad_request"),
    (b'{"kind": "admin", "csr": ""}', "t", 400, "bad_request"),
    (b'{"kind": "node", "csr": "-----BEGIN CERTIFICATE REQUEST-----\\nAAAA"}', "t", 400,
     "bad_csr"),
    (None, None, 401, "no_token"),
])
async def test_bad_requests_are_refused_before_any_token_review(
        rig: Rig, body: bytes | None, token: str | None, status: int, reason: str) -> None:
    if body is None:
        body = csr_body("node", pki.key_signing_request(pki.generate_key()))
    rig.fake.clear_requests()
    got, doc = await post(rig, body, token)
    assert (got, doc["reason"]) == (status, reason) and doc["error"]
    assert not rig.fake.requests_matching(path="/apis/authentication.k8s.io/v1/tokenreviews")


async def test_a_client_that_does_not_trust_the_ca_never_sends_its_token(rig: Rig) -> None:
    token = add_agent_token(rig.fake, "edge-1")
    other = pki.create_ca("not the controller's CA")
    rig.fake.clear_requests()
    with pytest.raises(trio.BrokenResourceError):
        await request_certificate(rig.url, other.certificate_pem, token, "node",
                                  pki.generate_key())
    assert not rig.fake.requests_matching(path="/apis/authentication.k8s.io/v1/tokenreviews")


async def test_the_api_being_down_is_a_503_not_a_refusal_of_the_client(rig: Rig) -> None:
    token = add_agent_token(rig.fake, "edge-1")
    rig.fake.fail_next(1, status=500)
    with pytest.raises(CertificateRefused) as info:
        await request_certificate(rig.url, rig.ca_pem, token, "node", pki.generate_key())
    assert (info.value.status, info.value.reason) == (503, "api_unavailable")
    # ... and the same token works once the API answers.
    pem = await request_certificate(rig.url, rig.ca_pem, token, "node", pki.generate_key())
    assert uris(pem) == ["nodeagent://node/edge-1"]


async def test_an_oversized_body_is_refused_without_reading_on(rig: Rig) -> None:
    context = pki.client_ssl_context(rig.ca_pem)
    stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", rig.port), context,
                            server_hostname="127.0.0.1")
    body = b"x" * (64 * 1024)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        await stream.send_all(conn.send(h11.Request(method="POST", target="/v1/certificates",
                                                    headers=[("host", "127.0.0.1"),
                                                             ("content-length", str(len(body)))]
                                                    )))
        with trio.move_on_after(5):
            try:
                await stream.send_all(conn.send(h11.Data(data=body)))
            except trio.BrokenResourceError:
                pass  # the server answered and closed before reading it all
        data = b""
        with trio.fail_after(5):
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
    assert data.startswith(b"HTTP/1.1 413 "), data[:100]


async def test_a_renewal_presents_the_current_certificate_and_needs_no_token_review(
        rig: Rig) -> None:
    """request_certificate(present=...) is what IdentityKeeper's requesters send at
    half-life: the controller signs for the presented identity, so a token that no longer
    passes TokenReview (or a review budget an anonymous flood has taken) does not stop a
    renewal."""
    token = add_agent_token(rig.fake, "edge-1")
    first = await obtain_identity(rig.url, rig.ca_pem, token, "node",
                                  server_hostname="127.0.0.1")
    rig.fake.revoke_token(token)
    reviews = len(rig.fake.requests_matching(path="/apis/authentication.k8s.io/v1/tokenreviews"))
    with trio.fail_after(15):
        renewed = await request_identity(
            functools.partial(trio.open_tcp_stream, "127.0.0.1", rig.port), host="127.0.0.1",
            token=token, kind="node", key=pki.generate_key(), ca_pem=rig.ca_pem,
            present=first)
    assert uris(renewed.certificate_pem) == ["nodeagent://node/edge-1"]
    assert len(rig.fake.requests_matching(
        path="/apis/authentication.k8s.io/v1/tokenreviews")) == reviews
    # Without presenting it, the revoked token is refused.
    with pytest.raises(CertificateRefused) as refused, trio.fail_after(15):
        await request_identity(
            functools.partial(trio.open_tcp_stream, "127.0.0.1", rig.port), host="127.0.0.1",
            token=token, kind="node", key=pki.generate_key(), ca_pem=rig.ca_pem)
    assert refused.value.status == 401
