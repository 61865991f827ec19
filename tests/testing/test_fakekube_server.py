"""The fake API server keeps the guarantees of the real one (so tests against it mean
something). Spoken to with raw httpx, independent of nodeagent's client."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from nodeagent.testing.fakekube import FakeKube, Store
from nodeagent.testing.fakekube.fixtures import ADMIN_TOKEN
from nodeagent.testing.fakekube.selectors import SelectorError, labels_match, parse_label_selector

CM = "/api/v1/namespaces/default/configmaps"
ING = "/apis/networking.k8s.io/v1/namespaces/default/ingresses"


@pytest.fixture
async def api(fake_kube: FakeKube) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fake_kube.url, timeout=10,
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
        yield c


def cm(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "labels": labels}, "data": {"a": "1"}}


def rv(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


async def watch_lines(api: httpx.AsyncClient, path: str, *, count: int,
                      **params: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with trio.fail_after(5):
        async with api.stream("GET", path, params={"watch": "true", **params}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line:
                    out.append(json.loads(line))
                if len(out) == count:
                    break
    return out


async def test_versions_metadata_and_generation(api: httpx.AsyncClient) -> None:
    a = (await api.post(CM, json=cm("a"))).json()
    n = (await api.post("/api/v1/nodes", json={"metadata": {"name": "n"}})).json()
    b = (await api.post(CM, json=cm("b"))).json()
    assert rv(a) < rv(n) < rv(b)  # one global revision across types
    meta = a["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z") and meta["generation"] == 1
    listed = (await api.get(CM)).json()
    assert listed["kind"] == "ConfigMapList" and int(listed["metadata"]["resourceVersion"]) == rv(b)
    assert "kind" not in listed["items"][0]  # built-in list items carry no TypeMeta

    a["data"] = {"a": "2"}
    a2 = (await api.put(f"{CM}/a", json=a)).json()
    assert a2["metadata"]["generation"] == 2 and rv(a2) > rv(b)
    a2["metadata"]["labels"] = {"x": "y"}
    a3 = (await api.put(f"{CM}/a", json=a2)).json()
    assert a3["metadata"]["generation"] == 2  # metadata-only change
    same = (await api.put(f"{CM}/a", json=a3)).json()
    assert rv(same) == rv(a3)  # a no-op write is not a write
    a3["metadata"]["uid"] = "other"
    assert (await api.put(f"{CM}/a", json=a3)).status_code == 409


async def test_errors_are_status_objects(api: httpx.AsyncClient) -> None:
    r = await api.get(f"{CM}/missing")
    assert r.status_code == 404
    assert r.json() == {"kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "message": 'configmaps "missing" not found',
                        "reason": "NotFound", "details": {"name": "missing",
                                                          "kind": "configmaps"},
                        "code": 404}
    assert (await api.get("/apis/nope.io/v1/things")).status_code == 404
    assert (await api.get("/api/v1/configmaps/a")).status_code == 404  # needs a namespace
    assert (await api.get("/api/v1/namespaces/default/nodes")).status_code == 404
    assert (await api.post(f"{CM}/x")).status_code == 405
    assert (await api.post(CM, content=b"{not json")).json()["reason"] == "BadRequest"
    r = await api.post(CM, json=cm("Bad_Name"))
    assert r.status_code == 422 and r.json()["details"]["causes"][0]["field"] == "metadata.name"
    r = await api.post("/api/v1/namespaces/nowhere/configmaps", json=cm("a"))
    assert r.status_code == 404 and r.json()["message"] == 'namespaces "nowhere" not found'


async def test_create_with_generate_name(api: httpx.AsyncClient) -> None:
    r = await api.post(CM, json={"metadata": {"generateName": "gen-"}})
    assert r.status_code == 201
    name = r.json()["metadata"]["name"]
    assert name.startswith("gen-") and len(name) == 9


async def test_finalizers_hold_deletion(api: httpx.AsyncClient, fake_kube: FakeKube) -> None:
    obj = cm("f")
    obj["metadata"]["finalizers"] = ["nodeagent.io/cleanup"]
    created = (await api.post(CM, json=obj)).json()
    r = await api.delete(f"{CM}/f")
    assert r.status_code == 202 and r.json()["metadata"]["deletionTimestamp"]
    marked = (await api.get(f"{CM}/f")).json()
    assert marked["metadata"]["deletionTimestamp"] and rv(marked) > rv(created)
    again = await api.delete(f"{CM}/f")  # deleting again changes nothing
    assert again.status_code == 202 and rv(again.json()) == rv(marked)
    r = await api.patch(f"{CM}/f", json={"metadata": {"finalizers": ["a", "b"]}},
                        headers={"Content-Type": "application/merge-patch+json"})
    assert r.status_code == 422 and "no new finalizers" in r.json()["message"]
    r = await api.patch(f"{CM}/f", json={"metadata": {"finalizers": None}},
                        headers={"Content-Type": "application/merge-patch+json"})
    assert r.status_code == 200
    assert (await api.get(f"{CM}/f")).status_code == 404
    events = await watch_lines(api, CM, count=2, resourceVersion=str(rv(created)))
    assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]
    assert events[1]["object"]["metadata"]["deletionTimestamp"]


async def test_status_subresource(api: httpx.AsyncClient) -> None:
    ing = {"metadata": {"name": "web"},
           "spec": {"defaultBackend": {"service": {"name": "web", "port": {"number": 80}}}},
           "status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}}
    created = (await api.post(ING, json=ing)).json()
    assert "status" not in created  # reset on create
    created["status"] = {"loadBalancer": {"ingress": [{"ip": "5.6.7.8"}]}}
    created["spec"]["defaultBackend"]["service"]["name"] = "web2"
    updated = (await api.put(f"{ING}/web", json=created)).json()
    assert "status" not in updated and updated["metadata"]["generation"] == 2
    updated["status"] = {"loadBalancer": {"ingress": [{"ip": "5.6.7.8"}]}}
    updated["spec"]["defaultBackend"]["service"]["name"] = "ignored"
    status = (await api.put(f"{ING}/web/status", json=updated)).json()
    assert status["status"]["loadBalancer"]["ingress"][0]["ip"] == "5.6.7.8"
    assert status["spec"]["defaultBackend"]["service"]["name"] == "web2"
    assert status["metadata"]["generation"] == 2
    stale = {**status, "metadata": {**status["metadata"],
                                    "resourceVersion": updated["metadata"]["resourceVersion"]}}
    assert (await api.put(f"{ING}/web/status", json=stale)).status_code == 409
    await api.post(CM, json=cm("s"))
    assert (await api.get(f"{CM}/s/status")).status_code == 404


@pytest.mark.parametrize(("selector", "labels", "expected"), [
    ("a=1", {"a": "1"}, True),
    ("a==1", {"a": "2"}, False),
    ("a!=1", {}, True),
    ("a in (1, 2)", {"a": "2"}, True),
    ("a notin (1,2)", {}, True),
    ("a notin (1,2)", {"a": "1"}, False),
    ("a", {"a": ""}, True),
    ("!a", {"a": "x"}, False),
    ("example.com/role=edge,!b", {"example.com/role": "edge"}, True),
    ("n>3", {"n": "4"}, True),
    ("n<3", {"n": "x"}, False),
])
def test_label_selector_semantics(selector: str, labels: dict[str, str], expected: bool
                                  ) -> None:
    assert labels_match(parse_label_selector(selector), {"metadata": {"labels": labels}}) \
        is expected


@pytest.mark.parametrize("bad", ["a in ()", "a=(", "=x", "a b", "a,,b", "-a=1", "n>x"])
def test_label_selector_errors(bad: str) -> None:
    with pytest.raises(SelectorError):
        parse_label_selector(bad)


async def test_selector_validation_over_http(api: httpx.AsyncClient) -> None:
    r = await api.get(CM, params={"labelSelector": "a in ()"})
    assert r.status_code == 400
    r = await api.get(CM, params={"fieldSelector": "spec.nodeName=x"})
    assert r.status_code == 400 and "field label not supported" in r.json()["message"]
    pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "edge-1"}}
    await api.post("/api/v1/namespaces/default/pods", json=pod)
    r = await api.get("/api/v1/pods", params={"fieldSelector": "spec.nodeName=edge-1"})
    assert [i["metadata"]["name"] for i in r.json()["items"]] == ["p"]
    assert r.json()["items"][0]["status"]["phase"] == "Pending"


async def test_watch_semantics(api: httpx.AsyncClient, fake_kube: FakeKube) -> None:
    a = (await api.post(CM, json=cm("a", app="web"))).json()
    await api.post(CM, json=cm("b", app="db"))
    # No resourceVersion: the current state as synthetic ADDED events first.
    initial = await watch_lines(api, CM, count=2)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in initial] == [
        ("ADDED", "a"), ("ADDED", "b")]
    assert initial[0]["object"]["kind"] == "ConfigMap"  # watch objects carry TypeMeta
    # Leaving / entering a selector looks like DELETED / ADDED to that watch.
    start = (await api.get(CM)).json()["metadata"]["resourceVersion"]
    await api.patch(f"{CM}/a", json={"metadata": {"labels": {"app": "db"}}},
                    headers={"Content-Type": "application/merge-patch+json"})
    await api.patch(f"{CM}/b", json={"metadata": {"labels": {"app": "web"}}},
                    headers={"Content-Type": "application/merge-patch+json"})
    events = await watch_lines(api, CM, count=2, resourceVersion=start,
                               labelSelector="app=web")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("DELETED", "a"), ("ADDED", "b")]
    assert events[0]["object"]["metadata"]["labels"] == {"app": "web"}  # the old content
    assert int(events[0]["object"]["metadata"]["resourceVersion"]) > rv(a)
    # A compacted version: HTTP 200, then an ERROR event with a 410 Status.
    fake_kube.compact()
    [error] = await watch_lines(api, CM, count=1, resourceVersion=start)
    assert error["type"] == "ERROR"
    assert error["object"]["code"] == 410 and error["object"]["reason"] == "Expired"
    # timeoutSeconds ends the stream cleanly.
    with trio.fail_after(3):
        r = await api.get(CM, params={"watch": "1", "timeoutSeconds": "1",
                                      "resourceVersion": str(fake_kube.revision)})
    assert r.status_code == 200 and r.text == ""


async def test_bookmarks_only_when_asked(api: httpx.AsyncClient, fake_kube: FakeKube) -> None:
    now = str(fake_kube.revision)
    with trio.fail_after(3):
        r = await api.get(CM, params={"watch": "1", "timeoutSeconds": "1",
                                      "resourceVersion": now, "allowWatchBookmarks": "true"})
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines and all(e["type"] == "BOOKMARK" for e in lines)
    assert lines[0]["object"] == {"kind": "ConfigMap", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": now}}


async def test_list_pagination_and_exact_reads(api: httpx.AsyncClient,
                                               fake_kube: FakeKube) -> None:
    for i in range(5):
        await api.post(CM, json=cm(f"c{i}"))
    page = (await api.get(CM, params={"limit": "2"})).json()
    assert page["metadata"]["remainingItemCount"] == 3
    snapshot = page["metadata"]["resourceVersion"]
    await api.delete(f"{CM}/c4")
    old = (await api.get(CM, params={"resourceVersion": snapshot,
                                     "resourceVersionMatch": "Exact"})).json()
    assert len(old["items"]) == 5 and old["metadata"]["resourceVersion"] == snapshot
    token = page["metadata"]["continue"]
    rest = (await api.get(CM, params={"limit": "10", "continue": token})).json()
    assert [i["metadata"]["name"] for i in rest["items"]] == ["c2", "c3", "c4"]
    assert "continue" not in rest["metadata"]
    fake_kube.compact()
    r = await api.get(CM, params={"limit": "2", "continue": token})
    assert r.status_code == 410 and r.json()["reason"] == "Expired"
    assert (await api.get(CM, params={"continue": "garbage"})).status_code == 400


async def test_patch_formats(api: httpx.AsyncClient) -> None:
    await api.post(CM, json={"metadata": {"name": "p"}, "data": {"a": "1", "b": "2"}})
    merge = {"Content-Type": "application/merge-patch+json"}
    r = await api.patch(f"{CM}/p", json={"data": {"a": None, "c": "3"}}, headers=merge)
    assert r.json()["data"] == {"b": "2", "c": "3"}
    jp = {"Content-Type": "application/json-patch+json"}
    r = await api.patch(f"{CM}/p", json=[{"op": "test", "path": "/data/b", "value": "2"},
                                         {"op": "replace", "path": "/data/b", "value": "x"},
                                         {"op": "move", "from": "/data/c", "path": "/data/d"}],
                        headers=jp)
    assert r.json()["data"] == {"b": "x", "d": "3"}
    r = await api.patch(f"{CM}/p", json=[{"op": "test", "path": "/data/b", "value": "no"}],
                        headers=jp)
    assert r.status_code == 422
    r = await api.patch(f"{CM}/p", json={"metadata": {"resourceVersion": "1"}}, headers=merge)
    assert r.status_code == 409
    apply = {"Content-Type": "application/apply-patch+yaml"}
    r = await api.patch(f"{CM}/p", content=b"data: {e: '5'}", headers=apply)
    assert r.status_code == 422  # fieldManager is required for apply
    r = await api.patch(f"{CM}/q", content=b"apiVersion: v1\nkind: ConfigMap\ndata: {e: '5'}\n",
                        headers=apply, params={"fieldManager": "m"})
    assert r.status_code == 200 and r.json()["data"] == {"e": "5"}
    r = await api.patch(f"{CM}/p", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415


async def test_crd_lifecycle(api: httpx.AsyncClient, fake_kube: FakeKube) -> None:
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    schema = {"type": "object", "properties": {"spec": {
        "type": "object", "required": ["port"],
        "properties": {"port": {"type": "integer", "minimum": 1, "maximum": 65535},
                       "mode": {"type": "string", "enum": ["tcp", "udp"], "default": "tcp"},
                       "labels": {"type": "object",
                                  "additionalProperties": {"type": "string"}}}}}}
    crd = {"metadata": {"name": "routes.nodeagent.io"},
           "spec": {"group": "nodeagent.io", "scope": "Namespaced",
                    "names": {"plural": "routes", "kind": "Route"},
                    "versions": [{"name": "v1alpha1", "served": True, "storage": True,
                                  "schema": {"openAPIV3Schema": schema}},
                                 {"name": "v1beta1", "served": True, "storage": False,
                                  "schema": {"openAPIV3Schema": schema}}]}}
    bad = json.loads(json.dumps(crd))
    bad["metadata"]["name"] = "wrong.nodeagent.io"
    assert (await api.post(crds, json=bad)).status_code == 422
    assert (await api.post(crds, json=crd)).status_code == 201
    base = "/apis/nodeagent.io/v1alpha1/namespaces/default/routes"
    r = await api.post(base, json={"metadata": {"name": "r"}, "spec": {"port": 80, "x": 1}})
    assert r.status_code == 201
    assert r.json()["spec"] == {"port": 80, "mode": "tcp"}  # pruned and defaulted
    r = await api.post(base, json={"metadata": {"name": "r2"},
                                   "spec": {"port": 0, "mode": "sctp"}})
    assert r.status_code == 422
    fields = {c["field"] for c in r.json()["details"]["causes"]}
    assert fields == {"spec.port", "spec.mode"}
    assert (await api.post(base, json={"metadata": {"name": "r3"}, "spec": {}})).json()[
        "details"]["causes"][0] == {"reason": "FieldValueRequired", "message": "Required value",
                                    "field": "spec.port"}
    r = (await api.get("/apis/nodeagent.io/v1beta1/namespaces/default/routes/r")).json()
    assert r["apiVersion"] == "nodeagent.io/v1beta1"  # served at every version
    listed = (await api.get(base)).json()
    assert listed["items"][0]["kind"] == "Route"  # custom list items keep TypeMeta
    r["metadata"].pop("resourceVersion")
    assert (await api.put(f"{base}/r", json=r)).status_code == 422  # CRs need it on update
    groups = (await api.get("/apis")).json()
    assert "nodeagent.io" in [g["name"] for g in groups["groups"]]
    assert (await api.delete(f"{crds}/routes.nodeagent.io")).status_code == 200
    assert (await api.get(base)).status_code == 404


async def test_namespace_deletion_removes_its_objects(api: httpx.AsyncClient) -> None:
    await api.post("/api/v1/namespaces", json={"metadata": {"name": "team"}})
    ns = (await api.get("/api/v1/namespaces/team")).json()
    assert ns["status"]["phase"] == "Active"
    await api.post("/api/v1/namespaces/team/configmaps", json=cm("x"))
    assert (await api.delete("/api/v1/namespaces/team")).status_code == 200
    assert (await api.get("/api/v1/namespaces/team/configmaps/x")).status_code == 404


async def test_builtin_type_rules(api: httpx.AsyncClient) -> None:
    secrets = "/api/v1/namespaces/default/secrets"
    s = (await api.post(secrets, json={"metadata": {"name": "s"},
                                       "stringData": {"token": "abc"}})).json()
    assert s["data"] == {"token": "YWJj"} and s["type"] == "Opaque" and "stringData" not in s
    assert (await api.post(secrets, json={"metadata": {"name": "b"},
                                          "data": {"k": "%%%"}})).status_code == 400
    r = await api.post(secrets, json={"metadata": {"name": "t"}, "type": "kubernetes.io/tls",
                                      "data": {"tls.crt": "YQ=="}})
    assert r.status_code == 422
    s["type"] = "kubernetes.io/tls"
    assert (await api.put(f"{secrets}/s", json=s)).status_code == 422
    svc = (await api.post("/api/v1/namespaces/default/services", json={
        "metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}})).json()
    assert svc["spec"]["clusterIP"].startswith("10.96.")
    assert svc["spec"]["ports"] == [{"port": 80, "protocol": "TCP", "targetPort": 80}]
    r = await api.post("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
                       json={"metadata": {"name": "web-1"}, "endpoints": []})
    assert r.status_code == 422


async def test_garbage_collection_of_dependents(api: httpx.AsyncClient) -> None:
    owner = (await api.post(CM, json=cm("owner"))).json()
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
           "uid": owner["metadata"]["uid"]}
    dep = cm("dep")
    dep["metadata"]["ownerReferences"] = [ref]
    await api.post(CM, json=dep)
    orphan = cm("orphan")
    orphan["metadata"]["ownerReferences"] = [ref]
    await api.delete(f"{CM}/owner")
    assert (await api.get(f"{CM}/dep")).status_code == 404
    owner = (await api.post(CM, json=cm("owner"))).json()
    orphan["metadata"]["ownerReferences"][0]["uid"] = owner["metadata"]["uid"]
    await api.post(CM, json=orphan)
    await api.request("DELETE", f"{CM}/owner", json={"propagationPolicy": "Orphan"})
    kept = (await api.get(f"{CM}/orphan")).json()
    assert "ownerReferences" not in kept["metadata"]


async def test_token_review(api: httpx.AsyncClient, fake_kube: FakeKube) -> None:
    fake = fake_kube
    fake.validate_bound_pods = True
    fake.add_service_account_token("bound", namespace="default", service_account="agent",
                                   pod_name="agent-1", pod_uid="u1", node_name="edge-1",
                                   audiences=["nodeagent"])
    fake.add_token("old", username="x", audiences=["nodeagent"], expires_at=time.time() - 1)
    reviews = "/apis/authentication.k8s.io/v1/tokenreviews"

    async def review(token: str) -> dict[str, Any]:
        r = await api.post(reviews, json={"apiVersion": "authentication.k8s.io/v1",
                                          "kind": "TokenReview",
                                          "spec": {"token": token, "audiences": ["nodeagent"]}})
        assert r.status_code == 201
        status: dict[str, Any] = r.json()["status"]
        return status

    assert "invalidated" in (await review("bound"))["error"]  # its pod does not exist
    await api.post("/api/v1/namespaces/default/pods", json={"metadata": {"name": "agent-1"}})
    assert "error" in await review("bound")  # a pod of that name, but another uid
    fake.tokens["bound"].pod = ("default", "agent-1", "")
    ok = await review("bound")
    assert ok["authenticated"] and ok["user"]["extra"][
        "authentication.kubernetes.io/node-name"] == ["edge-1"]
    assert not (await review("old")).get("authenticated")
    assert (await api.post(reviews, json={"spec": {}})).status_code == 422
    assert (await api.get(reviews)).status_code == 405


async def test_authentication(fake_kube: FakeKube) -> None:
    async with httpx.AsyncClient(base_url=fake_kube.url) as anon:
        r = await anon.get("/api/v1/nodes")
        assert r.status_code == 401 and r.json()["reason"] == "Unauthorized"
        r = await anon.get("/api/v1/nodes", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        # A token for another audience is not an API credential.
        fake_kube.add_token("agent", username="agent", audiences=["nodeagent"])
        r = await anon.get("/api/v1/nodes", headers={"Authorization": "Bearer agent"})
        assert r.status_code == 401


async def test_discovery(api: httpx.AsyncClient) -> None:
    assert (await api.get("/version")).json()["major"] == "1"
    assert (await api.get("/api")).json()["versions"] == ["v1"]
    group = (await api.get("/apis/coordination.k8s.io")).json()
    assert group["preferredVersion"]["groupVersion"] == "coordination.k8s.io/v1"
    resources = (await api.get("/apis/networking.k8s.io/v1")).json()["resources"]
    assert {"ingresses", "ingresses/status", "ingressclasses"} <= {r["name"] for r in resources}
    assert (await api.get("/healthz")).text == "ok"


async def test_fault_injection(api: httpx.AsyncClient, fake_kube: FakeKube) -> None:
    fake_kube.fail_next(2, status=503, method="GET")
    assert (await api.post(CM, json=cm("f"))).status_code == 201  # not a GET
    assert [(await api.get(CM)).status_code for _ in range(3)] == [503, 503, 200]
    fake_kube.delay = 0.2
    start = trio.current_time()
    await api.get(CM)
    assert trio.current_time() - start >= 0.2
    fake_kube.clear_faults()
    fake_kube.deny(verb="delete", resource="configmaps", user="admin")
    r = await api.delete(f"{CM}/f")
    assert r.status_code == 403 and r.json()["reason"] == "Forbidden"
    assert [str(x).split(" -> ")[1] for x in fake_kube.requests[-2:]] == ["200", "403"]


def test_compaction_and_history_limit() -> None:
    store = Store(history_limit=5)
    cms = store.types[("", "configmaps")]
    for i in range(10):
        store.create(cms, "v1", "default", {"metadata": {"name": f"c{i}"}})
    assert store.compacted == store.revision - 5
    assert store.list(cms, "v1", "default")["metadata"]["resourceVersion"] == str(
        store.revision)
    with pytest.raises(Exception, match="too old resource version"):
        store.watch(cms, "v1", None, resource_version=str(store.compacted - 1))
    watcher = store.watch(cms, "v1", None, resource_version=str(store.compacted))
    assert watcher.pending == 5


async def test_slow_watchers_are_dropped() -> None:
    store = Store(watch_queue_limit=3)
    cms = store.types[("", "configmaps")]
    watcher = store.watch(cms, "v1", None, resource_version=str(store.revision))
    for i in range(5):
        store.create(cms, "v1", "default", {"metadata": {"name": f"c{i}"}})
    assert watcher.overflowed
    received = [await watcher.receive.receive() for _ in range(3)]
    assert len(received) == 3
    with pytest.raises(trio.EndOfChannel):
        await watcher.receive.receive()


async def test_direct_store_helpers_for_test_setup(fake_kube: FakeKube) -> None:
    node = fake_kube.put_object({"apiVersion": "v1", "kind": "Node",
                                 "metadata": {"name": "edge-1"},
                                 "status": {"addresses": [{"type": "InternalIP",
                                                           "address": "10.0.0.5"}]}})
    assert node["status"]["addresses"][0]["address"] == "10.0.0.5"
    svc = fake_kube.put_object({"apiVersion": "v1", "kind": "Service",
                                "metadata": {"name": "web", "namespace": "default"},
                                "spec": {"ports": [{"port": 80}]},
                                "status": {"loadBalancer": {"ingress": [{"ip": "1.1.1.1"}]}}})
    assert svc["status"]["loadBalancer"]["ingress"] == [{"ip": "1.1.1.1"}]
    updated = fake_kube.put_object({**svc, "status": {"loadBalancer": {}}})
    assert updated["status"] == {"loadBalancer": {}} and rv(updated) > rv(svc)
    assert [o["metadata"]["name"] for o in fake_kube.objects("services")] == ["web"]
    assert fake_kube.get_object("nodes", "edge-1") is not None
    fake_kube.delete_object("nodes", "edge-1")
    assert fake_kube.get_object("nodes", "edge-1") is None


TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"


async def test_table_output(api: httpx.AsyncClient) -> None:
    await api.post(CM, json=cm("a"))
    t = (await api.get(CM, headers={"Accept": TABLE})).json()
    assert t["kind"] == "Table" and t["apiVersion"] == "meta.k8s.io/v1"
    assert [c["name"] for c in t["columnDefinitions"]] == ["Name", "Data", "Age"]
    assert t["rows"][0]["cells"][:2] == ["a", 1]
    assert t["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    assert t["metadata"]["resourceVersion"]
    one = (await api.get(f"{CM}/a", headers={"Accept": TABLE},
                         params={"includeObject": "Object"})).json()
    assert one["rows"][0]["object"]["data"] == {"a": "1"}
    r = await api.get(CM, headers={"Accept": TABLE}, params={"includeObject": "Everything"})
    assert r.status_code == 400
    plain = (await api.get(CM, headers={"Accept": "application/json"})).json()
    assert plain["kind"] == "ConfigMapList"


def test_printer_column_jsonpath() -> None:
    from nodeagent.testing.fakekube.table import evaluate, human_duration, parse_jsonpath
    obj = {"status": {"conditions": [{"type": "A", "status": "False"},
                                     {"type": "Ready", "status": "True"}], "n": 0}}
    assert evaluate(parse_jsonpath('.status.conditions[?(@.type=="Ready")].status'),
                    obj) == ["True"]
    assert evaluate(parse_jsonpath(".status.conditions[*].type"), obj) == ["A", "Ready"]
    assert evaluate(parse_jsonpath(".status.conditions[-1].type"), obj) == ["Ready"]
    assert evaluate(parse_jsonpath(".status.n"), obj) == [0]
    assert evaluate(parse_jsonpath(".status.missing"), obj) == []
    with pytest.raises(ValueError, match="unsupported JSONPath"):
        parse_jsonpath(".a..b")
    assert [human_duration(s) for s in (5, 150, 3600 * 5 + 60, 86400 * 3)] == [
        "5s", "2m30s", "5h1m", "3d"]
