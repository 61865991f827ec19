"""The certificate endpoint bounds the TokenReviews it causes: a flood of requests with
tokens (valid or not) costs the API server at most `review_rate` a second plus a burst;
the excess gets 429 with Retry-After before any API call, counted and logged once. Real
TLS sockets, the fake API server's TokenReview. And the CA rotation's pieces in the
controller: the trust bundle, and knowing which CA signed the servers' certificate."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import h11
import pytest
import trio

from nodeagent.controller.bootstrap import issued_by, trust_bundle
from nodeagent.controller.compute import ConfigVersions
from nodeagent.controller.configserver import ConfigStreamServer
from nodeagent.controller.metrics import ControllerMetrics
from nodeagent.controller.servingtls import ServingTLS, service_names
from nodeagent.controller.signing import CertificateSigner, FailedTokens, SigningPolicy, TokenBucket
from nodeagent.kube import KubeClient
from nodeagent.testing.fakekube.fixtures import credentials_for, start_fake_kube
from nodeagent.testing.fakekube.store import DEFAULT_NAMESPACES
from nodeagent.trust import pki
from tests.controller.identity import NS, add_agent_token


async def post(port: int, ca_pem: bytes, body: bytes, token: str
               ) -> tuple[int, dict[str, str], dict[str, str]]:
    """POST /v1/certificates over TLS: (status, headers, JSON body)."""
    context = pki.client_ssl_context(ca_pem)
    stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), context,
                            server_hostname="127.0.0.1")
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        await stream.send_all(conn.send(h11.Request(
            method="POST", target="/v1/certificates", headers=[
                ("host", "127.0.0.1"), ("content-length", str(len(body))),
                ("authorization", f"Bearer {token}")]))
            + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        status, headers, answer = 0, {}, b""
        with trio.fail_after(10):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(65536)))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    headers = {k.decode(): v.decode() for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    answer += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    return status, headers, json.loads(answer)


def test_the_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(2.0, 3, lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [None, None, None]
    assert bucket.take() == pytest.approx(0.5)
    now[0] = 0.5
    assert bucket.take() is None and bucket.take() == pytest.approx(0.5)
    now[0] = 100.0  # idle for long: no more than the burst saved up
    assert [bucket.take() is None for _ in range(4)] == [True, True, True, False]


async def test_a_flood_of_certificate_requests_is_held_to_the_review_rate(
        nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake = await start_fake_kube(nursery, namespaces=(*DEFAULT_NAMESPACES, NS))
    async with KubeClient(credentials_for(fake, tmp_path), timeout=10.0) as kube:
        ca = pki.create_ca("limits CA")
        metrics = ControllerMetrics()
        signer = CertificateSigner(kube, lambda: ca, SigningPolicy(namespace=NS), metrics,
                                   review_rate=2.0, review_burst=4)
        dns, ips = service_names("nodeagent-controller", NS, ("127.0.0.1",))
        stream = ConfigStreamServer(ConfigVersions(),
                                    tls=ServingTLS(lambda: ca, dns, ips).context,
                                    signer=signer, metrics=metrics)
        listeners = await stream_listeners(nursery, stream)
        port = listeners[0].socket.getsockname()[1]
        token = add_agent_token(fake, "edge-1")
        fake.clear_requests()
        answers: list[tuple[int, dict[str, str], dict[str, str]]] = []

        async def one(i: int) -> None:
            body = json.dumps({"kind": "node", "csr": pki.certificate_signing_request(
                "edge-1", pki.generate_key()).decode()}).encode()
            answers.append(await post(port, ca.certificate_pem, body,
                                      token if i % 2 == 0 else f"forged-token-{i:04}"))

        async with trio.open_nursery() as flood:
            for i in range(30):  # forged tokens cost a TokenReview too: they count
                flood.start_soon(one, i)
        reviews = fake.requests_matching(method="POST", path="tokenreviews")
        limited = [a for a in answers if a[0] == 429]
        # The burst (4) plus what 2/s refills while the flood lasts.
        assert 4 <= len(reviews) <= 4 + 2 * 3, len(reviews)
        assert len(limited) == 30 - len(reviews)
        for _, headers, doc in limited:
            assert doc["reason"] == "rate_limited"
            assert int(headers["retry-after"]) >= 1
        assert (metrics.registry.get_sample_value(
            "nodeagent_controller_certificate_requests_total",
            {"kind": "node", "outcome": "refused", "reason": "rate_limited"})
            == len(limited))
        reasons = [getattr(r, "nodeagent_fields", {}).get("reason") for r in caplog.records
                   if r.levelno >= logging.WARNING and r.getMessage() == "certificate refused"]
        assert reasons.count("rate_limited") == 1, reasons  # once a minute per reason
        # After a second, requests pass again.
        await trio.sleep(1.0)
        status, _, doc = await post(port, ca.certificate_pem, json.dumps({
            "kind": "node", "csr": pki.certificate_signing_request(
                "edge-1", pki.generate_key()).decode()}).encode(), token)
        assert status == 200, doc

        # A token the API refused, sent again: refused at once, no review and no slot.
        fake.clear_requests()
        body = json.dumps({"kind": "node", "csr": pki.certificate_signing_request(
            "edge-1", pki.generate_key()).decode()}).encode()
        await trio.sleep(1.0)
        for _ in range(10):
            status, _, doc = await post(port, ca.certificate_pem, body, "forged-again-0001")
            assert (status, doc["reason"]) == (401, "token_invalid")
        assert len(fake.requests_matching(method="POST", path="tokenreviews")) == 1


def test_failed_tokens_are_remembered_for_a_while_and_bounded() -> None:
    now = [0.0]
    failed = FailedTokens(ttl=10.0, size=3, clock=lambda: now[0])
    failed.add("a")
    assert "a" in failed and "b" not in failed
    now[0] = 10.5
    assert "a" not in failed
    for token in "bcde":
        failed.add(token)
    assert "b" not in failed and all(t in failed for t in "cde")


async def stream_listeners(nursery: trio.Nursery, stream: ConfigStreamServer
                           ) -> list[trio.SocketListener]:
    listeners: list[trio.SocketListener] = await nursery.start(stream.run, "127.0.0.1", 0)
    return listeners


def test_the_trust_bundle_always_holds_the_signing_ca_once_and_first() -> None:
    old, new = pki.create_ca("old"), pki.create_ca("new")
    both = (old.certificate_pem + new.certificate_pem).decode()
    assert trust_bundle(new, both) == new.certificate_pem + old.certificate_pem
    assert trust_bundle(new, "") == new.certificate_pem
    assert trust_bundle(new, old.certificate_pem.decode()) == \
        new.certificate_pem + old.certificate_pem
    with pytest.raises(ValueError):
        trust_bundle(new, "not PEM")


def test_the_servers_certificate_is_known_by_its_issuer() -> None:
    old, new = pki.create_ca("old"), pki.create_ca("new")
    leaf = pki.issue_server_certificate(old, ["nodeagent-server"]).certificate_pem.decode()
    assert issued_by(leaf, old) and not issued_by(leaf, new)
    assert not issued_by("garbage", old)
