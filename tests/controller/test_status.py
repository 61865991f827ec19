"""The leader's ClusterTunnel writes against the fake API server: the finalizer stays while
a published config still carries the tunnel, and a write made from a stale cache meets the
409 a second writer's change causes (never overwriting it) and succeeds once the cache
has caught up — which is how the leader's writes retry (LeaderWrites runs a write that
returned False again)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from nodeagent.controller.clustertunnel import CLUSTER_TUNNELS, FINALIZER, ClusterTunnelSpec
from nodeagent.controller.compute import Tunnel
from nodeagent.controller.crds import ensure_crds
from nodeagent.controller.status import Outcome, StatusWriter, WatcherReports
from nodeagent.kube import Cache, KubeClient, NotFound

Obj = dict[str, Any]


class Seen:
    """What the leader's informer cache holds: the objects as last seen, stale or not."""

    def __init__(self, *objects: Obj) -> None:
        self.objects = {o["metadata"]["name"]: o for o in objects}

    def list(self) -> list[Obj]:
        return list(self.objects.values())

    def get(self, name: str, namespace: str | None = None) -> Obj | None:
        return self.objects.get(name)

    def saw(self, obj: Obj) -> None:
        self.objects[obj["metadata"]["name"]] = obj


class NoWatchers:
    def connected_nodes(self) -> set[str]:
        return set()


def writer(kube: KubeClient, tunnels: Seen) -> StatusWriter:
    caches = cast(dict[str, Cache], {"clustertunnels": tunnels})
    out = StatusWriter(kube, caches, "nodeagent", "c1", cast(WatcherReports, NoWatchers()))
    return out


def outcome(objects: list[Obj], in_config: list[str]) -> Outcome:
    return Outcome(problems=(), served=(), tunnels=tuple(
        Tunnel(name, "", ClusterTunnelSpec()) for name in in_config),
        tunnel_objects=tuple(objects), nodes=(), config_version=3)


@pytest.fixture
async def crd(kube: KubeClient) -> None:
    await ensure_crds(kube)


async def test_the_finalizer_stays_while_a_published_config_carries_the_tunnel(
        kube: KubeClient, crd: None) -> None:
    await kube.create(CLUSTER_TUNNELS, {"metadata": {"name": "edge", "finalizers": [
        FINALIZER]}, "spec": {}})
    await kube.delete(CLUSTER_TUNNELS, "edge")
    deleting = await kube.get(CLUSTER_TUNNELS, "edge")
    assert deleting["metadata"].get("deletionTimestamp")
    seen = Seen(deleting)
    status = writer(kube, seen)
    # The latest recompute still published the tunnel's rules (it ran before the delete):
    # the finalizer holds the object.
    status.outcome = outcome([deleting], ["edge"])
    assert await status.write_tunnel_status()
    assert (await kube.get(CLUSTER_TUNNELS, "edge"))["metadata"]["finalizers"] == [FINALIZER]
    # Once a recompute left it out of every config, the finalizer goes and so does it.
    status.outcome = outcome([deleting], [])
    assert await status.write_tunnel_status()
    with pytest.raises(NotFound):
        await kube.get(CLUSTER_TUNNELS, "edge")


async def test_a_stale_write_meets_a_conflict_keeps_the_other_writers_change_and_retries(
        kube: KubeClient, crd: None) -> None:
    created = await kube.create(CLUSTER_TUNNELS, {"metadata": {"name": "edge"}, "spec": {}})
    seen = Seen(created)
    status = writer(kube, seen)
    status.outcome = outcome([created], ["edge"])

    async def other_writer(label: str) -> Obj:
        """Another client (kubectl, a GitOps tool) bumps the object first."""
        current = await kube.get(CLUSTER_TUNNELS, "edge")
        current["metadata"].setdefault("labels", {})["owner"] = label
        return await kube.update(CLUSTER_TUNNELS, current)

    # The finalizer write from the stale cache: 409, nothing overwritten, a retry due.
    await other_writer("admin")
    assert await status.write_tunnel_status() is False
    now = await kube.get(CLUSTER_TUNNELS, "edge")
    assert now["metadata"]["labels"] == {"owner": "admin"}
    assert FINALIZER not in (now["metadata"].get("finalizers") or [])
    # The informer catches up: the retry adds the finalizer and writes the status.
    seen.saw(now)
    assert await status.write_tunnel_status() is True
    now = await kube.get(CLUSTER_TUNNELS, "edge")
    assert now["metadata"]["finalizers"] == [FINALIZER]
    assert now["metadata"]["labels"] == {"owner": "admin"}
    assert now["status"]["configVersion"] == 3
    assert now["status"]["conditions"][0]["status"] == "True"

    # The status write from a stale cache: 409 too, then right once caught up.
    seen.saw(now)
    await other_writer("team")
    status.outcome = Outcome(problems=(), served=(), tunnels=(Tunnel(
        "edge", "", ClusterTunnelSpec()),), tunnel_objects=(now,), nodes=(), config_version=4)
    assert await status.write_tunnel_status() is False
    assert (await kube.get(CLUSTER_TUNNELS, "edge"))["status"]["configVersion"] == 3
    seen.saw(await kube.get(CLUSTER_TUNNELS, "edge"))
    assert await status.write_tunnel_status() is True
    now = await kube.get(CLUSTER_TUNNELS, "edge")
    assert now["status"]["configVersion"] == 4
    assert now["metadata"]["labels"] == {"owner": "team"}
