"""KubeClient against the fake API server: requests, typed errors, pagination, watch."""

from __future__ import annotations

import threading

import pytest
import trio

from nodeagent.kube import (
    CONFIGMAPS,
    EVENTS,
    INGRESSES,
    LEASES,
    NODES,
    SECRETS,
    AlreadyExists,
    ApiUnreachable,
    Conflict,
    Credentials,
    Forbidden,
    Gone,
    Invalid,
    KubeClient,
    NotFound,
    ServerError,
    Unauthorized,
    custom_resource,
)
from nodeagent.testing.fakekube import FakeKube
from tests.kube.helpers import configmap, names, node, secret


async def test_httpx_runs_on_trio_backend_without_threads(kube: KubeClient,
                                                          fake_kube: FakeKube) -> None:
    await kube.list(NODES)
    pool = kube._http._transport._pool  # type: ignore[attr-defined]
    assert type(pool._network_backend._backend).__name__ == "TrioBackend"
    threads = threading.active_count()
    async with trio.open_nursery() as nursery:
        for _ in range(20):
            async def watch() -> None:
                async with kube.watch(CONFIGMAPS, timeout_seconds=30) as stream:
                    async for _ in stream:
                        pass
            nursery.start_soon(watch)
        await fake_kube.wait_for_watches(20)
        assert threading.active_count() == threads  # a watch is a task, not a thread
        nursery.cancel_scope.cancel()


async def test_crud_and_typed_errors(kube: KubeClient) -> None:
    created = await kube.create(CONFIGMAPS, configmap("a"))
    assert created["kind"] == "ConfigMap" and created["apiVersion"] == "v1"
    assert created["metadata"]["uid"] and created["metadata"]["resourceVersion"]
    with pytest.raises(AlreadyExists) as exc:
        await kube.create(CONFIGMAPS, configmap("a"))
    assert isinstance(exc.value, Conflict) and exc.value.status == 409
    got = await kube.get(CONFIGMAPS, "a", namespace="default")
    assert got == created
    with pytest.raises(NotFound) as missing:
        await kube.get(CONFIGMAPS, "nope", namespace="default")
    assert missing.value.reason == "NotFound"
    assert missing.value.message == 'configmaps "nope" not found'

    got["data"] = {"v": "2"}
    updated = await kube.update(CONFIGMAPS, got)
    assert int(updated["metadata"]["resourceVersion"]) > int(got["metadata"]["resourceVersion"])
    with pytest.raises(Conflict) as stale:
        await kube.update(CONFIGMAPS, got)  # got still carries the old resourceVersion
    assert stale.value.reason == "Conflict"
    assert "the object has been modified" in stale.value.message

    deleted = await kube.delete(CONFIGMAPS, "a", namespace="default")
    assert deleted["metadata"]["name"] == "a"
    with pytest.raises(NotFound):
        await kube.delete(CONFIGMAPS, "a", namespace="default")


async def test_delete_preconditions(kube: KubeClient) -> None:
    created = await kube.create(CONFIGMAPS, configmap("p"))
    with pytest.raises(Conflict):
        await kube.delete(CONFIGMAPS, "p", namespace="default", uid="not-the-uid")
    with pytest.raises(Conflict):
        await kube.delete(CONFIGMAPS, "p", namespace="default", resource_version="1")
    await kube.delete(CONFIGMAPS, "p", namespace="default", uid=created["metadata"]["uid"],
                      resource_version=created["metadata"]["resourceVersion"])


async def test_invalid_forbidden_server_error(kube: KubeClient, fake_kube: FakeKube) -> None:
    bad = {"metadata": {"name": "web", "namespace": "default"},
           "spec": {"rules": [{"http": {"paths": [
               {"path": "no-slash", "pathType": "Prefix",
                "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}}
    with pytest.raises(Invalid) as invalid:
        await kube.create(INGRESSES, bad)
    causes = invalid.value.details["causes"]
    assert causes[0]["field"] == "spec.rules[0].http.paths[0].path"

    fake_kube.deny(verb="list", resource="secrets")
    with pytest.raises(Forbidden) as forbidden:
        await kube.list(SECRETS)
    assert 'cannot list resource "secrets"' in forbidden.value.message
    fake_kube.clear_faults()

    fake_kube.fail_next(1, status=500)
    with pytest.raises(ServerError) as server_error:
        await kube.list(SECRETS)
    assert server_error.value.status == 500
    fake_kube.fail_next(1, status=429)
    with pytest.raises(ServerError):
        await kube.list(SECRETS)
    await kube.list(SECRETS)


async def test_unauthorized_and_unreachable(fake_kube: FakeKube) -> None:
    creds = Credentials(server=fake_kube.url, ssl_context=None, auth=None)
    async with KubeClient(creds) as anonymous:
        with pytest.raises(Unauthorized):
            await anonymous.list(NODES)
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    async with KubeClient(Credentials(server=f"http://127.0.0.1:{port}", ssl_context=None,
                                      auth=None)) as nowhere:
        with pytest.raises(ApiUnreachable) as unreachable:
            await nowhere.list(NODES)
        assert unreachable.value.status == 0


async def test_paginated_list_is_one_snapshot(kube: KubeClient, fake_kube: FakeKube) -> None:
    for i in range(7):
        await kube.create(CONFIGMAPS, configmap(f"cm-{i}"))
    fake_kube.clear_requests()
    result = await kube.list(CONFIGMAPS, namespace="default", limit=3)
    assert names(result.items) == [f"cm-{i}" for i in range(7)]
    assert all(item["kind"] == "ConfigMap" and item["apiVersion"] == "v1"
               for item in result.items)
    pages = fake_kube.requests_matching(method="GET", path="/configmaps")
    assert [r.query.get("limit") for r in pages] == ["3", "3", "3"]
    assert [bool(r.query.get("continue")) for r in pages] == [False, True, True]

    # A page fetched later still shows the first page's snapshot.
    first = await kube.list_page(CONFIGMAPS, namespace="default", limit=3)
    assert first.remaining_item_count == 4
    await kube.delete(CONFIGMAPS, "cm-5", namespace="default")
    await kube.create(CONFIGMAPS, configmap("cm-9"))
    rest = await kube.list_page(CONFIGMAPS, namespace="default", limit=10,
                                continue_token=first.continue_token)
    assert names(rest.items) == ["cm-3", "cm-4", "cm-5", "cm-6"]
    assert rest.resource_version == first.resource_version

    # Once compacted, the token is expired: 410, start again.
    fake_kube.compact()
    with pytest.raises(Gone):
        await kube.list_page(CONFIGMAPS, namespace="default", limit=3,
                             continue_token=first.continue_token)


async def test_selectors(kube: KubeClient) -> None:
    await kube.create(CONFIGMAPS, configmap("a", app="web", tier="front"))
    await kube.create(CONFIGMAPS, configmap("b", app="web", tier="back"))
    await kube.create(CONFIGMAPS, configmap("c", app="db"))
    await kube.create(CONFIGMAPS, configmap("d", namespace="kube-system", app="web"))

    async def select(**kw: object) -> list[str]:
        return names((await kube.list(CONFIGMAPS, **kw)).items)  # type: ignore[arg-type]

    assert await select(label_selector={"app": "web"}) == ["a", "b", "d"]
    assert await select(label_selector="app=web,tier!=front") == ["b", "d"]
    assert await select(label_selector="tier in (front,back)") == ["a", "b"]
    assert await select(label_selector="tier notin (front)") == ["b", "c", "d"]
    assert await select(label_selector="tier") == ["a", "b"]
    assert await select(label_selector="!tier") == ["c", "d"]
    assert await select(field_selector="metadata.name=c") == ["c"]
    assert await select(field_selector="metadata.namespace!=default") == ["d"]
    assert await select(namespace="default", label_selector="app==web") == ["a", "b"]


async def test_watch_events_in_order(kube: KubeClient) -> None:
    start = (await kube.list(CONFIGMAPS)).resource_version
    await kube.create(CONFIGMAPS, configmap("w"))
    await kube.patch(CONFIGMAPS, "w", {"data": {"v": "2"}}, namespace="default")
    await kube.delete(CONFIGMAPS, "w", namespace="default")
    seen = []
    async with kube.watch(CONFIGMAPS, resource_version=start, timeout_seconds=5) as stream:
        async for event in stream:
            seen.append((event.type, event.object["metadata"]["name"], event.resource_version))
            if event.type == "DELETED":
                break
    assert [t for t, _, _ in seen] == ["ADDED", "MODIFIED", "DELETED"]
    versions = [int(v) for _, _, v in seen]
    assert versions == sorted(versions) and versions[0] > int(start)


async def test_bookmarks_advance_the_version(kube: KubeClient) -> None:
    start = (await kube.list(CONFIGMAPS)).resource_version
    for i in range(3):  # writes to another type move the global revision
        await kube.create(SECRETS, secret(f"s{i}"))
    async with kube.watch(CONFIGMAPS, resource_version=start, timeout_seconds=5) as stream:
        async for event in stream:
            assert event.type == "BOOKMARK"
            assert event.object["kind"] == "ConfigMap"
            assert int(event.resource_version) >= int(start) + 3
            break


async def test_watch_without_bookmarks_sends_none(kube: KubeClient) -> None:
    with trio.move_on_after(0.6):
        async with kube.watch(CONFIGMAPS, resource_version="0", allow_bookmarks=False,
                              timeout_seconds=5) as stream:
            async for event in stream:
                pytest.fail(f"unexpected {event}")


async def test_watch_ends_at_server_timeout(kube: KubeClient) -> None:
    with trio.fail_after(3):
        async with kube.watch(CONFIGMAPS, timeout_seconds=1, allow_bookmarks=False) as stream:
            async for _ in stream:
                pass  # ends cleanly: no exception


async def test_watch_from_compacted_version_raises_gone(kube: KubeClient,
                                                        fake_kube: FakeKube) -> None:
    start = (await kube.list(CONFIGMAPS)).resource_version
    await kube.create(CONFIGMAPS, configmap("x"))
    fake_kube.compact()
    with pytest.raises(Gone) as gone:
        async with kube.watch(CONFIGMAPS, resource_version=start) as stream:
            async for _ in stream:
                pass
    assert gone.value.status == 410 and "too old resource version" in gone.value.message
    fake_kube.gone_as_http_status = True
    with pytest.raises(Gone):
        async with kube.watch(CONFIGMAPS, resource_version=start) as stream:
            async for _ in stream:
                pass


async def test_dropped_watch_raises_unreachable(kube: KubeClient, fake_kube: FakeKube) -> None:
    with pytest.raises(ApiUnreachable):
        async with kube.watch(CONFIGMAPS, timeout_seconds=30) as stream:
            await fake_kube.wait_for_watches(1)
            fake_kube.drop_watches()
            async for _ in stream:
                pass


async def test_patches_and_status(kube: KubeClient) -> None:
    await kube.create(NODES, node("n1", zone="a"))
    n = await kube.patch(NODES, "n1", {"metadata": {"labels": {"zone": None, "role": "edge"}}})
    assert n["metadata"]["labels"] == {"role": "edge"}
    n = await kube.patch(NODES, "n1", [{"op": "add", "path": "/spec", "value":
                                        {"unschedulable": True}}], patch_type="json")
    assert n["spec"] == {"unschedulable": True}
    n["status"] = {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}
    n2 = await kube.update(NODES, n)  # main resource: status is ignored
    assert n2["status"]["addresses"][0]["address"] == "10.0.0.1"
    n2["status"] = {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}
    n2["metadata"]["labels"]["ignored"] = "yes"
    n3 = await kube.update_status(NODES, n2)  # status subresource: only status
    assert n3["status"]["addresses"][0]["address"] == "10.9.9.9"
    assert "ignored" not in n3["metadata"]["labels"]
    n4 = await kube.patch(NODES, "n1", {"status": {"phase": "Running"}}, subresource="status")
    assert n4["status"]["phase"] == "Running"


async def test_server_side_apply(kube: KubeClient) -> None:
    lease = {"metadata": {"name": "l", "namespace": "default"},
             "spec": {"holderIdentity": "a", "leaseDurationSeconds": 10}}
    created = await kube.apply(LEASES, lease, field_manager="me")
    assert created["spec"]["holderIdentity"] == "a"
    lease["spec"] = {"holderIdentity": "b"}
    applied = await kube.apply(LEASES, lease, field_manager="me")
    # Fields this manager applied before and left out now are removed.
    assert applied["spec"] == {"holderIdentity": "b"}
    other = await kube.apply(LEASES, {"metadata": {"name": "l", "namespace": "default"},
                                      "spec": {"leaseTransitions": 3}}, field_manager="other")
    assert other["spec"] == {"holderIdentity": "b", "leaseTransitions": 3}


async def test_custom_resources(kube: KubeClient, fake_kube: FakeKube) -> None:
    from nodeagent.kube import CUSTOMRESOURCEDEFINITIONS

    crd = {"metadata": {"name": "clustertunnels.nodeagent.io"},
           "spec": {"group": "nodeagent.io", "scope": "Cluster",
                    "names": {"plural": "clustertunnels", "kind": "ClusterTunnel",
                              "singular": "clustertunnel"},
                    "versions": [{"name": "v1alpha1", "served": True, "storage": True,
                                  "subresources": {"status": {}},
                                  "schema": {"openAPIV3Schema": {"type": "object",
                                             "properties": {"spec": {
                                                 "type": "object",
                                                 "properties": {"server": {"type": "string"}}},
                                                 "status": {"type": "object",
                                                            "x-kubernetes-preserve-unknown-fields":
                                                            True}}}}}]}}
    await kube.create(CUSTOMRESOURCEDEFINITIONS, crd)
    got = await kube.get(CUSTOMRESOURCEDEFINITIONS, "clustertunnels.nodeagent.io")
    established = {c["type"]: c["status"] for c in got["status"]["conditions"]}
    assert established["Established"] == "True"
    tunnels = custom_resource("clustertunnels", "ClusterTunnel", namespaced=False)
    ct = await kube.create(tunnels, {"metadata": {"name": "main"},
                                     "spec": {"server": "tunnel.example.com", "junk": 1}})
    assert ct["spec"] == {"server": "tunnel.example.com"}  # unknown fields pruned
    listed = await kube.list(tunnels)
    assert listed.items[0]["kind"] == "ClusterTunnel"
    ct["status"] = {"nodes": 3}
    ct = await kube.update_status(tunnels, ct)
    assert ct["status"] == {"nodes": 3}
    with pytest.raises(Invalid):
        await kube.create(tunnels, {"metadata": {"name": "bad"}, "spec": {"server": 5}})


async def test_review_token(kube: KubeClient, fake_kube: FakeKube) -> None:
    fake_kube.add_service_account_token("agent-token", namespace="nodeagent",
                                        service_account="agent", pod_name="agent-x",
                                        pod_uid="p-uid", node_name="edge-1", node_uid="n-uid",
                                        audiences=["nodeagent"])
    status = await kube.review_token("agent-token", audiences=["nodeagent"])
    assert status["authenticated"] is True
    user = status["user"]
    assert user["username"] == "system:serviceaccount:nodeagent:agent"
    assert user["extra"]["authentication.kubernetes.io/node-name"] == ["edge-1"]
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == ["agent-x"]
    assert status["audiences"] == ["nodeagent"]
    wrong = await kube.review_token("agent-token")  # default audience: the API server's
    assert not wrong.get("authenticated") and "audiences" in wrong["error"]
    unknown = await kube.review_token("who-knows", audiences=["nodeagent"])
    assert not unknown.get("authenticated")


async def test_events_resource_roundtrip(kube: KubeClient) -> None:
    ev = await kube.create(EVENTS, {"metadata": {"name": "e1", "namespace": "default"},
                                    "involvedObject": {"kind": "Node", "name": "n1"},
                                    "reason": "Test", "message": "m", "type": "Normal"})
    listed = await kube.list(EVENTS, field_selector="involvedObject.name=n1,reason=Test")
    assert names(listed.items) == [ev["metadata"]["name"]]


async def test_silent_watch_hits_the_read_timeout(kube: KubeClient, fake_kube: FakeKube) -> None:
    fake_kube.hold(path="/configmaps", watch=True)  # the server never answers
    with trio.fail_after(3), pytest.raises(ApiUnreachable, match="timed out"):
        async with kube.watch(CONFIGMAPS, timeout_seconds=1, read_timeout=0.3) as stream:
            async for _ in stream:
                pass
    fake_kube.clear_faults()
