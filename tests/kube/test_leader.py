"""Leader election on a Lease: one leader, takeover within the lease duration, no overlap."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from nodeagent.kube import KubeClient, LeaderElector
from nodeagent.testing.fakekube import FakeKube, RecordedRequest
from nodeagent.testing.fakekube.fixtures import credentials_for
from tests.kube.helpers import eventually

TIMING = {"lease_duration": 1.0, "renew_deadline": 0.6, "retry_period": 0.15}


@asynccontextmanager
async def client_as(fake: FakeKube, tmp_path: Path, user: str) -> AsyncIterator[KubeClient]:
    fake.add_token(f"token-{user}", username=user, groups=["system:authenticated"])
    async with KubeClient(credentials_for(fake, tmp_path, token=f"token-{user}")) as client:
        yield client


class Candidate:
    """An elector with its own client and identity, plus a log of when its work ran."""

    def __init__(self, fake: FakeKube, tmp_path: Path, identity: str,
                 timeline: list[tuple[str, str, float]]) -> None:
        self.fake, self.tmp_path = fake, tmp_path
        self.identity = identity
        self.elector: LeaderElector | None = None
        self.timeline = timeline
        self.leading = False
        self.scope = trio.CancelScope()

    async def lead(self) -> None:
        self.leading = True
        self.timeline.append(("start", self.identity, trio.current_time()))
        try:
            await trio.sleep_forever()
        finally:
            self.leading = False
            self.timeline.append(("stop", self.identity, trio.current_time()))

    async def run(self) -> None:
        with self.scope:
            async with client_as(self.fake, self.tmp_path, self.identity) as client:
                self.elector = LeaderElector(client, name="ctl", namespace="default",
                                             identity=self.identity, **TIMING)
                await self.elector.run(self.lead)


def no_overlap(timeline: list[tuple[str, str, float]]) -> bool:
    current = None
    for kind, who, _ in timeline:
        if kind == "start":
            if current is not None:
                return False
            current = who
        elif current == who:
            current = None
    return True


async def start_candidates(fake: FakeKube, tmp_path: Path, nursery: trio.Nursery,
                           identities: str = "ab") -> tuple[list[Candidate],
                                                            list[tuple[str, str, float]]]:
    timeline: list[tuple[str, str, float]] = []
    candidates = [Candidate(fake, tmp_path, who, timeline) for who in identities]
    for c in candidates:
        nursery.start_soon(c.run)
    with trio.fail_after(3):
        await eventually(lambda: any(c.leading for c in candidates))
    return candidates, timeline


def lease_requests(fake: FakeKube, who: str, since: float,
                   method: str = "GET") -> list[RecordedRequest]:
    """`who`'s requests for the Lease from `since` (trio clock) on. Counted instead of
    timed: the candidates poll at least `retry_period` apart, so a load that slows the
    machine makes fewer of them, never more."""
    return [r for r in fake.requests_matching(method=method, path="/leases/")
            if r.user == who and r.at >= since]


def lease_spec(fake: FakeKube) -> dict[str, object]:
    lease = fake.get_object("leases", "ctl", "default", group="coordination.k8s.io")
    assert lease is not None
    spec: dict[str, object] = lease["spec"]
    return spec


async def test_one_leader_and_it_renews(fake_kube: FakeKube, tmp_path: Path,
                                        nursery: trio.Nursery) -> None:
    (a, b), _ = await start_candidates(fake_kube, tmp_path, nursery)
    leader = a if a.leading else b
    await trio.sleep(0.5)
    assert a.leading != b.leading
    spec = lease_spec(fake_kube)
    assert spec["holderIdentity"] == leader.identity
    assert spec["leaseDurationSeconds"] == 1 and spec["leaseTransitions"] == 0
    first_renew = spec["renewTime"]
    await trio.sleep(0.4)
    assert lease_spec(fake_kube)["renewTime"] != first_renew
    standby = b if leader is a else a
    assert leader.elector is not None and leader.elector.is_leader
    assert standby.elector is not None and not standby.elector.is_leader
    nursery.cancel_scope.cancel()


async def test_clean_shutdown_releases_and_standby_takes_over_at_once(
        fake_kube: FakeKube, tmp_path: Path, nursery: trio.Nursery) -> None:
    (a, b), timeline = await start_candidates(fake_kube, tmp_path, nursery)
    leader, standby = (a, b) if a.leading else (b, a)
    stopped = trio.current_time()
    leader.scope.cancel()
    with trio.fail_after(10):  # hang guard
        await eventually(lambda: standby.leading)
    print(f"\nstandby leading {trio.current_time() - stopped:.2f}s after the leader stopped")
    # Released (an update by the leader on its way out), so the standby did not wait out
    # the lease: it took it at its next poll (one more if a poll was in flight), where
    # an expiry would take lease_duration / retry_period (~7) polls.
    assert 200 in [r.status for r in lease_requests(fake_kube, leader.identity, stopped,
                                                    "PUT")]
    assert len(lease_requests(fake_kube, standby.identity, stopped)) <= 2
    assert no_overlap(timeline)
    spec = lease_spec(fake_kube)
    assert spec["holderIdentity"] == standby.identity and spec["leaseTransitions"] == 1
    nursery.cancel_scope.cancel()


async def test_crashed_leader_is_replaced_within_the_lease_duration(
        fake_kube: FakeKube, tmp_path: Path, nursery: trio.Nursery) -> None:
    (a, b), timeline = await start_candidates(fake_kube, tmp_path, nursery)
    leader, standby = (a, b) if a.leading else (b, a)
    # The leader loses the API server (partition / crash): nothing it sends gets through,
    # so it can neither renew nor release.
    cut = trio.current_time()
    fake_kube.fail_next(math.inf, status=503,
                        match=lambda r: r.user == leader.identity)
    with trio.fail_after(15):  # hang guard
        await eventually(lambda: standby.leading)
    print(f"\nstandby leading {trio.current_time() - cut:.2f}s after the leader was cut off")
    # Within the lease duration: the standby polled about lease_duration / retry_period
    # times (plus the poll that saw the last renewal and the one that took it), not
    # more; a slow machine makes fewer polls, never more.
    polls = len(lease_requests(fake_kube, standby.identity, cut))
    assert polls <= math.ceil(TIMING["lease_duration"] / TIMING["retry_period"]) + 3, polls
    # The old leader's work was cancelled when its renew deadline passed, before the
    # standby started: never two leaders at once.
    assert not leader.leading
    assert no_overlap(timeline), timeline
    # It stopped at its renew deadline: it tried to renew (every retry_period / 2) for
    # about renew_deadline, no longer (no_overlap above shows it stopped before the
    # standby started).
    stop = next(t for kind, who, t in timeline if kind == "stop" and who == leader.identity)
    tries = len([r for r in lease_requests(fake_kube, leader.identity, cut) if r.at <= stop])
    assert tries <= math.ceil(TIMING["renew_deadline"] / (TIMING["retry_period"] / 2)) + 2, \
        tries
    nursery.cancel_scope.cancel()


async def test_lead_returning_releases_the_lease(fake_kube: FakeKube, kube: KubeClient
                                                 ) -> None:
    elector = LeaderElector(kube, name="ctl", namespace="default", identity="solo", **TIMING)
    ran = []

    async def lead() -> None:
        ran.append(lease_spec(fake_kube)["holderIdentity"])

    with trio.fail_after(2):
        await elector.run(lead)
    assert ran == ["solo"]
    assert not lease_spec(fake_kube).get("holderIdentity")
    assert not elector.is_leader


async def test_simultaneous_candidates_create_the_lease_once(
        fake_kube: FakeKube, tmp_path: Path, nursery: trio.Nursery) -> None:
    candidates, timeline = await start_candidates(fake_kube, tmp_path, nursery, "abc")
    await trio.sleep(0.4)
    assert sum(c.leading for c in candidates) == 1
    assert no_overlap(timeline)
    creates = fake_kube.requests_matching(method="POST", path="/leases")
    assert [r.status for r in creates].count(201) == 1
    nursery.cancel_scope.cancel()
