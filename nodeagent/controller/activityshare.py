"""Scale to zero: the Services each controller replica's servers report busy (requests in
flight or held), shared between replicas through the API, so the leader's sleep decision
counts the servers of every replica and not only its own.

Servers report to the replica they watch, which may be a standby. The last request
reaches the leader through the Service's `nodeagent.io/last-request` annotation, written
at most every `max(activity interval, idle-after / 10)`: too late for "in flight", since a
silent open connection (a held, then relayed, LoadBalancer connection) or a long request
makes no new request at all. So every replica publishes the Services its servers report
busy in a ConfigMap of its own (`nodeagent-activity-<identity>`, label `ACTIVITY_LABEL`,
in the controller's namespace), as it already publishes the agents watching it:

    data:
      busy: "shop/web\\nshop/api"   # namespace/name, one a line
      valid-for: "31"              # seconds the record holds without a renewal
      updated: "2026-11-27T11:36:12.123456Z"

It writes at once when a Service becomes busy, every `refresh` while any is, and once
more when none is. Every replica caches these records (one watch); the leader counts a
Service busy while another replica's record lists it and that record was seen to change
less than its `valid-for` ago. Seen on the leader's own clock, as leader election
measures a Lease, so the replicas' clocks need not agree.

Restarts: a replica that dies stops renewing, so its record expires (never busy forever);
a leader restarted reads every record afresh, but one whose writer's `updated` stamp is
older than `valid-for` + `SKEW` is from a dead replica and is not taken as news; the
leader deletes records older than `GC_AFTER`. A report that is missing (a leader new to
its role, which has not heard every replica's servers yet) is not taken for idleness:
the sleeper decides nothing for `valid_for` after it starts leading (sleeper.py).

Why the API and not posts from replica to replica: replicas have neither an address nor
an identity for one another, and the API is where they already coordinate (the Lease,
the watcher reports); it needs no listener, trust or discovery of its own, and survives
any replica restarting. Cost: one write per replica per `refresh` while a Service is
busy, whatever the number of Services.

A record this module cannot read in part (a line that is not `namespace/name`, a
`valid-for` that is not a number of seconds) is read in the part it can: bad lines are
skipped, a bad `valid-for` takes this replica's own; each is counted
(`scale_to_zero_bad_activity_record`) and logged, rate-limited.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from nodeagent.kube import CONFIGMAPS, KubeClient, KubeError
from nodeagent.kube.errors import NotFound
from nodeagent.kube.informer import Cache
from nodeagent.kube.leader import micro_time
from nodeagent.ops.logs import get_logger
from tunnel.log import RateLimitedLog

log = get_logger("nodeagent.controller.activityshare")

ACTIVITY_LABEL = "nodeagent.io/activity"
SKEW = 60.0  # seconds the replicas' clocks may disagree before a record is called stale
GC_AFTER = 3600.0  # a record not renewed for this long is deleted by the leader
MAX_VALID_FOR = 3600.0
# A ConfigMap holds at most 1 MiB: a record lists at most this many bytes of Services
# (~3,000 of the longest names, ~30,000 of usual ones); the rest are logged, not shared.
MAX_BUSY_BYTES = 900_000

Key = tuple[str, str]  # (namespace, name) of a Service


def record_name(identity: str) -> str:
    return f"nodeagent-activity-{identity}"[:253]


def _parse_key(line: str) -> Key | None:
    namespace, slash, name = line.partition("/")
    if not slash or not namespace or not name or "/" in name or len(line) > 320:
        return None
    return namespace, name


@dataclass
class Record:
    """One replica's record as read: the Services it lists and how long it holds."""

    busy: frozenset[Key]
    valid_for: float
    updated: float | None  # the writer's clock; None when unreadable
    problems: tuple[str, ...] = ()


def parse_record(data: object, default_valid_for: float) -> Record:
    """A record's `data`, read in what it can (see the module docstring)."""
    problems: list[str] = []
    if not isinstance(data, dict):
        return Record(frozenset(), default_valid_for, None, ("data is not a map",))
    busy: set[Key] = set()
    text = data.get("busy", "")
    if not isinstance(text, str):
        problems.append("busy is not text")
        text = ""
    for line in text.split("\n"):
        if not line:
            continue
        key = _parse_key(line)
        if key is None:
            problems.append(f"not a namespace/name: {line[:80]!r}")
        else:
            busy.add(key)
    valid_for = default_valid_for
    raw = data.get("valid-for")
    try:
        value = float(str(raw))
        if not 0 < value <= MAX_VALID_FOR or not math.isfinite(value):
            raise ValueError(raw)
        valid_for = value
    except ValueError:
        problems.append(f"valid-for is not seconds in (0, {MAX_VALID_FOR:g}]: "
                        f"{str(raw)[:40]!r}")
    updated: float | None = None
    try:
        updated = dt.datetime.fromisoformat(
            str(data.get("updated", "")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        problems.append("updated is not a time")
    return Record(frozenset(busy), valid_for, updated, tuple(problems))


@dataclass
class SharedActivity:
    """This replica's record (`publish_forever`) and the others' (`busy`, `collect`)."""

    kube: KubeClient
    cache: Cache  # the records: ConfigMaps of the namespace with ACTIVITY_LABEL
    namespace: str
    identity: str
    refresh: float = 10.0  # rewrite this often while a Service is busy
    valid_for: float = 31.0  # what this replica's records say
    tick: float = 1.0  # the publisher looks at least this often
    clock: Callable[[], float] = time.time
    on_problem: Callable[[], None] | None = None  # counts a record read in part
    writes: int = 0
    # name → (resourceVersion, when this replica saw it, the record read from it)
    _seen: dict[str, tuple[str, float, Record]] = field(default_factory=dict)
    _changed: trio.Event = field(default_factory=trio.Event)
    _limited: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))

    @property
    def name(self) -> str:
        return record_name(self.identity)

    def changed(self) -> None:
        """A Service became busy here: publish now rather than at the next refresh."""
        self._changed.set()

    # -- the others' records (the leader) -----------------------------------------------

    def busy(self) -> set[Key]:
        """Services another replica's live record lists."""
        now = self.clock()
        out: set[Key] = set()
        names = set()
        for obj in self.cache.list(namespace=self.namespace):
            meta = obj.get("metadata") or {}
            name = str(meta.get("name") or "")
            names.add(name)
            if name == self.name:
                continue  # this replica's servers: its own memory is fresher
            version = str(meta.get("resourceVersion") or "")
            seen = self._seen.get(name)
            if seen is None or seen[0] != version:
                seen = self._seen[name] = (version, now, self._read(name, obj))
            _, seen_at, record = seen
            if now - seen_at > record.valid_for:
                continue  # not renewed: its replica is gone or has nothing busy to say
            if record.updated is not None and \
                    now - record.updated > record.valid_for + SKEW:
                continue  # written long ago (seen afresh after this replica restarted)
            out |= record.busy
        for name in [n for n in self._seen if n not in names]:
            del self._seen[name]
        return out

    def _read(self, name: str, obj: dict[str, Any]) -> Record:
        """A record's new version, its problems counted and logged once."""
        record = parse_record(obj.get("data"), self.valid_for)
        if record.problems:
            if self.on_problem is not None:
                self.on_problem()
            self._limited.warning(f"record:{name}", "an activity record read in part",
                                  record=name, problems="; ".join(record.problems)[:300])
        return record

    async def collect(self) -> None:
        """Delete records not renewed for GC_AFTER (replicas long gone); the leader's."""
        now = self.clock()
        for obj in self.cache.list(namespace=self.namespace):
            meta = obj.get("metadata") or {}
            record = parse_record(obj.get("data"), self.valid_for)
            if record.updated is None or now - record.updated < GC_AFTER or \
                    meta.get("name") == self.name:
                continue
            try:
                await self.kube.delete(CONFIGMAPS, str(meta.get("name")),
                                       namespace=self.namespace,
                                       resource_version=str(meta.get("resourceVersion")))
            except KubeError as exc:
                self._limited.warning("gc", "stale activity record not deleted",
                                   record=meta.get("name"), error=str(exc)[:200])

    # -- this replica's record -----------------------------------------------------------

    async def publish_forever(self, busy: Callable[[], set[Key]]) -> None:
        """Write `busy()` into this replica's record whenever it changes, and every
        `refresh` while it is not empty."""
        published: frozenset[Key] | None = None
        published_at = -math.inf
        while True:
            changed = self._changed = trio.Event()
            now = self.clock()
            wanted = frozenset(busy())
            if wanted != published or (wanted and now - published_at >= self.refresh):
                if await self._write(wanted):
                    published, published_at = wanted, now
            with trio.move_on_after(self.tick):
                await changed.wait()

    async def _write(self, busy: frozenset[Key]) -> bool:
        lines: list[str] = []
        size = 0
        for namespace, name in sorted(busy):
            line = f"{namespace}/{name}"
            size += len(line) + 1
            if size > MAX_BUSY_BYTES:
                self._limited.warning("toolarge", "more busy Services than an activity "
                                      "record holds; the rest are not shared",
                                      listed=len(lines), busy=len(busy))
                break
            lines.append(line)
        data = {"busy": "\n".join(lines), "valid-for": f"{self.valid_for:g}",
                # Microseconds: every renewal changes the object (a write of the same
                # content would keep its resourceVersion, and readers would not see it).
                "updated": micro_time(dt.datetime.fromtimestamp(self.clock(), dt.UTC))}
        try:
            try:
                await self.kube.patch(CONFIGMAPS, self.name, namespace=self.namespace,
                                      patch={"data": data})
            except NotFound:
                await self.kube.create(CONFIGMAPS, {
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": self.name, "namespace": self.namespace,
                                 "labels": {ACTIVITY_LABEL: "true",
                                            "app.kubernetes.io/name": "nodeagent"}},
                    "data": data})
        except KubeError as exc:
            self._limited.warning("write", "activity record not written; trying again",
                                  error=str(exc)[:200])
            return False
        self.writes += 1
        return True
