"""Leader election on a coordination.k8s.io/v1 Lease, with client-go's semantics.

A candidate takes the Lease when it is free, released, or not renewed for
`leaseDurationSeconds` as measured on the candidate's own clock since it last saw the
record change (so clock skew between nodes does not matter). Every write is a PUT with the
resourceVersion just read: two candidates racing for the same expired Lease get one 200 and
one 409, and the loser reads again. The leader renews every `retry_period`; if it cannot
renew for `renew_deadline` (< lease duration) it steps down before anyone else may take
over — its work is cancelled through a cancel scope, so nothing of it outlives leadership.
On a clean exit the Lease is released (empty holder) so a standby takes over at once.

    elector = LeaderElector(kube, name="nodeagent-controller", namespace="nodeagent",
                            identity=pod_name)
    await elector.run(controller.run)   # controller.run is cancelled if leadership is lost
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import trio

from nodeagent.kube.client import KubeClient, Object
from nodeagent.kube.errors import KubeError, NotFound
from nodeagent.kube.resources import LEASES
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.kube.leader")


def micro_time(when: datetime | None = None) -> str:
    """RFC 3339 with microseconds, the format of the API's MicroTime fields."""
    return (when or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _Attempt(enum.Enum):
    HELD = "held"  # we hold the lease now
    TAKEN = "taken"  # someone else holds a valid lease
    FAILED = "failed"  # request error or lost a race (409): try again


class LeaderElector:
    """Runs a function only while this process holds the Lease."""

    def __init__(
        self,
        client: KubeClient,
        *,
        name: str,
        namespace: str,
        identity: str,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        rng: random.Random | None = None,
    ) -> None:
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("need retry_period < renew_deadline < lease_duration")
        self.client = client
        self.name = name
        self.namespace = namespace
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self._rng = rng or random.Random()
        self.is_leader = False
        self.holder: str | None = None  # last observed holderIdentity
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._last_renew = 0.0
        self._lease: Object | None = None
        self._log = log.bind(lease=f"{namespace}/{name}", identity=identity)

    async def run(self, lead: Callable[[], Awaitable[object]]) -> None:
        """Campaign, then run `lead()` while leading; again after losing the Lease.

        Returns when `lead()` returns (the Lease is then released). `lead()` is cancelled
        when leadership is lost; cancelling `run()` releases the Lease on the way out.
        """
        try:
            while True:
                await self._acquire()
                lost = False
                async with trio.open_nursery() as nursery:

                    async def keep_renewing() -> None:
                        nonlocal lost
                        await self._renew_until_lost()
                        lost = True
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(keep_renewing)
                    await lead()
                    nursery.cancel_scope.cancel()
                if not lost:
                    return
                self.is_leader = False
                self._log.warning("leadership lost", holder=self.holder)
        finally:
            if self.is_leader:
                with trio.CancelScope(shield=True), trio.move_on_after(self.renew_deadline):
                    await self._release()
                self.is_leader = False

    # -- campaign ---------------------------------------------------------------------------

    async def _acquire(self) -> None:
        self._log.info("campaigning for leadership")
        while True:
            if await self._try_acquire_or_renew() is _Attempt.HELD:
                self.is_leader = True
                self._log.info("became leader")
                return
            await trio.sleep(self.retry_period * (1.0 + 0.2 * self._rng.random()))

    async def _renew_until_lost(self) -> None:
        while True:
            await trio.sleep(self.retry_period)
            renewed = False
            with trio.move_on_at(self._last_renew + self.renew_deadline):
                while True:
                    result = await self._try_acquire_or_renew()
                    if result is _Attempt.HELD:
                        renewed = True
                        break
                    if result is _Attempt.TAKEN:
                        return
                    await trio.sleep(self.retry_period / 2)
            if not renewed:
                self._log.warning("renew deadline passed", deadline=self.renew_deadline)
                return

    async def _try_acquire_or_renew(self) -> _Attempt:
        now = datetime.now(UTC)
        try:
            lease = await self.client.get(LEASES, self.name, namespace=self.namespace)
        except NotFound:
            return await self._create(now)
        except KubeError as exc:
            self._log.warning("reading lease failed", error=str(exc))
            return _Attempt.FAILED
        spec: dict[str, Any] = dict(lease.get("spec") or {})
        holder = spec.get("holderIdentity") or None
        record = (
            holder,
            spec.get("renewTime"),
            spec.get("leaseDurationSeconds"),
            spec.get("leaseTransitions"),
        )
        if record != self._observed:
            self._observed, self._observed_at = record, trio.current_time()
        if holder != self.holder:
            self._log.info("new leader observed", holder=holder or "")
        self.holder = holder
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
        if (
            holder
            and holder != self.identity
            and trio.current_time() < self._observed_at + duration
        ):
            return _Attempt.TAKEN
        if holder != self.identity:
            spec["acquireTime"] = micro_time(now)
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        spec.update(
            holderIdentity=self.identity,
            renewTime=micro_time(now),
            leaseDurationSeconds=math.ceil(self.lease_duration),
        )
        lease["spec"] = spec
        try:
            self._lease = await self.client.update(LEASES, lease)
        except KubeError as exc:  # 409: someone wrote first; re-read next round
            self._log.debug("lease update failed", error=str(exc))
            return _Attempt.FAILED
        self._held(now)
        return _Attempt.HELD

    async def _create(self, now: datetime) -> _Attempt:
        lease = {
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": math.ceil(self.lease_duration),
                "acquireTime": micro_time(now),
                "renewTime": micro_time(now),
                "leaseTransitions": 0,
            },
        }
        try:
            self._lease = await self.client.create(LEASES, lease)
        except KubeError as exc:  # AlreadyExists: another candidate created it first
            self._log.debug("lease create failed", error=str(exc))
            return _Attempt.FAILED
        self._held(now)
        return _Attempt.HELD

    def _held(self, now: datetime) -> None:
        self.holder = self.identity
        self._last_renew = trio.current_time()

    async def _release(self) -> None:
        """Give the Lease up so a standby need not wait for it to expire."""
        try:
            lease = await self.client.get(LEASES, self.name, namespace=self.namespace)
            spec = dict(lease.get("spec") or {})
            if spec.get("holderIdentity") != self.identity:
                return
            now = micro_time()
            spec.update(holderIdentity=None, leaseDurationSeconds=1, renewTime=now, acquireTime=now)
            lease["spec"] = spec
            await self.client.update(LEASES, lease)
            self._log.info("leadership released")
        except KubeError as exc:
            self._log.warning("releasing lease failed", error=str(exc))
