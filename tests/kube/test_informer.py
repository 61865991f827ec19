"""Informer (list+watch), Cache and Debouncer against the fake API server."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import trio

from nodeagent.kube import (
    CONFIGMAPS,
    NODES,
    SECRETS,
    Backoff,
    CacheEvent,
    Debouncer,
    Informer,
    KubeClient,
    SharedInformers,
)
from nodeagent.testing.fakekube import FakeKube
from tests.kube.helpers import configmap, eventually, names, node


def fast_backoff() -> Backoff:
    return Backoff(initial=0.02, maximum=0.2, rng=random.Random(1))


def state(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"], meta["resourceVersion"]


def server_state(fake: FakeKube, plural: str) -> list[tuple[str, str, str]]:
    return [state(o) for o in fake.objects(plural)]


def cache_state(informer: Informer) -> list[tuple[str, str, str]]:
    return [state(o) for o in informer.cache.list()]


async def test_initial_sync_then_follow(kube: KubeClient, fake_kube: FakeKube,
                                        nursery: trio.Nursery) -> None:
    for i in range(5):
        await kube.create(CONFIGMAPS, configmap(f"c{i}"))
    informer = Informer(kube, CONFIGMAPS, page_size=2, backoff=fast_backoff())
    events: list[CacheEvent] = []
    informer.cache.add_handler(events.append)
    await nursery.start(informer.run)
    assert informer.has_synced
    assert names(informer.cache.list()) == [f"c{i}" for i in range(5)]
    # The sorted list is kept between changes, but each call hands out a list of its own.
    informer.cache.list().clear()
    assert names(informer.cache.list()) == [f"c{i}" for i in range(5)]
    assert names(informer.cache.list(namespace="default")) == [f"c{i}" for i in range(5)]
    assert informer.cache.list(namespace="other") == []
    assert [e.type for e in events] == ["ADDED"] * 5
    assert informer.cache.get("c0", "default")["kind"] == "ConfigMap"  # type: ignore[index]
    lists = fake_kube.requests_matching(method="GET", path="/configmaps", watch=False)
    assert len(lists) == 3  # 5 objects, pages of 2

    events.clear()
    await kube.create(CONFIGMAPS, configmap("new"))
    await kube.patch(CONFIGMAPS, "c1", {"data": {"v": "2"}}, namespace="default")
    await kube.delete(CONFIGMAPS, "c2", namespace="default")
    with trio.fail_after(2):
        await informer.cache.wait_until(lambda c: len(events) == 3)
    assert [(e.type, e.object["metadata"]["name"]) for e in events] == [
        ("ADDED", "new"), ("MODIFIED", "c1"), ("DELETED", "c2")]
    assert events[1].old is not None and events[1].old["data"] == {"v": "1"}
    assert cache_state(informer) == server_state(fake_kube, "configmaps")


async def test_bookmarks_move_the_cache_version(kube: KubeClient, fake_kube: FakeKube,
                                                nursery: trio.Nursery) -> None:
    informer = Informer(kube, NODES, backoff=fast_backoff())
    await nursery.start(informer.run)
    listed = int(informer.cache.resource_version)
    await kube.create(CONFIGMAPS, configmap("elsewhere"))
    await fake_kube.wait_for_watches(1, "/nodes")
    with trio.fail_after(3):
        await eventually(lambda: int(informer.cache.resource_version) > listed)
    fake_kube.drop_watches()
    with trio.fail_after(3):
        await eventually(lambda: any(
            r.resource_version == informer.cache.resource_version
            for r in fake_kube.requests_matching(path="/nodes", watch=True)))
    # The reconnect resumed from the bookmark's version, not the listed one.
    watches = fake_kube.requests_matching(path="/nodes", watch=True)
    assert [r.resource_version for r in watches] == [str(listed), informer.cache.resource_version]


@pytest.mark.parametrize("gone_as_http_status", [False, True])
async def test_410_relists_and_never_retries_the_stale_version(
        kube: KubeClient, fake_kube: FakeKube, nursery: trio.Nursery,
        gone_as_http_status: bool) -> None:
    fake_kube.gone_as_http_status = gone_as_http_status
    for i in range(3):
        await kube.create(CONFIGMAPS, configmap(f"c{i}"))
    informer = Informer(kube, CONFIGMAPS, backoff=fast_backoff())
    events: list[CacheEvent] = []
    informer.cache.add_handler(events.append)
    await nursery.start(informer.run)
    await fake_kube.wait_for_watches(1, "/configmaps")
    stale = informer.cache.resource_version

    # While the informer is disconnected, objects change and history is compacted.
    gate = fake_kube.hold(path="/configmaps", watch=True)
    fake_kube.drop_watches()
    await kube.delete(CONFIGMAPS, "c0", namespace="default")
    await kube.patch(CONFIGMAPS, "c1", {"data": {"v": "9"}}, namespace="default")
    await kube.create(CONFIGMAPS, configmap("c3"))
    fake_kube.compact()
    events.clear()
    gate.set()

    with trio.fail_after(3):
        await eventually(lambda: informer.gone > 0 and cache_state(informer) == server_state(
            fake_kube, "configmaps"))
    assert sorted((e.type, e.object["metadata"]["name"]) for e in events) == [
        ("ADDED", "c3"), ("DELETED", "c0"), ("MODIFIED", "c1")]

    # What the informer asked for, in order: list, watch, the one reconnect that got 410,
    # a fresh list (no resourceVersion: never the stale one), then a watch from the new list.
    with trio.fail_after(3):
        await fake_kube.wait_for_watches(1, "/configmaps")
    asked = [(r.watch, r.resource_version) for r in fake_kube.requests
             if r.method == "GET" and "/configmaps" in r.path]
    relisted = informer.cache.resource_version
    assert asked[:5] == [(False, None), (True, stale), (True, stale), (False, None),
                         (True, asked[4][1])]
    assert int(asked[4][1] or 0) > int(stale) and int(relisted) >= int(asked[4][1] or 0)
    assert informer.lists == 2 and informer.gone == 1
    assert informer.restarts["expired"] == 1  # the controller's watch restart metric


async def test_reconnects_from_last_version_without_gaps_or_duplicates(
        kube: KubeClient, fake_kube: FakeKube, nursery: trio.Nursery) -> None:
    informer = Informer(kube, CONFIGMAPS, backoff=fast_backoff())
    seen: dict[str, list[str]] = {}

    def record(event: CacheEvent) -> None:
        seen.setdefault(event.object["metadata"]["name"], []).append(
            event.object["metadata"]["resourceVersion"])
    informer.cache.add_handler(record)
    await nursery.start(informer.run)

    rng = random.Random(7)
    alive: set[str] = set()
    dropped = 0
    for step in range(150):
        name = f"c{rng.randrange(25)}"
        if name not in alive:
            await kube.create(CONFIGMAPS, configmap(name, data={"step": str(step)}))
            alive.add(name)
        elif rng.random() < 0.3:
            await kube.delete(CONFIGMAPS, name, namespace="default")
            alive.discard(name)
        else:
            await kube.patch(CONFIGMAPS, name, {"data": {"step": str(step)}},
                             namespace="default")
        if step % 10 == 5:
            dropped += fake_kube.drop_watches()
    with trio.fail_after(5):
        await eventually(lambda: cache_state(informer) == server_state(fake_kube,
                                                                       "configmaps"))
    assert informer.lists == 1 and informer.gone == 0  # every reconnect resumed
    assert dropped >= 5 and informer.watches == dropped + 1  # one reconnect per cut
    assert sum(informer.restarts.values()) == dropped and informer.restarts["expired"] == 0
    for name, versions in seen.items():  # each write seen once, in order
        assert versions == sorted(set(versions), key=int), name
    watch_versions = [int(r.resource_version or 0)
                      for r in fake_kube.requests_matching(path="/configmaps", watch=True)]
    assert watch_versions == sorted(watch_versions)


async def test_backoff_on_server_errors(kube: KubeClient, fake_kube: FakeKube,
                                        nursery: trio.Nursery) -> None:
    fake_kube.fail_next(math.inf, status=500, path="/configmaps")
    informer = Informer(kube, CONFIGMAPS,
                        backoff=Backoff(initial=0.05, maximum=0.4, jitter=0.0))
    nursery.start_soon(informer.run)
    await trio.sleep(1.2)
    failed = fake_kube.requests_matching(path="/configmaps")
    # 0.05 + 0.1 + 0.2 + 0.4 + 0.4 ≈ 1.15 s: about 6 attempts, not hundreds.
    assert 4 <= len(failed) <= 7, [r.at for r in failed]
    gaps = [b.at - a.at for a, b in itertools.pairwise(failed)]
    expected = [min(0.05 * 2**i, 0.4) for i in range(len(gaps))]
    assert all(g >= e * 0.9 for g, e in zip(gaps, expected, strict=True)), gaps
    assert not informer.has_synced
    fake_kube.clear_faults()
    with trio.fail_after(2):
        await informer.cache.synced.wait()
    assert informer.errors == len(failed)


def test_backoff_is_capped_with_jitter() -> None:
    backoff = Backoff(initial=1.0, maximum=8.0, jitter=0.5, rng=random.Random(3))
    delays = [backoff.next_delay() for _ in range(10)]
    assert all(0.5 <= d <= 1.0 for d in delays[:1])
    assert all(4.0 <= d <= 8.0 for d in delays[4:])
    assert len(set(delays)) == len(delays)
    backoff.reset()
    assert backoff.next_delay() <= 1.0


async def test_watch_timeout_rewatches_without_relisting(kube: KubeClient,
                                                         fake_kube: FakeKube,
                                                         nursery: trio.Nursery) -> None:
    informer = Informer(kube, CONFIGMAPS, watch_timeout=1, backoff=fast_backoff())
    await nursery.start(informer.run)
    await trio.sleep(2.7)
    watches = fake_kube.requests_matching(path="/configmaps", watch=True)
    assert len(watches) >= 2
    assert all(1 <= int(r.query["timeoutSeconds"]) <= 2 for r in watches)
    assert informer.lists == 1


async def test_selectors_and_label_changes(kube: KubeClient, fake_kube: FakeKube,
                                           nursery: trio.Nursery) -> None:
    informer = Informer(kube, CONFIGMAPS, namespace="default",
                        label_selector={"app": "web"}, backoff=fast_backoff())
    await nursery.start(informer.run)
    await kube.create(CONFIGMAPS, configmap("a", app="web"))
    await kube.create(CONFIGMAPS, configmap("b", app="db"))
    await kube.create(CONFIGMAPS, configmap("c", namespace="kube-system", app="web"))
    with trio.fail_after(2):
        await informer.cache.wait_until(lambda c: len(c) == 1)
    await kube.patch(CONFIGMAPS, "a", {"metadata": {"labels": {"app": "db"}}},
                     namespace="default")
    await kube.patch(CONFIGMAPS, "b", {"metadata": {"labels": {"app": "web"}}},
                     namespace="default")
    with trio.fail_after(2):
        await informer.cache.wait_until(lambda c: names(c.list()) == ["b"])


async def test_cache_indexes_and_failing_handler(kube: KubeClient, nursery: trio.Nursery
                                                 ) -> None:
    informer = Informer(kube, NODES, backoff=fast_backoff())
    informer.cache.add_index("zone", lambda o: [o["metadata"].get("labels", {}).get(
        "zone", "")])

    def broken(event: CacheEvent) -> None:
        raise RuntimeError("handler bug")
    informer.cache.add_handler(broken)
    await kube.create(NODES, node("n1", zone="a"))
    await nursery.start(informer.run)
    await kube.create(NODES, node("n2", zone="b"))
    await kube.create(NODES, node("n3", zone="a"))
    with trio.fail_after(2):
        await informer.cache.wait_until(lambda c: len(c) == 3)
    assert names(informer.cache.by_index("zone", "a")) == ["n1", "n3"]
    await kube.patch(NODES, "n3", {"metadata": {"labels": {"zone": "b"}}})
    await kube.delete(NODES, "n2")
    with trio.fail_after(2):
        await informer.cache.wait_until(lambda c: names(c.by_index("zone", "b")) == ["n3"])
    assert names(informer.cache.by_index("zone", "a")) == ["n1"]
    assert informer.cache.list(label_selector={"zone": "b"})[0]["metadata"]["name"] == "n3"


async def test_shared_informers(kube: KubeClient, fake_kube: FakeKube,
                                nursery: trio.Nursery) -> None:
    shared = SharedInformers(kube, backoff=fast_backoff)
    nodes = shared.cache(NODES)
    assert shared.cache(NODES) is nodes
    secrets = shared.cache(SECRETS, namespace="default")
    assert shared.informer(SECRETS, namespace="default").cache is secrets
    await kube.create(NODES, node("n1"))
    await nursery.start(shared.run)
    assert shared.has_synced and len(nodes) == 1
    with pytest.raises(RuntimeError):
        shared.informer(CONFIGMAPS)
    assert len(fake_kube.requests_matching(method="GET", path="/nodes", watch=False)) == 1


async def test_debouncer_coalesces_a_burst() -> None:
    calls: list[float] = []

    async def recompute() -> None:
        calls.append(trio.current_time())

    debouncer = Debouncer(recompute, delay=0.03, max_delay=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(debouncer.run)
        for _ in range(100):  # a burst of changes, each less than `delay` apart
            debouncer.trigger()
            await trio.sleep(0.0002)
        end = trio.current_time()
        await trio.sleep(0.15)
        assert len(calls) == 1
        assert 0.0 <= calls[0] - end < 0.1
        debouncer.trigger()
        await trio.sleep(0.1)
        assert len(calls) == 2
        nursery.cancel_scope.cancel()


async def test_debouncer_bounds_the_delay_and_reruns_after_changes_during_a_call() -> None:
    calls: list[float] = []
    release = trio.Event()

    async def recompute() -> None:
        calls.append(trio.current_time())
        if len(calls) == 1:
            await release.wait()

    debouncer = Debouncer(recompute, delay=0.05, max_delay=0.2)
    async with trio.open_nursery() as nursery:
        await nursery.start(debouncer.run)
        start = trio.current_time()
        while not calls:  # a steady stream of changes still gets a call by max_delay
            debouncer.trigger()
            await trio.sleep(0.01)
        assert calls[0] - start == pytest.approx(0.2, abs=0.06)
        debouncer.trigger()  # during the (blocked) call
        debouncer.trigger()
        release.set()
        await trio.sleep(0.15)
        assert len(calls) == 2
        nursery.cancel_scope.cancel()


async def test_an_urgent_trigger_ends_the_debounce_at_once(
        autojump_clock: trio.abc.Clock) -> None:
    """A woken Service's endpoints are recomputed without the debounce: an urgent
    trigger, alone or in the middle of a burst, runs the call now (virtual time: the
    10 s delay is never slept)."""
    calls: list[float] = []

    async def recompute() -> None:
        calls.append(trio.current_time())

    debouncer = Debouncer(recompute, delay=10.0, max_delay=60.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(debouncer.run)
        start = trio.current_time()
        debouncer.trigger()
        await trio.sleep(1.0)
        debouncer.trigger(urgent=True)
        await trio.sleep(0.5)
        assert calls == [start + 1.0]
        debouncer.trigger(urgent=True)  # alone
        await trio.sleep(0.5)
        assert calls == [start + 1.0, start + 1.5]
        debouncer.trigger()  # an ordinary one still waits its delay
        await trio.sleep(20)
        assert calls[2:] == [start + 12.0]
        nursery.cancel_scope.cancel()


async def test_debouncer_survives_a_failing_callback() -> None:
    attempts = 0

    async def recompute() -> None:
        nonlocal attempts
        attempts += 1
        raise ValueError("bad object")

    debouncer = Debouncer(recompute, delay=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(debouncer.run)
        debouncer.trigger()
        await trio.sleep(0.05)
        debouncer.trigger()
        await trio.sleep(0.05)
        assert attempts == 2 and debouncer.failures == 2
        nursery.cancel_scope.cancel()


async def test_informer_can_run_again_after_cancellation(kube: KubeClient) -> None:
    informer = Informer(kube, CONFIGMAPS, backoff=fast_backoff())
    events: list[CacheEvent] = []
    informer.cache.add_handler(events.append)
    await kube.create(CONFIGMAPS, configmap("a"))
    async with trio.open_nursery() as nursery:
        await nursery.start(informer.run)
        nursery.cancel_scope.cancel()
    await kube.create(CONFIGMAPS, configmap("b"))
    with trio.fail_after(3):
        async with trio.open_nursery() as nursery:
            await nursery.start(informer.run)  # reports started again, after a fresh list
            nursery.cancel_scope.cancel()
    assert [(e.type, e.object["metadata"]["name"]) for e in events] == [
        ("ADDED", "a"), ("ADDED", "b")]
    assert informer.lists == 2
