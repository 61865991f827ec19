"""Scale to zero across controller replicas: the Services a standby's servers report busy
reach the leader through the standby's activity record (a ConfigMap), so the leader never
sleeps a workload under a request or connection held open on a standby's server; a
replica that dies stops renewing its record and the leader sleeps the workload once it
expires; a new leader waits a record's validity before it sleeps anything; a record read
in part is counted and logged, never a crash; stale records are not news and are
collected. Against the fake API server, two Sleepers standing for two replicas."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
import trio

from nodeagent.controller.activityshare import (
    ACTIVITY_LABEL,
    GC_AFTER,
    SharedActivity,
    parse_record,
    record_name,
)
from nodeagent.controller.sleeper import Sleeper, SleeperSettings
from nodeagent.controller.wakeroutes import read_state, wake_settings
from nodeagent.kube import CONFIGMAPS, KubeClient, SharedInformers
from nodeagent.kube.events import rfc3339
from nodeagent.kube.resources import ENDPOINTSLICES, PODS, SERVICES
from nodeagent.testing.fakekube import FakeKube
from tests.controller.test_sleeper import KEY, NS, deployment, service

CONTROLLER_NS = "kube-system"  # the fake API server's namespaces: the default ones


async def replicas(kube: KubeClient, nursery: trio.Nursery, names: list[str], *,
                   activity_interval: float, valid_for: float) -> list[Sleeper]:
    """One Sleeper with its SharedActivity per controller replica, on shared caches."""
    informers = SharedInformers(kube)
    caches = [informers.cache(r) for r in (SERVICES, ENDPOINTSLICES, PODS)]
    records = informers.cache(CONFIGMAPS, namespace=CONTROLLER_NS,
                              label_selector={ACTIVITY_LABEL: "true"})
    await nursery.start(informers.run)
    out = []
    for name in names:
        shared = SharedActivity(kube, records, CONTROLLER_NS, name, refresh=valid_for / 3,
                                valid_for=valid_for, tick=0.05)
        sleeper = Sleeper(kube, *caches, settings=SleeperSettings(
            min_awake=0.0, tick=0.05, activity_interval=activity_interval), shared=shared)
        got = wake_settings(service())
        assert got is not None
        sleeper.enabled = {KEY: got}
        out.append(sleeper)
    return out


def running(fake: FakeKube) -> int:
    got = fake.get_object("deployments", "web", NS, group="apps")
    assert got is not None
    return int(got["spec"]["replicas"])


def sleeping(fake: FakeKube) -> bool:
    svc = fake.get_object("services", "web", NS)
    return svc is not None and read_state(svc).get("state") == "sleeping"


async def test_a_standbys_busy_service_is_not_slept_until_its_record_expires(
        fake_kube: FakeKube, kube: KubeClient, nursery: trio.Nursery) -> None:
    """The standby's servers report a request in flight (a silent open connection) for
    longer than idle-after (1 s); the standby writes the Service's last request only every
    activity interval (3 s here), so the annotation alone would let the leader sleep it.
    Then the standby dies: its record is not renewed, and the leader sleeps the workload
    once the record's validity is over, not never."""
    fake_kube.put_object(deployment(2))
    fake_kube.put_object(service())
    leader, standby = await replicas(kube, nursery, ["c1", "c2"], activity_interval=3.0,
                                     valid_for=0.6)
    assert leader.shared is not None and standby.shared is not None
    nursery.start_soon(leader.run, lambda: True)
    with trio.CancelScope() as standby_scope:
        async with trio.open_nursery() as inner:
            inner.start_soon(standby.run, lambda: False)
            # Led past a record's validity: the grace of a new leader is not what holds.
            while not leader._led_long_enough(time.time()):  # noqa: ASYNC110
                await trio.sleep(0.05)
            seen_busy = False
            with trio.move_on_after(3.0):
                while True:
                    standby.report({f"{NS}/web": (0.0, 1)})
                    seen_busy |= KEY in leader.shared.busy()
                    await trio.sleep(0.1)
            assert seen_busy
            assert running(fake_kube) == 2 and not sleeping(fake_kube)
            assert leader.sleeps == 0
            record = fake_kube.get_object("configmaps", record_name("c2"), CONTROLLER_NS)
            assert record is not None and record["data"]["busy"] == f"{NS}/web"
            standby_scope.cancel()  # the standby dies with its record still saying busy
    with trio.fail_after(15):
        while not sleeping(fake_kube):  # noqa: ASYNC110
            await trio.sleep(0.05)
    assert running(fake_kube) == 0 and leader.sleeps == 1


async def test_a_record_that_empties_lets_the_leader_sleep_and_stops_writing(
        fake_kube: FakeKube, kube: KubeClient, nursery: trio.Nursery) -> None:
    """The standby's Service stops being busy: its record says so (one more write, then
    none while nothing is busy), and the leader sleeps the workload."""
    fake_kube.put_object(deployment(2))
    fake_kube.put_object(service())
    leader, standby = await replicas(kube, nursery, ["c1", "c2"], activity_interval=0.2,
                                     valid_for=0.6)
    assert standby.shared is not None
    nursery.start_soon(standby.run, lambda: False)
    standby.report({f"{NS}/web": (0.0, 1)})
    with trio.fail_after(5):
        while standby.shared.writes == 0:  # noqa: ASYNC110
            await trio.sleep(0.02)
    nursery.start_soon(leader.run, lambda: True)
    with trio.fail_after(15):
        while not sleeping(fake_kube):  # noqa: ASYNC110
            await trio.sleep(0.05)
    record = fake_kube.get_object("configmaps", record_name("c2"), CONTROLLER_NS)
    assert record is not None and record["data"]["busy"] == ""
    writes = standby.shared.writes
    await trio.sleep(0.5)  # several refresh periods with nothing busy: no write
    assert standby.shared.writes == writes


async def test_a_new_leader_sleeps_nothing_before_it_heard_every_replica(
        fake_kube: FakeKube, kube: KubeClient, nursery: trio.Nursery) -> None:
    fake_kube.put_object(deployment(2))
    fake_kube.put_object(service())
    (leader,) = await replicas(kube, nursery, ["c1"], activity_interval=0.2, valid_for=2.0)
    started = time.time()
    nursery.start_soon(leader.run, lambda: True)
    with trio.fail_after(15):
        while not sleeping(fake_kube):  # noqa: ASYNC110
            await trio.sleep(0.05)
    # Idle after 1 s, but not slept before 2 s of leading (no report was missing: the
    # leader cannot know that).
    assert time.time() - started >= 2.0


def activity_record(name: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": name, "namespace": CONTROLLER_NS, "labels": {ACTIVITY_LABEL: "true"}},
        "data": data}


async def test_records_read_in_part_stale_or_own_are_not_news_and_old_ones_are_collected(
        fake_kube: FakeKube, kube: KubeClient, nursery: trio.Nursery) -> None:
    long_ago = rfc3339(dt.datetime.now(dt.UTC) - dt.timedelta(seconds=GC_AFTER + 60))
    fake_kube.put_object(activity_record("nodeagent-activity-odd", {
        "busy": f"web\n{NS}/web\n/x\na/b/c\n\n{'n' * 400}/y", "valid-for": "nan",
        "updated": "yesterday"}))
    fake_kube.put_object(activity_record("nodeagent-activity-gone", {
        "busy": f"{NS}/old", "valid-for": "5", "updated": long_ago}))
    fake_kube.put_object(activity_record(record_name("c1"), {
        "busy": f"{NS}/mine", "valid-for": "5", "updated": rfc3339()}))
    (leader,) = await replicas(kube, nursery, ["c1"], activity_interval=0.2, valid_for=2.0)
    shared = leader.shared
    assert shared is not None
    problems: list[int] = []
    shared.on_problem = lambda: problems.append(1)
    with trio.fail_after(5):
        while len(shared.cache.list()) < 3:  # noqa: ASYNC110
            await trio.sleep(0.02)
    # The readable line of the odd record counts (with this replica's validity); the
    # stale one and this replica's own (its memory is fresher) do not.
    assert shared.busy() == {KEY}
    assert shared.busy() == {KEY}
    assert problems == [1]  # counted once per version of the record, not per look
    await shared.collect()
    names = {o["metadata"]["name"] for o in fake_kube.objects("configmaps",
                                                              namespace=CONTROLLER_NS)}
    assert "nodeagent-activity-gone" not in names
    assert {"nodeagent-activity-odd", record_name("c1")} <= names


@pytest.mark.parametrize(("data", "busy", "valid_for", "problems"), [
    ({"busy": "a/b\nc/d", "valid-for": "7", "updated": "2026-11-27T11:00:00Z"},
     {("a", "b"), ("c", "d")}, 7.0, 0),
    ({"busy": "a/b", "valid-for": "-1", "updated": "2026-11-27T11:00:00Z"},
     {("a", "b")}, 3.0, 1),
    ({"busy": "a/b", "valid-for": "1e9", "updated": "2026-11-27T11:00:00Z"},
     {("a", "b")}, 3.0, 1),
    ({"busy": 5, "valid-for": "inf"}, set(), 3.0, 3),
    ("not a map", set(), 3.0, 1),
    (None, set(), 3.0, 1),
    ({}, set(), 3.0, 2),
])
def test_parse_record_reads_what_it_can(data: Any, busy: set[tuple[str, str]],
                                        valid_for: float, problems: int) -> None:
    record = parse_record(data, 3.0)
    assert record.busy == busy
    assert record.valid_for == valid_for
    assert len(record.problems) == problems, record.problems
