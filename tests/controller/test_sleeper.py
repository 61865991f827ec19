"""Scale to zero, the controller's writes, against the fake API server: waking writes the
scale once however many replicas and requests ask at once; the leader's sleep records the
count, scales to 0 and says so; nothing sleeps while a server reports requests."""

from __future__ import annotations

import json
from typing import Any

import trio

from nodeagent.controller.sleeper import STATE_INDEX, Sleeper, SleeperSettings
from nodeagent.controller.wakeroutes import (
    REPLICAS_BEFORE_SLEEP,
    STATE,
    read_state,
    wake_settings,
)
from nodeagent.kube import KubeClient, SharedInformers
from nodeagent.kube.resources import ENDPOINTSLICES, PODS, SERVICES
from nodeagent.testing.fakekube import FakeKube

NS = "default"
KEY = (NS, "web")


def deployment(replicas: int, **annotations: str) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": NS, "annotations": annotations},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}},
                                  "spec": {"containers": [{"name": "web", "image": "x"}]}}}}


def service() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": "web", "namespace": NS, "annotations": {
            "nodeagent.io/idle-after": "1s", "nodeagent.io/workload": "deployment/web"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}


async def sleepers(fake: FakeKube, kube: KubeClient, nursery: trio.Nursery, count: int,
                   **settings: Any) -> list[Sleeper]:
    informers = SharedInformers(kube)
    caches = [informers.cache(r) for r in (SERVICES, ENDPOINTSLICES, PODS)]
    await nursery.start(informers.run)
    out = []
    for _ in range(count):
        sleeper = Sleeper(kube, *caches, settings=SleeperSettings(**settings))
        got = wake_settings(service())
        assert got is not None
        sleeper.enabled = {KEY: got}
        out.append(sleeper)
    return out


def scale_writes(fake: FakeKube) -> int:
    return sum(1 for r in fake.requests if r.method in ("PUT", "PATCH") and r.status == 200
               and r.path.endswith("/deployments/web/scale"))


async def test_replicas_and_requests_waking_at_once_write_the_scale_once(
        fake_kube: FakeKube, kube: KubeClient, nursery: trio.Nursery) -> None:
    fake_kube.put_object(deployment(0, **{REPLICAS_BEFORE_SLEEP: "3"}))
    fake_kube.put_object(service())
    a, b = await sleepers(fake_kube, kube, nursery, 2)
    answers: list[tuple[int, dict[str, Any]]] = []

    async def ask(sleeper: Sleeper) -> None:
        answers.append(await sleeper.wake(KEY, asked_by="s1"))

    async with trio.open_nursery() as inner:
        for sleeper in (a, b, a, b, a, b):
            inner.start_soon(ask, sleeper)
    assert [status for status, _ in answers] == [202] * 6, answers
    assert scale_writes(fake_kube) == 1
    got = fake_kube.get_object("deployments", "web", NS, group="apps")
    assert got is not None and got["spec"]["replicas"] == 3
    # Asked again once it is up: no write.
    assert (await a.wake(KEY))[0] == 202 and scale_writes(fake_kube) == 1
    # Not a sleepable Service: refused, nothing written.
    status, doc = await a.wake((NS, "other"))
    assert status == 404 and doc["reason"] == "not_sleepable"


async def test_the_leader_sleeps_an_idle_workload_but_not_a_busy_one(
        fake_kube: FakeKube, kube: KubeClient, nursery: trio.Nursery) -> None:
    fake_kube.put_object(deployment(2))
    fake_kube.put_object(service())
    (leader,) = await sleepers(fake_kube, kube, nursery, 1, min_awake=0.0, tick=0.05,
                               activity_interval=0.2)
    # A server keeps reporting a request in flight: it stays up.
    leader.report({f"{NS}/web": (0.0, 1)})
    nursery.start_soon(leader.run, lambda: True)
    with trio.move_on_after(0.3):
        while True:
            leader.report({f"{NS}/web": (0.0, 1)})
            await trio.sleep(0.05)
    got = fake_kube.get_object("deployments", "web", NS, group="apps")
    assert got is not None and got["spec"]["replicas"] == 2
    # Idle now: asleep after idle-after (1s), its count remembered, its state said.
    def asleep() -> bool:
        svc = fake_kube.get_object("services", "web", NS)
        return svc is not None and read_state(svc).get("state") == "sleeping" and any(
            e["reason"] == "Sleeping" for e in fake_kube.objects("events", namespace=NS))

    with trio.fail_after(10):
        while not asleep():  # noqa: ASYNC110
            await trio.sleep(0.05)
    got = fake_kube.get_object("deployments", "web", NS, group="apps")
    assert got is not None and got["spec"]["replicas"] == 0
    assert got["metadata"]["annotations"][REPLICAS_BEFORE_SLEEP] == "2"
    assert leader.sleeps == 1 and scale_writes(fake_kube) == 1


async def test_a_workload_found_from_pods_is_forgotten_once_its_service_no_longer_sleeps(
        fake_kube: FakeKube, kube: KubeClient, nursery: trio.Nursery) -> None:
    """The workload found from a Service's pods is read once (a ReplicaSet GET) while
    the Service opts in, and forgotten when it no longer does: the controller's memory
    follows the Services that sleep now, not every one that ever did."""
    fake_kube.put_object(deployment(0, **{REPLICAS_BEFORE_SLEEP: "1"}))
    fake_kube.put_object({"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {
        "name": "web-7d9", "namespace": NS, "ownerReferences": [
            {"kind": "Deployment", "name": "web", "controller": True}]}, "spec": {}})
    fake_kube.put_object({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "web-7d9-x", "namespace": NS, "labels": {"app": "web"},
        "ownerReferences": [{"kind": "ReplicaSet", "name": "web-7d9", "controller": True}]},
        "spec": {"containers": [{"name": "web", "image": "x"}]}})
    unnamed = service()
    del unnamed["metadata"]["annotations"]["nodeagent.io/workload"]
    fake_kube.put_object(unnamed)
    (sleeper,) = await sleepers(fake_kube, kube, nursery, 1)
    settings = wake_settings(unnamed)
    assert settings is not None
    with trio.fail_after(5):
        while not sleeper.pods.list(namespace=NS):  # noqa: ASYNC110
            await trio.sleep(0.01)

    def replicaset_reads() -> int:
        return sum(1 for r in fake_kube.requests if r.method == "GET"
                   and r.path.endswith("/replicasets/web-7d9"))

    sleeper.set_enabled({KEY: settings}, True)
    assert (await sleeper.wake(KEY))[0] == 202
    assert (await sleeper.wake(KEY))[0] == 202
    assert replicaset_reads() == 1  # found once, then remembered
    sleeper.report({f"{NS}/web": (0.0, 1)})
    assert KEY in sleeper.activity
    # The Service opts out (or is deleted): nothing of it is kept.
    sleeper.set_enabled({}, True)
    assert sleeper.activity == {}
    assert (await sleeper.wake(KEY))[0] == 404
    # It opts in again, replaced whole (`kubectl replace`: no state annotation naming
    # the workload): its workload is looked up afresh, not taken from a stale memory.
    fake_kube.put_object(unnamed)
    with trio.fail_after(5):
        while read_state(sleeper.services.get("web", NS) or {}):  # noqa: ASYNC110
            await trio.sleep(0.01)
    sleeper.set_enabled({KEY: settings}, True)
    assert (await sleeper.wake(KEY))[0] == 202
    assert replicaset_reads() == 2


async def test_a_service_left_asleep_when_it_opts_out_is_woken_and_its_state_removed(
        fake_kube: FakeKube, kube: KubeClient, nursery: trio.Nursery) -> None:
    """The leader's pass wakes a Service left asleep (its annotation removed, or the
    feature switched off) and removes its state; it finds it among thousands of others
    without walking them (the Services cache keeps an index of the annotated ones)."""
    fake_kube.put_object(deployment(0, **{REPLICAS_BEFORE_SLEEP: "2"}))
    asleep = service()
    asleep["metadata"]["annotations"][STATE] = json.dumps(
        {"state": "sleeping", "workload": "deployments/web", "replicas": 2})
    fake_kube.put_object(asleep)
    for i in range(50):  # others, never asleep
        fake_kube.put_object({"apiVersion": "v1", "kind": "Service", "metadata": {
            "name": f"other-{i}", "namespace": NS}, "spec": {"ports": [{"port": 80}]}})
    (leader,) = await sleepers(fake_kube, kube, nursery, 1, tick=0.05)
    with trio.fail_after(5):
        while len(leader.services) < 51:  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert [s["metadata"]["name"] for s in
            leader.services.by_index(STATE_INDEX, STATE)] == ["web"]
    leader.set_enabled({}, True)  # it opted out while asleep
    nursery.start_soon(leader.run, lambda: True)
    with trio.fail_after(10):
        while read_state(fake_kube.get_object("services", "web", NS) or {}):  # noqa: ASYNC110
            await trio.sleep(0.05)
    got = fake_kube.get_object("deployments", "web", NS, group="apps")
    assert got is not None and got["spec"]["replicas"] == 2
    with trio.fail_after(5):
        while leader.services.by_index(STATE_INDEX, STATE):  # noqa: ASYNC110
            await trio.sleep(0.01)
