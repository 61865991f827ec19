"""RBAC objects stored like a real cluster's, and RBAC authorization in the fake."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.fakekube import FakeKube
from tests.fakekube.fixtures import ADMIN_TOKEN

RBAC = "/apis/rbac.authorization.k8s.io/v1"


@pytest.fixture
async def api(fake_kube: FakeKube) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fake_kube.url, timeout=10,
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
        yield c


def role(name: str, rules: list[dict[str, Any]], namespace: str | None = "default"
         ) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role" if namespace else "ClusterRole", "metadata": meta, "rules": rules}


def binding(name: str, role_kind: str, role_name: str, subjects: list[dict[str, Any]],
            namespace: str | None = "default") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding" if namespace else "ClusterRoleBinding", "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                        "name": role_name},
            "subjects": subjects}


async def test_discovery_lists_rbac_and_policy(api: httpx.AsyncClient) -> None:
    groups = {g["name"] for g in (await api.get("/apis")).json()["groups"]}
    assert {"rbac.authorization.k8s.io", "policy"} <= groups
    resources = {r["name"]: r for r in (await api.get(RBAC)).json()["resources"]}
    assert {"roles", "clusterroles", "rolebindings", "clusterrolebindings"} <= set(resources)
    assert resources["roles"]["namespaced"] and not resources["clusterroles"]["namespaced"]
    assert "watch" in resources["rolebindings"]["verbs"]
    policy = {r["name"] for r in (await api.get("/apis/policy/v1")).json()["resources"]}
    assert {"poddisruptionbudgets", "poddisruptionbudgets/status"} <= policy


async def test_rbac_objects_round_trip_with_defaults(api: httpx.AsyncClient) -> None:
    r = await api.post(f"{RBAC}/namespaces/default/roles",
                       json=role("r", [{"apiGroups": [""], "resources": ["pods"],
                                        "verbs": ["get"]}]))
    assert r.status_code == 201, r.text
    r = await api.post(f"{RBAC}/namespaces/default/rolebindings", json=binding(
        "b", "Role", "r", [{"kind": "User", "name": "alice"},
                           {"kind": "ServiceAccount", "name": "x", "namespace": "default"}]))
    assert r.status_code == 201, r.text
    subjects = r.json()["subjects"]
    assert subjects[0]["apiGroup"] == "rbac.authorization.k8s.io"
    assert subjects[1]["apiGroup"] == ""
    listed = (await api.get(f"{RBAC}/rolebindings")).json()
    assert [i["metadata"]["name"] for i in listed["items"]] == ["b"]
    assert listed["kind"] == "RoleBindingList"


async def test_binding_role_ref_is_immutable(api: httpx.AsyncClient) -> None:
    path = f"{RBAC}/clusterrolebindings"
    created = (await api.post(path, json=binding("b", "ClusterRole", "view", [
        {"kind": "Group", "name": "g"}], namespace=None))).json()
    created["roleRef"]["name"] = "edit"
    r = await api.put(f"{path}/b", json=created)
    assert r.status_code == 422
    status = r.json()
    assert status["reason"] == "Invalid"
    assert "roleRef: Invalid value" in status["message"]
    assert "cannot change roleRef" in status["message"]
    created["roleRef"]["name"] = "view"
    created["subjects"].append({"kind": "Group", "name": "h"})
    assert (await api.put(f"{path}/b", json=created)).status_code == 200


@pytest.mark.parametrize(("body", "field"), [
    (binding("b", "Role", "r", [{"kind": "Group", "name": "g"}], namespace=None),
     "roleRef.kind"),
    (binding("b", "ClusterRole", "r", [{"kind": "Robot", "name": "g"}], namespace=None),
     "subjects[0].kind"),
    (binding("b", "ClusterRole", "r", [{"kind": "ServiceAccount", "name": "sa"}],
             namespace=None), "subjects[0].namespace"),
    (role("r", [{"apiGroups": [""], "resources": ["pods"]}], namespace=None),
     "rules[0].verbs"),
    (role("r", [{"resources": ["pods"], "verbs": ["get"]}], namespace=None),
     "rules[0].apiGroups"),
    (role("r", [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]),
     "rules[0].nonResourceURLs"),
])
async def test_invalid_rbac_objects_are_rejected(api: httpx.AsyncClient,
                                                 body: dict[str, Any], field: str) -> None:
    plural = {"Role": "roles", "ClusterRole": "clusterroles", "RoleBinding": "rolebindings",
              "ClusterRoleBinding": "clusterrolebindings"}[body["kind"]]
    ns = body["metadata"].get("namespace")
    path = f"{RBAC}/namespaces/{ns}/{plural}" if ns else f"{RBAC}/{plural}"
    r = await api.post(path, json=body)
    assert r.status_code == 422, r.text
    assert field in [c["field"] for c in r.json()["details"]["causes"]]


async def test_pod_disruption_budget(api: httpx.AsyncClient) -> None:
    path = "/apis/policy/v1/namespaces/default/poddisruptionbudgets"
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
           "metadata": {"name": "p"},
           "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"a": "b"}}}}
    r = await api.post(path, json=pdb)
    assert r.status_code == 201, r.text
    assert r.json()["status"]["disruptionsAllowed"] == 0
    both = {**pdb, "metadata": {"name": "q"},
            "spec": {**pdb["spec"], "minAvailable": "50%"}}
    r = await api.post(path, json=both)
    assert r.status_code == 422
    assert "cannot be both set" in r.json()["message"]
