"""Authentication and rate limits from Ingress annotations, controller mode end to end:
the fake API server, the controllers, a server and an agent as real processes (the
fixtures of test_kubernetes). Basic auth from a Secret of the Ingress's namespace (and a
change of that Secret), a JWT against a JWKS on a local HTTP server whose key rotates, a
per-client rate limit, and an Ingress whose annotations are wrong: an Event, and nothing
of it served."""

from __future__ import annotations

import base64
from typing import Any

import bcrypt
import httpx
import pytest

from nodeagent.controller.clustertunnel import CLUSTER_TUNNELS
from nodeagent.kube.resources import ENDPOINTSLICES, EVENTS, INGRESSES, NODES, SECRETS, SERVICES
from tests.e2e.test_auth import KeyServer, keys  # noqa: F401  (a fixture)
from tests.e2e.test_kubernetes import (  # noqa: F401  (fixtures)
    NS,
    Api,
    cluster,
    controllers,
    endpoint_slice,
    ingress,
    wait_for,
    web_endpoint,
)

pytestmark = pytest.mark.needs("root")


def get(port: int, host: str, **kwargs: Any) -> httpx.Response:
    with httpx.Client(timeout=5, trust_env=False) as client:
        return client.get(f"http://127.0.0.1:{port}/", headers={"host": host,
                          "x-nodeagent-identity": "root", **kwargs.pop("headers", {})},
                          **kwargs)


def htpasswd_secret(lines: str) -> dict[str, Any]:
    return {"metadata": {"name": "shop-users", "namespace": NS}, "type": "nodeagent.io/htpasswd",
            "data": {"auth": base64.b64encode(lines.encode()).decode()}}


def annotated(name: str, host: str, annotations: dict[str, str]) -> dict[str, Any]:
    obj = ingress(name, host, "/")
    obj["metadata"]["annotations"] = annotations
    return obj


def test_ingress_auth_and_limits_from_annotations(cluster: dict[str, Any],  # noqa: F811
                                                  keys: KeyServer) -> None:  # noqa: F811
    api: Api = cluster["api"]
    port, upstream = cluster["http"], cluster["upstream"]
    api.replace(NODES, {"metadata": {"name": "edge-1"}, "spec": {"podCIDRs": ["10.1.0.0/24"]}})
    api.replace_status(NODES, "edge-1", None, {"addresses": [
        {"type": "InternalIP", "address": "127.0.0.1"}]})
    api.create(SERVICES, {"metadata": {"name": "web", "namespace": NS}, "spec": {
        "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
    api.create(ENDPOINTSLICES, endpoint_slice(upstream.http_port, [web_endpoint(api)]))

    alice = bcrypt.hashpw(b"alice-pw", bcrypt.gensalt(4)).decode()
    api.create(SECRETS, htpasswd_secret(f"alice:{alice}\n"))
    api.create(INGRESSES, annotated("basic", "basic.test", {
        "nodeagent.io/auth-basic-secret": "shop-users",
        "nodeagent.io/rate-limit-per-client-rps": "0.01",
        "nodeagent.io/rate-limit-per-client-burst": "3"}))
    wait_for(lambda: get(port, "basic.test").status_code == 401, "basic auth asked")
    r = get(port, "basic.test", auth=("alice", "alice-pw"))
    assert r.status_code == 200 and "identity=alice" in r.text, r.text
    # The per-client burst of 3 is spent (401, 200, 200): 429 next.
    assert get(port, "basic.test", auth=("alice", "alice-pw")).status_code == 200
    r = get(port, "basic.test", auth=("alice", "alice-pw"))
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1

    # The Secret changes: bob replaces alice (the rate limit moves to a fresh Ingress).
    bob = bcrypt.hashpw(b"bob-pw", bcrypt.gensalt(4)).decode()
    api.replace(SECRETS, htpasswd_secret(f"bob:{bob}\n"))
    api.replace(INGRESSES, annotated("basic", "basic.test", {
        "nodeagent.io/auth-basic-secret": "shop-users"}))
    wait_for(lambda: get(port, "basic.test", auth=("bob", "bob-pw")).status_code == 200,
             "the changed Secret applies")
    assert get(port, "basic.test", auth=("alice", "alice-pw")).status_code == 401

    # JWT against the local JWKS; the key rotates mid-test.
    api.create(INGRESSES, annotated("jwt", "jwt.test", {
        "nodeagent.io/auth-jwt-issuer": "https://issuer.test",
        "nodeagent.io/auth-jwt-jwks-url": keys.url,
        "nodeagent.io/auth-jwt-audience": "shop"}))
    wait_for(lambda: get(port, "jwt.test").status_code == 401, "JWT asked")
    r = get(port, "jwt.test", headers={"authorization": f"Bearer {keys.token('erin')}"})
    assert r.status_code == 200 and "identity=erin" in r.text
    keys.rotate()
    # The first fetch is under jwks_min_refetch (10 s) old: the new kid waits for it.
    wait_for(lambda: get(port, "jwt.test", headers={
        "authorization": f"Bearer {keys.token('frank')}"}).status_code == 200,
        "the rotated key is fetched", timeout=20)
    assert keys.fetches == 2

    # Wrong annotations: an Event, and the Ingress is not served at all (never open).
    api.create(INGRESSES, annotated("bad", "bad.test", {
        "nodeagent.io/auth-jwt-issuer": "https://issuer.test",
        "nodeagent.io/auth-jwt-jwks-url": keys.url,
        "nodeagent.io/auth-jwt-audience": "shop",
        "nodeagent.io/auth-jwt-algorithms": "HS256"}))
    wait_for(lambda: any(e.get("reason") == "InvalidAuthOrLimits"
                         for e in api.list(EVENTS, NS)), "Event for the bad annotations")
    assert get(port, "bad.test").status_code == 404
    status = cluster["server"].status()
    assert status["route_gates"]["shop/jwt"]["jwks"]["key_ids"] == ["key-2"]

    # A ClusterTunnel's defaults: an Ingress without auth annotations asks for the JWT,
    # one with its own (basic) keeps it.
    api.create(INGRESSES, ingress("plain", "plain.test", "/"))
    wait_for(lambda: get(port, "plain.test").status_code == 200, "an open Ingress")
    api.create(CLUSTER_TUNNELS, {"metadata": {"name": "edge"}, "spec": {
        "ingressJwt": {"issuer": "https://issuer.test", "jwks_url": keys.url,
                       "audiences": ["shop"]}}})
    wait_for(lambda: get(port, "plain.test").status_code == 401, "the cluster's JWT")
    r = get(port, "plain.test", headers={"authorization": f"Bearer {keys.token('gina')}"})
    assert r.status_code == 200 and "identity=gina" in r.text
    assert get(port, "basic.test", auth=("bob", "bob-pw")).status_code == 200
    assert bob not in str(status) and alice not in cluster["server"].logs()
