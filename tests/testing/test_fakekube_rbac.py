"""RBAC objects stored like a real cluster's, RBAC authorization, access reviews and bound
ServiceAccount tokens in the fake."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from nodeagent.testing.fakekube import FakeKube
from nodeagent.testing.fakekube.fixtures import ADMIN_TOKEN

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
    assert "apiGroup" not in subjects[1]  # "" is omitted, as the API server writes it
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


# -- enforcement --------------------------------------------------------------------------

MANIFEST_RBAC = Path(__file__).resolve().parents[2] / "manifests" / "rbac.yaml"
CONTROLLER = "system:serviceaccount:nodeagent:nodeagent-controller"


@pytest.fixture
async def rbac_kube(nursery: trio.Nursery) -> FakeKube:
    fake = FakeKube(token=ADMIN_TOKEN, rbac=True, bookmark_interval=0.2,
                    namespaces=("default", "kube-system", "nodeagent", "other"))
    await nursery.start(fake.serve)
    return fake


def client(fake: FakeKube, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=fake.url, timeout=10,
                             headers={"Authorization": f"Bearer {token}"})


async def status_of(c: httpx.AsyncClient, method: str, path: str, **kw: Any) -> int:
    return (await c.request(method, path, **kw)).status_code


async def test_manifest_rbac_gives_the_controller_what_it_needs_and_no_more(
        rbac_kube: FakeKube) -> None:
    for doc in yaml.safe_load_all(MANIFEST_RBAC.read_text()):
        if doc:
            rbac_kube.put_object(doc)
    rbac_kube.add_service_account_token("ctl", namespace="nodeagent",
                                        service_account="nodeagent-controller")
    rbac_kube.put_object({"apiVersion": "v1", "kind": "Secret",
                          "metadata": {"name": "s", "namespace": "other"}})
    async with client(rbac_kube, "ctl") as c:
        allowed = [
            ("GET", "/apis/networking.k8s.io/v1/ingresses"),
            ("GET", "/apis/networking.k8s.io/v1/ingresses?watch=true&timeoutSeconds=1"),
            ("GET", "/api/v1/nodes"),
            ("GET", "/api/v1/namespaces/other/secrets/s"),
            ("GET", "/apis/discovery.k8s.io/v1/endpointslices"),
            ("GET", "/api/v1/namespaces/nodeagent/configmaps"),
            ("GET", "/api/v1/pods"),  # endpoints are checked against every namespace's pods
        ]
        for method, path in allowed:
            code = await status_of(c, method, path)
            assert code == 200, (method, path, code)
        r = await c.post("/apis/authentication.k8s.io/v1/tokenreviews",
                         json={"spec": {"token": "ctl"}})
        assert r.status_code == 201
        r = await c.post("/apis/coordination.k8s.io/v1/namespaces/nodeagent/leases",
                         json={"metadata": {"name": "leader"}, "spec": {}})
        assert r.status_code == 201, r.text
        leader = r.json()
        lease = "/apis/coordination.k8s.io/v1/namespaces/nodeagent/leases/leader"
        assert await status_of(c, "GET", lease) == 200
        assert await status_of(c, "PUT", lease, json=leader) == 200
        r = await c.post("/api/v1/namespaces/nodeagent/secrets",
                         json={"metadata": {"name": "ca"}, "stringData": {"k": "v"}})
        assert r.status_code == 201, r.text
        denied = [
            ("DELETE", "/api/v1/nodes/n1"),
            ("PUT", "/api/v1/namespaces/nodeagent/secrets/ca"),  # get+create only
            ("POST", "/api/v1/namespaces/other/secrets"),  # create only in its namespace
            ("GET", "/apis/coordination.k8s.io/v1/namespaces/other/leases"),
            ("GET", "/apis/coordination.k8s.io/v1/namespaces/nodeagent/leases"),  # no list
            ("DELETE", "/apis/coordination.k8s.io/v1/namespaces/nodeagent/leases/leader"),
            ("GET", "/api/v1/namespaces/other/pods/p"),  # list+watch, get only its own
            ("DELETE", "/api/v1/namespaces/nodeagent/pods/p"),
            ("PUT", "/apis/networking.k8s.io/v1/namespaces/default/ingresses/x"),
            ("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles"),
            ("DELETE", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/x"),
        ]
        for method, path in denied:
            kw: dict[str, Any] = {"json": {"metadata": {"name": "ca"}}} if method in (
                "PUT", "POST") else {}
            r = await c.request(method, path, **kw)
            assert r.status_code == 403, (method, path, r.status_code)
            assert r.json()["reason"] == "Forbidden"
        r = await c.delete("/api/v1/nodes/n1")
        assert r.json() == {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "reason": "Forbidden", "code": 403, "details": {"name": "n1", "kind": "nodes"},
            "message": f'nodes "n1" is forbidden: User "{CONTROLLER}" cannot delete '
                       'resource "nodes" in API group "" at the cluster scope'}
        r = await c.put("/api/v1/namespaces/nodeagent/secrets/ca",
                        json={"metadata": {"name": "ca"}})
        assert r.json()["message"] == (
            f'secrets "ca" is forbidden: User "{CONTROLLER}" cannot update resource '
            '"secrets" in API group "" in the namespace "nodeagent"')
        # Status subresources are separate resources.
        ing = "/apis/networking.k8s.io/v1/namespaces/default/ingresses/x"
        assert await status_of(c, "PUT", f"{ing}/status", json={}) == 404  # allowed: no x
        assert await status_of(c, "PUT", ing, json={}) == 403


async def test_verbs_resource_names_and_field_selectors(rbac_kube: FakeKube) -> None:
    rbac_kube.put_object(role("r", [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "watch"],
         "resourceNames": ["mine"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}]))
    rbac_kube.put_object(binding("b", "Role", "r", [{"kind": "User", "name": "u"}]))
    rbac_kube.add_token("u", username="u")
    for name in ("mine", "theirs"):
        rbac_kube.put_object({"apiVersion": "v1", "kind": "ConfigMap",
                              "metadata": {"name": name, "namespace": "default"}})
    cms = "/api/v1/namespaces/default/configmaps"
    async with client(rbac_kube, "u") as c:
        assert await status_of(c, "GET", f"{cms}/mine") == 200
        assert await status_of(c, "GET", f"{cms}/theirs") == 403
        assert await status_of(c, "GET", cms) == 403  # list is not get
        assert await status_of(c, "GET", cms, params={
            "fieldSelector": "metadata.name=mine"}) == 403  # a list, and list is not granted
        params = {"watch": "true", "timeoutSeconds": "1"}
        for selector in ("metadata.name=mine", "metadata.name==mine",
                         "metadata.name=mine,metadata.namespace=default"):
            assert await status_of(c, "GET", cms, params={
                **params, "fieldSelector": selector}) == 200, selector
        for selector in ("", "metadata.name!=theirs", "metadata.name=theirs",
                         "metadata.namespace=default"):
            assert await status_of(c, "GET", cms, params={
                **params, "fieldSelector": selector}) == 403, selector
        assert await status_of(c, "DELETE", f"{cms}/mine") == 403
        # pods/log is granted, pods is not: authorized, then 404 (no logs in the fake).
        assert await status_of(c, "GET", "/api/v1/namespaces/default/pods/p/log") == 404
        assert await status_of(c, "GET", "/api/v1/namespaces/default/pods/p") == 403
        assert await status_of(c, "GET", "/api/v1/namespaces/other/pods/p/log") == 403
        r = await c.get("/api/v1/namespaces/other/pods/p/log")
        assert r.json()["message"] == (
            'pods "p" is forbidden: User "u" cannot get resource "pods/log" in API group "" '
            'in the namespace "other"')


async def test_cluster_roles_bound_in_a_namespace_and_groups(rbac_kube: FakeKube) -> None:
    rbac_kube.put_object(role("reader", [
        {"apiGroups": ["*"], "resources": ["*"], "verbs": ["get", "list"]}], namespace=None))
    rbac_kube.put_object(binding("sa-read", "ClusterRole", "reader", [
        {"kind": "Group", "name": "system:serviceaccounts:other"}], namespace="default"))
    rbac_kube.put_object(binding("all-sa", "ClusterRole", "reader", [
        {"kind": "ServiceAccount", "name": "x"}], namespace="nodeagent"))
    rbac_kube.add_service_account_token("a", namespace="other", service_account="any")
    rbac_kube.add_service_account_token("x", namespace="nodeagent", service_account="x")
    async with client(rbac_kube, "a") as a, client(rbac_kube, "x") as x:
        assert await status_of(a, "GET", "/api/v1/namespaces/default/secrets") == 200
        assert await status_of(a, "GET", "/apis/apps/v1/namespaces/default/deployments") == 200
        assert await status_of(a, "GET", "/api/v1/namespaces/other/secrets") == 403
        assert await status_of(a, "GET", "/api/v1/secrets") == 403  # cluster-wide
        assert await status_of(a, "GET", "/api/v1/nodes") == 403  # cluster-scoped
        assert await status_of(a, "GET", "/api/v1/namespaces/default") == 200  # its namespace
        # The ServiceAccount subject's namespace defaults to the RoleBinding's.
        assert await status_of(x, "GET", "/api/v1/namespaces/nodeagent/configmaps") == 200
        assert await status_of(x, "GET", "/api/v1/namespaces/default/configmaps") == 403
        # Discovery and health come from the bootstrap policy (system:authenticated).
        assert await status_of(x, "GET", "/apis") == 200
        assert await status_of(x, "GET", "/api/v1") == 200
        assert await status_of(x, "GET", "/healthz") == 200
        r = await x.get("/metrics")
        assert r.status_code == 403
        assert r.json()["message"] == (
            'forbidden: User "system:serviceaccount:nodeagent:x" cannot get path "/metrics"')


async def test_binding_to_a_missing_role_says_so(rbac_kube: FakeKube) -> None:
    rbac_kube.put_object(binding("b", "Role", "nope", [{"kind": "User", "name": "u"}]))
    rbac_kube.add_token("u", username="u")
    async with client(rbac_kube, "u") as c:
        r = await c.get("/api/v1/namespaces/default/pods")
    assert r.status_code == 403
    assert r.json()["message"].endswith(
        'in the namespace "default": RBAC: role.rbac.authorization.k8s.io "nope" not found')


async def test_masters_and_rbac_off(rbac_kube: FakeKube, fake_kube: FakeKube) -> None:
    async with client(rbac_kube, ADMIN_TOKEN) as admin:
        assert await status_of(admin, "DELETE", "/api/v1/nodes/n") == 404
    fake_kube.add_token("u", username="u")
    async with client(fake_kube, "u") as c:  # without rbac=True everyone may do anything
        assert await status_of(c, "GET", "/api/v1/secrets") == 200


async def test_impersonation(rbac_kube: FakeKube) -> None:
    rbac_kube.put_object(role("r", [{"apiGroups": [""], "resources": ["configmaps"],
                                     "verbs": ["list"]}]))
    rbac_kube.put_object(binding("b", "Role", "r", [
        {"kind": "ServiceAccount", "name": "sa", "namespace": "default"},
        {"kind": "Group", "name": "team"}]))
    rbac_kube.add_token("u", username="u")
    cms = "/api/v1/namespaces/default/configmaps"
    async with client(rbac_kube, ADMIN_TOKEN) as admin, client(rbac_kube, "u") as u:
        as_sa = {"Impersonate-User": "system:serviceaccount:default:sa"}
        assert await status_of(admin, "GET", cms, headers=as_sa) == 200
        r = await admin.get("/api/v1/namespaces/default/secrets", headers=as_sa)
        assert r.status_code == 403
        assert 'User "system:serviceaccount:default:sa" cannot list' in r.json()["message"]
        assert await status_of(admin, "GET", cms, headers={"Impersonate-User": "bob"}) == 403
        r = await admin.get(cms, headers=[("Impersonate-User", "bob"),
                                          ("Impersonate-Group", "x"),
                                          ("Impersonate-Group", "team")])
        assert r.status_code == 200
        assert rbac_kube.requests[-1].user == "bob"
        r = await u.get(cms, headers={"Impersonate-User": "bob"})
        assert r.status_code == 403
        assert r.json()["message"] == (
            'users "bob" is forbidden: User "u" cannot impersonate resource "users" in API '
            'group "" at the cluster scope')
        r = await admin.get(cms, headers={"Impersonate-Group": "team"})
        assert r.status_code == 400


# -- access reviews ----------------------------------------------------------------------------

AUTHZ = "/apis/authorization.k8s.io/v1"


async def test_subject_access_reviews_answer_from_rbac(rbac_kube: FakeKube) -> None:
    for doc in yaml.safe_load_all(MANIFEST_RBAC.read_text()):
        if doc:
            rbac_kube.put_object(doc)
    sa_groups = ["system:serviceaccounts", "system:serviceaccounts:nodeagent",
                 "system:authenticated"]

    def sar(**attrs: str) -> dict[str, Any]:
        return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": {"user": CONTROLLER, "groups": sa_groups, "resourceAttributes": attrs}}

    async with client(rbac_kube, ADMIN_TOKEN) as admin:
        r = await admin.post(f"{AUTHZ}/subjectaccessreviews", json=sar(
            verb="list", group="networking.k8s.io", resource="ingresses"))
        assert r.status_code == 201, r.text
        assert r.json()["status"] == {
            "allowed": True,
            "reason": 'RBAC: allowed by ClusterRoleBinding "nodeagent-controller" of '
                      'ClusterRole "nodeagent-controller" to ServiceAccount '
                      '"nodeagent-controller/nodeagent"'}
        r = await admin.post(f"{AUTHZ}/subjectaccessreviews", json=sar(
            verb="update", resource="secrets", namespace="nodeagent"))
        assert r.json()["status"] == {"allowed": False}
        r = await admin.post(f"{AUTHZ}/subjectaccessreviews", json=sar(
            verb="create", group="coordination.k8s.io", resource="leases",
            namespace="nodeagent"))
        assert r.json()["status"]["reason"] == (
            'RBAC: allowed by RoleBinding "nodeagent-controller/nodeagent" of Role '
            '"nodeagent-controller" to ServiceAccount "nodeagent-controller/nodeagent"')
        r = await admin.post(f"{AUTHZ}/namespaces/nodeagent/localsubjectaccessreviews",
                             json={"spec": {"user": CONTROLLER, "resourceAttributes": {
                                 "verb": "get", "resource": "secrets"}}})
        assert r.status_code == 201 and r.json()["status"]["allowed"] is True
        assert r.json()["metadata"]["namespace"] == "nodeagent"
        r = await admin.post(f"{AUTHZ}/subjectaccessreviews",
                             json={"spec": {"user": CONTROLLER}})
        assert r.status_code == 422 and r.json()["reason"] == "Invalid"
        r = await admin.post(f"{AUTHZ}/subjectaccessreviews", json={
            "spec": {"resourceAttributes": {"verb": "get", "resource": "pods"}}})
        assert r.status_code == 422
        assert "at least one of user or group" in r.json()["message"]
        assert await status_of(admin, "GET", f"{AUTHZ}/subjectaccessreviews") == 405
    rbac_kube.add_service_account_token("ctl", namespace="nodeagent",
                                        service_account="nodeagent-controller")
    async with client(rbac_kube, "ctl") as ctl:
        r = await ctl.post(f"{AUTHZ}/selfsubjectaccessreviews", json={"spec": {
            "nonResourceAttributes": {"verb": "get", "path": "/apis/apps"}}})
        assert r.status_code == 201, r.text
        assert r.json()["status"]["allowed"] is True
        r = await ctl.post(f"{AUTHZ}/selfsubjectaccessreviews", json={"spec": {
            "resourceAttributes": {"verb": "delete", "resource": "nodes"}}})
        assert r.json()["status"] == {"allowed": False}
        # Reviewing someone else needs create on subjectaccessreviews.
        assert await status_of(ctl, "POST", f"{AUTHZ}/subjectaccessreviews", json=sar(
            verb="get", resource="pods")) == 403


# -- bound ServiceAccount tokens ---------------------------------------------------------------


async def test_pod_bound_token_dies_with_its_pod(fake_kube: FakeKube) -> None:
    pods = "/api/v1/namespaces/default/pods"
    reviews = "/apis/authentication.k8s.io/v1/tokenreviews"
    async with client(fake_kube, ADMIN_TOKEN) as admin:
        pod = (await admin.post(pods, json={"metadata": {"name": "agent-1"}})).json()

        async def review(token: str) -> dict[str, Any]:
            r = await admin.post(reviews, json={"spec": {"token": token}})
            assert r.status_code == 201
            status: dict[str, Any] = r.json()["status"]
            return status

        info = fake_kube.add_service_account_token("bound", namespace="default",
                                                   service_account="agent",
                                                   pod_name="agent-1", node_name="edge-1")
        assert info.extra["authentication.kubernetes.io/pod-uid"] == [pod["metadata"]["uid"]]
        ok = await review("bound")
        assert ok["authenticated"] is True
        assert ok["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["agent-1"]
        async with client(fake_kube, "bound") as bound:
            assert await status_of(bound, "GET", "/api/v1/namespaces/default/configmaps") == 200
            assert await status_of(admin, "DELETE", f"{pods}/agent-1") == 200
            gone = await review("bound")
            assert gone == {"user": {}, "error": "[invalid bearer token, service account "
                                                 "token has been invalidated]"}
            r = await bound.get("/api/v1/namespaces/default/configmaps")
            assert r.status_code == 401 and r.json()["reason"] == "Unauthorized"
            # A new pod of the same name has another uid: the old token stays dead.
            await admin.post(pods, json={"metadata": {"name": "agent-1"}})
            assert "invalidated" in (await review("bound"))["error"]
            assert await status_of(bound, "GET", "/api/v1/namespaces/default/pods") == 401
        # A token minted for the new pod works.
        fake_kube.add_service_account_token("fresh", namespace="default",
                                            service_account="agent", pod_name="agent-1")
        assert (await review("fresh"))["authenticated"] is True


async def test_expired_token_fails_review_and_requests(fake_kube: FakeKube) -> None:
    info = fake_kube.add_service_account_token("t", namespace="default",
                                               service_account="agent",
                                               expires_at=time.time() + 600)
    reviews = "/apis/authentication.k8s.io/v1/tokenreviews"
    async with client(fake_kube, ADMIN_TOKEN) as admin, client(fake_kube, "t") as t:
        assert (await admin.post(reviews, json={"spec": {"token": "t"}})).json()[
            "status"]["authenticated"] is True
        assert await status_of(t, "GET", "/api/v1/namespaces/default/pods") == 200
        info.expires_at = time.time() - 1
        status = (await admin.post(reviews, json={"spec": {"token": "t"}})).json()["status"]
        assert status == {"user": {}, "error": "[invalid bearer token, service account token "
                                               "has expired]"}
        assert await status_of(t, "GET", "/api/v1/namespaces/default/pods") == 401
