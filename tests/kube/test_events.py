"""EventRecorder: Events about objects, deduplicated into counts."""

from __future__ import annotations

import trio

from nodeagent.kube import EVENTS, INGRESSES, NODES, EventRecorder, KubeClient
from nodeagent.testing.fakekube import FakeKube
from tests.kube.helpers import node


async def ingress(kube: KubeClient) -> dict[str, object]:
    return await kube.create(INGRESSES, {
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"defaultBackend": {"service": {"name": "web", "port": {"number": 80}}}}})


async def test_event_about_an_object(kube: KubeClient, fake_kube: FakeKube) -> None:
    ing = await ingress(kube)
    recorder = EventRecorder(kube, component="nodeagent-controller", instance="ctl-0")
    event = await recorder.warning(ing, "BackendNotFound", 'service "web" not found')
    assert event is not None
    stored = fake_kube.objects("events", namespace="default")
    assert len(stored) == 1
    e = stored[0]
    assert e["involvedObject"] == {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                                   "name": "web", "namespace": "default",
                                   "uid": ing["metadata"]["uid"],  # type: ignore[index]
                                   "resourceVersion": ing["metadata"][  # type: ignore[index]
                                       "resourceVersion"]}
    assert (e["type"], e["reason"], e["count"]) == ("Warning", "BackendNotFound", 1)
    assert e["source"] == {"component": "nodeagent-controller", "host": "ctl-0"}
    found = await kube.list(EVENTS, namespace="default",
                            field_selector={"involvedObject.name": "web",
                                            "involvedObject.kind": "Ingress"})
    assert len(found.items) == 1


async def test_repeats_bump_the_count(kube: KubeClient, fake_kube: FakeKube) -> None:
    ing = await ingress(kube)
    recorder = EventRecorder(kube, component="nodeagent-controller")
    for _ in range(4):
        await recorder.warning(ing, "BackendNotFound", 'service "web" not found')
    await recorder.warning(ing, "BackendNotFound", 'service "api" not found')
    await recorder.normal(ing, "Synced", "routes updated")
    events = {(e["reason"], e["message"]): e["count"]
              for e in fake_kube.objects("events", namespace="default")}
    assert events == {("BackendNotFound", 'service "web" not found'): 4,
                      ("BackendNotFound", 'service "api" not found'): 1,
                      ("Synced", "routes updated"): 1}


async def test_window_and_deleted_events_start_over(kube: KubeClient, fake_kube: FakeKube
                                                    ) -> None:
    ing = await ingress(kube)
    recorder = EventRecorder(kube, component="c", window=0.1)
    first = await recorder.normal(ing, "Synced", "ok")
    await trio.sleep(0.15)
    second = await recorder.normal(ing, "Synced", "ok")
    assert first and second and first["metadata"]["name"] != second["metadata"]["name"]
    fake_kube.delete_object("events", second["metadata"]["name"], "default")
    third = await recorder.normal(ing, "Synced", "ok")  # bump hits 404: recreate
    assert third and third["count"] == 1


async def test_cluster_scoped_objects_and_failures(kube: KubeClient, fake_kube: FakeKube
                                                   ) -> None:
    n = await kube.create(NODES, node("edge-1"))
    recorder = EventRecorder(kube, component="c")
    event = await recorder.warning(n, "NotConnected", "no tunnel from this node")
    assert event is not None and event["metadata"]["namespace"] == "default"
    assert "namespace" not in event["involvedObject"]
    fake_kube.fail_next(1, status=500, path="/events")
    assert await recorder.warning(n, "Other", "x") is None  # logged, never raised
