"""manifests/rbac.yaml enforced by the fake API server (`FakeKube(rbac=True)`): what the
controller's ServiceAccount may do with CRDs and Secrets, what RBAC cannot restrict, and
the whole controller running on exactly those permissions with its Secret informer
limited to TLS Secrets."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from nodeagent.controller.bootstrap import CA_SECRET, SERVER_TLS_SECRET
from nodeagent.controller.controller import (
    SECRET_FIELD_SELECTOR,
    Controller,
    ControllerSettings,
    serve_controller,
)
from nodeagent.controller.crds import crd_manifests
from nodeagent.controller.ingressgate import HTPASSWD_SECRET_TYPE
from nodeagent.kube.client import selector_string
from nodeagent.testing.fakekube import FakeKube
from nodeagent.testing.fakekube.fixtures import ADMIN_TOKEN

MANIFEST_RBAC = Path(__file__).resolve().parents[2] / "manifests" / "rbac.yaml"
CONTROLLER = "system:serviceaccount:nodeagent:nodeagent-controller"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
TLS_SELECTOR = selector_string(SECRET_FIELD_SELECTOR)
HTPASSWD_SELECTOR = selector_string({"type": HTPASSWD_SECRET_TYPE})


@pytest.fixture
async def rbac_kube(nursery: trio.Nursery) -> FakeKube:
    fake = FakeKube(token=ADMIN_TOKEN, rbac=True, bookmark_interval=0.2,
                    namespaces=("default", "kube-system", "nodeagent", "other"))
    await nursery.start(fake.serve)
    for doc in yaml.safe_load_all(MANIFEST_RBAC.read_text()):
        if doc:
            fake.put_object(doc)
    fake.add_service_account_token("ctl", namespace="nodeagent",
                                   service_account="nodeagent-controller")
    return fake


def client(fake: FakeKube, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=fake.url, timeout=10,
                             headers={"Authorization": f"Bearer {token}"})


def crd(group: str, plural: str, kind: str) -> dict[str, Any]:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Cluster",
                     "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                         "openAPIV3Schema": {"type": "object",
                                             "x-kubernetes-preserve-unknown-fields": True}}}]}}


def secret(name: str, namespace: str, type_: str = "kubernetes.io/tls") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": type_,
            "metadata": {"name": name, "namespace": namespace},
            "stringData": {"tls.crt": "c", "tls.key": "k"}}


async def test_the_controller_updates_its_own_crd_and_no_other(rbac_kube: FakeKube) -> None:
    (ours,) = crd_manifests()
    name = ours["metadata"]["name"]
    assert name == "clustertunnels.nodeagent.io"
    rbac_kube.put_object(crd("example.com", "widgets", "Widget"))
    async with client(rbac_kube, "ctl") as ctl:
        r = await ctl.post(CRDS, json=ours)
        assert r.status_code == 201, r.text
        current = (await ctl.get(f"{CRDS}/{name}")).json()
        current["metadata"].setdefault("labels", {})["probe"] = "1"
        r = await ctl.put(f"{CRDS}/{name}", json=current)
        assert r.status_code == 200, r.text
        # Someone else's CRD: neither read nor changed.
        theirs = f"{CRDS}/widgets.example.com"
        assert (await ctl.get(theirs)).status_code == 403
        r = await ctl.put(theirs, json=crd("example.com", "widgets", "Widget"))
        assert r.status_code == 403
        assert r.json()["message"].startswith(
            f'customresourcedefinitions.apiextensions.k8s.io "widgets.example.com" is '
            f'forbidden: User "{CONTROLLER}" cannot update')
        # Unused verbs are not granted, not even on its own CRD.
        for method in ("PATCH", "DELETE"):
            r = await ctl.request(method, f"{CRDS}/{name}", json={},
                                  headers={"Content-Type": "application/merge-patch+json"})
            assert r.status_code == 403, (method, r.status_code)
        assert (await ctl.get(CRDS)).status_code == 403  # no list
        # What RBAC cannot limit (rbac.yaml says so): create names no object in its URL,
        # so a resourceNames rule never matches it and create is granted for any CRD.
        r = await ctl.post(CRDS, json=crd("example.com", "gadgets", "Gadget"))
        assert r.status_code == 201, r.text


async def test_secret_permissions_and_what_rbac_cannot_restrict(rbac_kube: FakeKube) -> None:
    rbac_kube.put_object(secret("shop-tls", "other"))
    rbac_kube.put_object(secret("token", "other", "Opaque"))
    for name in (CA_SECRET, SERVER_TLS_SECRET):
        rbac_kube.put_object(secret(name, "nodeagent"))
    async with client(rbac_kube, "ctl") as ctl:
        r = await ctl.get("/api/v1/secrets", params={"fieldSelector": TLS_SELECTOR})
        assert r.status_code == 200
        assert sorted(s["metadata"]["name"] for s in r.json()["items"]) == [
            CA_SECRET, SERVER_TLS_SECRET, "shop-tls"]
        # The honest part: RBAC ignores the field selector; the same token lists every
        # Secret, Opaque ones included.
        r = await ctl.get("/api/v1/secrets")
        assert r.status_code == 200
        assert "token" in {s["metadata"]["name"] for s in r.json()["items"]}
        # Writes: create in its namespace only; update only the servers' certificate.
        path = "/api/v1/namespaces/nodeagent/secrets"
        current = (await ctl.get(f"{path}/{SERVER_TLS_SECRET}")).json()
        assert (await ctl.put(f"{path}/{SERVER_TLS_SECRET}", json=current)).status_code == 200
        ca = (await ctl.get(f"{path}/{CA_SECRET}")).json()
        assert (await ctl.put(f"{path}/{CA_SECRET}", json=ca)).status_code == 403
        assert (await ctl.post("/api/v1/namespaces/other/secrets",
                               json=secret("x", "other"))).status_code == 403
        shop = (await ctl.get("/api/v1/namespaces/other/secrets/shop-tls")).json()
        assert (await ctl.put("/api/v1/namespaces/other/secrets/shop-tls",
                              json=shop)).status_code == 403
        assert (await ctl.delete(f"{path}/{SERVER_TLS_SECRET}")).status_code == 403


async def test_the_controller_runs_on_the_manifest_rbac_and_caches_only_tls_secrets(
        nursery: trio.Nursery, rbac_kube: FakeKube, tmp_path: Path) -> None:
    rbac_kube.put_object(secret("shop-tls", "other"))
    rbac_kube.put_object({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                          "metadata": {"name": "sh.helm.release.v1.x.v1", "namespace": "other"},
                          "stringData": {"release": "H4sI"}})
    settings = ControllerSettings(
        namespace="nodeagent", identity="c1", listen_host="127.0.0.1", listen_port=0,
        kubeconfig=rbac_kube.write_kubeconfig(tmp_path / "kubeconfig", token="ctl"),
        lease_duration=3.0, leader_retry=0.5, tls_names=("127.0.0.1",))
    controller: Controller = await nursery.start(functools.partial(serve_controller, settings))
    secrets = controller.caches["secrets"]
    with trio.fail_after(10):
        # The leader bootstraps its PKI with these permissions and reads the CA back
        # through the TLS-only informer.
        await secrets.wait_until(lambda c: controller.bootstrap.ca is not None and
                                 c.get(SERVER_TLS_SECRET, "nodeagent") is not None)
    assert secrets.keys() == [("nodeagent", CA_SECRET), ("nodeagent", SERVER_TLS_SECRET),
                              ("other", "shop-tls")]
    # A new Opaque Secret does not reach the cache; a TLS one does.
    rbac_kube.put_object(secret("later", "other", "Opaque"))
    rbac_kube.put_object(secret("later-tls", "other"))
    with trio.fail_after(10):
        await secrets.wait_until(lambda c: ("other", "later-tls") in c)
    assert ("other", "later") not in secrets
    mine = [r for r in rbac_kube.requests if r.user == CONTROLLER]
    secret_reads = [r for r in mine if r.method == "GET" and r.path == "/api/v1/secrets"]
    assert {r.query.get("watch", "") for r in secret_reads} >= {"", "true"}  # list, watch
    # Only two kinds: TLS Secrets and basic-auth htpasswd Secrets (docs/auth.md).
    assert {r.query.get("fieldSelector") for r in secret_reads} == {TLS_SELECTOR,
                                                                    HTPASSWD_SELECTOR}
    assert ("other", "sh.helm.release.v1.x.v1") not in controller.caches["htpasswd"]
    rbac_kube.put_object(dict(secret("users", "other", "nodeagent.io/htpasswd")))
    with trio.fail_after(10):
        await controller.caches["htpasswd"].wait_until(lambda c: ("other", "users") in c)
    assert ("other", "users") not in secrets and controller.caches["htpasswd"].keys() == [
        ("other", "users")]
    assert not [r for r in mine if "/secrets" in r.path and r.method == "GET" and
                r.path != "/api/v1/secrets"]  # no other Secret read, by name or namespace
    refused = [(r.method, r.path, r.query) for r in mine if r.status == 403]
    assert refused == []


async def test_the_controller_writes_load_balancer_status_by_patch_only(
        nursery: trio.Nursery, rbac_kube: FakeKube, tmp_path: Path) -> None:
    """services/status: patch, nothing more; what it writes is the servers' address."""
    rbac_kube.put_object({"apiVersion": "v1", "kind": "Service",
                          "metadata": {"name": "nodeagent-server", "namespace": "nodeagent"},
                          "spec": {"type": "LoadBalancer", "ports": [{"port": 443}]},
                          "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}})
    rbac_kube.put_object({"apiVersion": "v1", "kind": "Service",
                          "metadata": {"name": "dns", "namespace": "other"},
                          "spec": {"type": "LoadBalancer", "ports": [
                              {"port": 53, "protocol": "UDP"}],
                              "loadBalancerClass": "nodeagent.io/tunnel"}})
    settings = ControllerSettings(
        namespace="nodeagent", identity="c1", listen_host="127.0.0.1", listen_port=0,
        kubeconfig=rbac_kube.write_kubeconfig(tmp_path / "kubeconfig", token="ctl"),
        lease_duration=3.0, leader_retry=0.5, status_delay=0.1, tls_names=("127.0.0.1",))
    controller: Controller = await nursery.start(functools.partial(serve_controller, settings))
    services = controller.caches["services"]
    with trio.fail_after(15):
        await services.wait_until(lambda c: ((c.get("dns", "other") or {}).get(
            "status") or {}).get("loadBalancer", {}).get("ingress"))
    status = services.get("dns", "other")["status"]
    assert status["loadBalancer"]["ingress"] == [
        {"ip": "203.0.113.7", "ipMode": "Proxy", "ports": [{"port": 53, "protocol": "UDP"}]}]
    mine = [r for r in rbac_kube.requests if r.user == CONTROLLER and "/services/" in r.path
            and r.method != "GET"]
    assert {(r.method, r.path, r.status) for r in mine} == {
        ("PATCH", "/api/v1/namespaces/other/services/dns/status", 200)}
    async with client(rbac_kube, "ctl") as ctl:
        path = "/api/v1/namespaces/other/services/dns"
        current = (await ctl.get(path)).json()
        assert (await ctl.put(f"{path}/status", json=current)).status_code == 403
        assert (await ctl.put(path, json=current)).status_code == 403
        assert (await ctl.delete(path)).status_code == 403
