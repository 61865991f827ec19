"""Scale to zero, the writes: putting idle workloads to sleep (the leader only) and waking
them when a server asks (any replica), through the scale subresource.

Activity: servers report, per sleepable Service, the seconds since its last request and
the requests in flight or held (`report`). Every replica keeps what it hears, writes the
last request to the Service (`nodeagent.io/last-request`, at most once per
`max(activity_interval, idle_after / 10)`), and publishes the Services its servers report
busy in a record of its own (`activityshare`), so the leader decides on what servers
watching a standby reported too, and a new leader does not forget. The leader puts a
Service's workload to sleep when no request was in flight or held in the last reports of
any replica's servers, the last request is older than `idle-after`, the workload has been
awake at least `min_awake`, and it has led for one record's validity at least (a report
it has not heard yet is not idleness):
it records the replica count on the workload (`nodeagent.io/replicas-before-sleep`),
scales it to 0 and says so on the Service (`nodeagent.io/scale-to-zero`: state, since,
workload) and in an Event.

Waking (`wake`): asked by a server for a Service the servers' routes hold as sleepable.
One wake at a time per Service in this replica (a second ask while one runs is answered
"waking" at once); the scale write carries the resourceVersion of the Scale it read, so
of two replicas waking at once only one write succeeds (the other reads the count the
first set): one scale patch however many servers, requests and replicas ask. The leader
marks the Service awake once its endpoints are ready, with the cold start in an Event.

What workload: `nodeagent.io/workload` on the Service, else the one remembered in its
state, else the owner of its pods (a ReplicaSet's Deployment, read once, or a
StatefulSet).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from nodeagent.configstream.protocol import ACTIVITY, ReportError, parse_activity, parse_wake
from nodeagent.controller.activityshare import SharedActivity
from nodeagent.controller.metrics import ControllerMetrics
from nodeagent.controller.wakeroutes import (
    LAST_REQUEST,
    REPLICAS_BEFORE_SLEEP,
    STATE,
    WakeSettings,
    read_state,
    workload_owner,
)
from nodeagent.kube import KubeClient, KubeError
from nodeagent.kube.errors import Conflict, NotFound
from nodeagent.kube.events import EventRecorder
from nodeagent.kube.informer import Cache
from nodeagent.kube.resources import (
    DEPLOYMENTS,
    REPLICASETS,
    SERVICES,
    STATEFULSETS,
    Resource,
)
from nodeagent.ops.jsonhttp import Reply, json_reply
from nodeagent.ops.logs import get_logger
from tunnel.log import RateLimitedLog

log = get_logger("nodeagent.controller.sleeper")

Key = tuple[str, str]  # (namespace, name) of a Service
WORKLOADS: dict[str, Resource] = {"deployments": DEPLOYMENTS, "statefulsets": STATEFULSETS}


def _now_text(when: float) -> str:
    return dt.datetime.fromtimestamp(when, dt.UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


def _parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class Activity:
    last_request: float = 0.0  # wall clock of the latest request any report implied
    busy_until: float = 0.0  # a report said requests were in flight or held: busy till
    flushed: float = 0.0  # when this replica last wrote last_request to the Service


@dataclass
class SleeperSettings:
    min_awake: float = 60.0  # a woken workload stays up at least this long
    activity_interval: float = 10.0  # the servers' report interval (RoutesConfig)
    tick: float = 1.0  # seconds between the leader's passes


# The Services cache's index of those with a state annotation (`_has_state`).
STATE_INDEX = "nodeagent-scale-to-zero-state"


def _has_state(service: dict[str, Any]) -> tuple[str, ...]:
    annotations = (service.get("metadata") or {}).get("annotations") or {}
    return (STATE,) if annotations.get(STATE) else ()


@dataclass
class Sleeper:
    kube: KubeClient
    services: Cache
    slices: Cache
    pods: Cache
    settings: SleeperSettings = field(default_factory=SleeperSettings)
    metrics: ControllerMetrics | None = None
    clock: Callable[[], float] = time.time
    # The latest recompute's sleepable Services (wakeroutes.apply_wake) and whether the
    # feature is on (no ClusterTunnel switched it off).
    enabled: dict[Key, WakeSettings] = field(default_factory=dict)
    feature_on: bool = True
    activity: dict[Key, Activity] = field(default_factory=dict)
    scale_writes: int = 0  # successful scale writes (sleep and wake), this replica
    sleeps: int = 0
    wakes: int = 0
    _waking: dict[Key, trio.Event] = field(default_factory=dict)
    # Workloads found from a Service's pods (a ReplicaSet read), for the Services enabled
    # now: `set_enabled` forgets the others, so a Service deleted or opted out costs
    # nothing after the next recompute, and one that opts in again is looked up afresh.
    _workloads: dict[Key, tuple[str, str]] = field(default_factory=dict)
    _limited: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))
    _events: EventRecorder | None = None
    # The Services every replica's servers report busy (None: this replica's own only,
    # as in tests of one replica), and since when this replica leads.
    shared: SharedActivity | None = None
    _leading_since: float | None = None

    def __post_init__(self) -> None:
        self._events = EventRecorder(self.kube, component="nodeagent-controller")
        # The Services carrying our state annotation, kept by the cache as they change:
        # `_wake_disabled` runs every tick and reads only those (walking every Service
        # for it cost ~40 ms a second at 10,000 Services, in the middle of fan-outs).
        self.services.add_index(STATE_INDEX, _has_state)

    def set_enabled(self, enabled: dict[Key, WakeSettings], feature_on: bool) -> None:
        """The latest recompute's sleepable Services; what this replica remembers of the
        others (their activity, their workload) is forgotten."""
        self.enabled, self.feature_on = enabled, feature_on
        for memo in (self._workloads, self.activity):
            for key in [k for k in memo if k not in enabled]:
                del memo[key]

    # -- from servers (the config stream's report endpoints) --------------------------

    async def answer(self, kind: str, server_id: str, body: bytes) -> Reply:
        try:
            if kind == ACTIVITY:
                self.report(parse_activity(body))
                return json_reply(200, {"state": "recorded"})
            service = parse_wake(body)
        except (ReportError, ValueError) as exc:
            return self._refused(server_id, 400, {"error": str(exc)[:200],
                                                  "reason": "bad_report"})
        namespace, _, name = service.partition("/")
        status, doc = await self.wake((namespace, name), asked_by=server_id)
        if status >= 400:
            return self._refused(server_id, status, doc)
        return json_reply(status, doc)

    def _refused(self, server_id: str, status: int, doc: dict[str, Any]) -> Reply:
        """A report or wake turned away: counted by reason, logged rate-limited."""
        reason = str(doc.get("reason", "refused"))
        if self.metrics is not None:
            self.metrics.config(f"scale_to_zero_{reason}")
        self._limited.warning(f"refused:{reason}", "scale-to-zero request refused",
                              reason=reason, server=server_id,
                              error=str(doc.get("error", ""))[:200])
        return json_reply(status, doc)

    def report(self, services: dict[str, tuple[float | None, int]]) -> None:
        now = self.clock()
        busy_for = 2.5 * self.settings.activity_interval
        for text, (idle, in_flight) in services.items():
            namespace, _, name = text.partition("/")
            key = (namespace, name)
            if key not in self.enabled:
                continue  # nothing to remember for a Service that does not sleep
            entry = self.activity.setdefault(key, Activity())
            if idle is not None:
                entry.last_request = max(entry.last_request, now - idle)
            if in_flight > 0:
                if entry.busy_until <= now and self.shared is not None:
                    self.shared.changed()  # newly busy: the other replicas learn it now
                entry.busy_until = max(entry.busy_until, now + busy_for)
                entry.last_request = now

    def busy(self) -> set[Key]:
        """The awake Services this replica's servers report requests in flight or held
        for: what the other replicas are told (activityshare). One asleep or waking is
        left out (its requests are held, and the leader sleeps only an awake one): no
        write to the API in the middle of every wake."""
        now = self.clock()
        out = set()
        for key, entry in self.activity.items():
            if entry.busy_until > now:
                service = self.services.get(key[1], key[0])
                if service is None or read_state(service).get("state", "awake") == "awake":
                    out.add(key)
        return out

    # -- waking (any replica) ----------------------------------------------------------

    async def wake(self, key: Key, *, asked_by: str = "") -> tuple[int, dict[str, Any]]:
        """Wake the Service's workload if it sleeps; (HTTP status, answer)."""
        label = f"{key[0]}/{key[1]}"
        if not self.feature_on or key not in self.enabled:
            return 404, {"error": f"{label} is not a Service the servers' routes let "
                         f"sleep", "reason": "not_sleepable"}
        entry = self.activity.setdefault(key, Activity())
        entry.last_request = self.clock()
        if key in self._waking:
            return 202, {"state": "waking"}
        done = self._waking[key] = trio.Event()
        try:
            return await self._wake(key, asked_by)
        except KubeError as exc:
            self._limited.warning(f"wake:{label}", "cannot wake a Service's workload",
                                  service=label, error=str(exc)[:200])
            return 503, {"error": f"cannot wake {label}: {exc}"[:300],
                         "reason": "api_error"}
        finally:
            del self._waking[key]
            done.set()

    async def _wake(self, key: Key, asked_by: str) -> tuple[int, dict[str, Any]]:
        label = f"{key[0]}/{key[1]}"
        service = self.services.get(key[1], key[0])
        if service is None:
            return 404, {"error": f"Service {label} not found", "reason": "not_found"}
        workload = await self._workload(key, service)
        if workload is None:
            return 409, {"error": f"no workload found for Service {label}: name it with "
                         f"nodeagent.io/workload", "reason": "no_workload"}
        resource = WORKLOADS[workload[0]]
        for _ in range(3):
            try:
                scale = await self._get_scale(resource, key[0], workload[1])
            except NotFound:
                # Replaced under another name since it was found: look again next time.
                self._workloads.pop(key, None)
                raise
            if int((scale.get("spec") or {}).get("replicas") or 0) > 0:
                return 202, {"state": "waking" if not self._ready(key) else "awake"}
            obj = await self.kube.get(resource, workload[1], namespace=key[0])
            annotations = (obj.get("metadata") or {}).get("annotations") or {}
            try:
                replicas = max(1, int(str(annotations.get(REPLICAS_BEFORE_SLEEP, "1"))))
            except ValueError:
                replicas = 1
            try:
                await self.kube.request(
                    "PUT", resource.path(key[0], workload[1], "scale"), write=True,
                    body={"apiVersion": "autoscaling/v1", "kind": "Scale",
                          "metadata": {"name": workload[1], "namespace": key[0],
                                       "resourceVersion": scale["metadata"]["resourceVersion"]},
                          "spec": {"replicas": replicas}})
            except Conflict:
                continue  # another replica (or a user) wrote it: read it again
            self.scale_writes += 1
            self.wakes += 1
            if self.metrics is not None:
                self.metrics.scale_to_zero.labels("wake").inc()
            now = self.clock()
            log.info("waking a Service's workload", service=label,
                     workload=f"{workload[0]}/{workload[1]}", replicas=replicas,
                     asked_by=asked_by)
            await self._set_state(service, "waking", now, workload, replicas)
            await self._event(service, "Waking", f"a request came: scaling "
                              f"{resource.kind.lower()}/{workload[1]} from 0 to {replicas} "
                              f"replicas")
            return 202, {"state": "waking"}
        return 503, {"error": f"{label}: the scale of its workload keeps changing",
                     "reason": "conflict"}

    async def _get_scale(self, resource: Resource, namespace: str, name: str
                         ) -> dict[str, Any]:
        scale: dict[str, Any] = await self.kube.request(
            "GET", resource.path(namespace, name, "scale"))
        return scale

    def _ready(self, key: Key) -> bool:
        """Whether the Service has a ready endpoint (its EndpointSlices, cached)."""
        for es in self.slices.list(namespace=key[0]):
            labels = (es.get("metadata") or {}).get("labels") or {}
            if labels.get("kubernetes.io/service-name") != key[1]:
                continue
            for endpoint in es.get("endpoints") or []:
                if (endpoint.get("conditions") or {}).get("ready") is not False and \
                        endpoint.get("addresses"):
                    return True
        return False

    async def _workload(self, key: Key, service: dict[str, Any]) -> tuple[str, str] | None:
        settings = self.enabled.get(key)
        if settings is not None and settings.workload is not None:
            return settings.workload
        state = read_state(service)
        plural, _, name = str(state.get("workload") or "").partition("/")
        if plural in WORKLOADS and name:
            return plural, name
        known = self._workloads.get(key)
        if known is not None:
            return known
        owner = workload_owner(service, self.pods.list(namespace=key[0]))
        if owner is None:
            return None
        kind, name = owner
        if kind == "StatefulSet":
            found = ("statefulsets", name)
        else:
            try:
                rs = await self.kube.get(REPLICASETS, name, namespace=key[0])
            except NotFound:
                return None
            refs = [r for r in (rs.get("metadata") or {}).get("ownerReferences") or []
                    if r.get("controller") and r.get("kind") == "Deployment"]
            if not refs:
                return None
            found = ("deployments", str(refs[0]["name"]))
        self._workloads[key] = found
        return found

    # -- every replica: activity to the Service; the leader: sleep decisions ------------

    async def run(self, is_leader: Callable[[], bool]) -> None:
        async with trio.open_nursery() as nursery:
            if self.shared is not None:
                nursery.start_soon(self.shared.publish_forever, self.busy)
            await self._passes(is_leader)

    async def _passes(self, is_leader: Callable[[], bool]) -> None:
        passes = 0
        while True:
            await trio.sleep(self.settings.tick)
            leading = is_leader()
            if not leading:
                self._leading_since = None
            elif self._leading_since is None:
                self._leading_since = self.clock()
            elsewhere = self.shared.busy() if leading and self.shared is not None else set()
            for key in list(self.enabled):
                try:
                    await self._flush(key)
                    if leading:
                        await self._consider(key, busy_elsewhere=key in elsewhere)
                except KubeError as exc:
                    self._limited.warning(f"pass:{key}", "scale to zero: API write failed; "
                                          "trying again", service=f"{key[0]}/{key[1]}",
                                          error=str(exc)[:200])
            if leading:
                await self._wake_disabled()
                passes += 1
                if self.shared is not None and passes % 600 == 1:
                    await self.shared.collect()

    async def _flush(self, key: Key) -> None:
        entry = self.activity.get(key)
        settings = self.enabled.get(key)
        if entry is None or settings is None or not entry.last_request:
            return
        service = self.services.get(key[1], key[0])
        if service is None:
            return
        written = _parse_time((service.get("metadata") or {}).get("annotations", {}).get(
            LAST_REQUEST)) or 0.0
        # At most once per `every`, whenever the Service's record is behind (a Service
        # replaced whole loses it: written again at once).
        every = max(self.settings.activity_interval, settings.idle_after / 10)
        now = self.clock()
        if entry.last_request <= written + 0.001 or now - entry.flushed < every:
            return
        entry.flushed = now
        await self.kube.patch(SERVICES, key[1], namespace=key[0], patch={
            "metadata": {"annotations": {LAST_REQUEST: _now_text(entry.last_request)}}})

    async def _consider(self, key: Key, *, busy_elsewhere: bool = False) -> None:
        settings = self.enabled[key]
        service = self.services.get(key[1], key[0])
        if service is None:
            return
        now = self.clock()
        state = read_state(service)
        phase = state.get("state", "awake")
        since = _parse_time(state.get("since")) or 0.0
        if phase in ("sleeping", "waking"):
            if self._ready(key):
                workload = await self._workload(key, service)
                await self._set_state(service, "awake", now, workload,
                                      state.get("replicas"))
                if phase == "waking":
                    await self._event(service, "Awake", f"endpoints ready "
                                      f"{now - since:.1f}s after the wake")
            return
        entry = self.activity.setdefault(key, Activity())
        written = _parse_time((service.get("metadata") or {}).get("annotations", {}).get(
            LAST_REQUEST)) or 0.0
        if not since:
            # Never seen asleep: awake from when this controller first saw it opt in.
            since = entry.last_request or now
            if not entry.last_request:
                entry.last_request = now
        last = max(entry.last_request, written, since)
        if entry.busy_until > now or busy_elsewhere or now - last < settings.idle_after or \
                now - since < self.settings.min_awake or not self._led_long_enough(now):
            return
        await self._sleep(key, service, now - last)

    def _led_long_enough(self, now: float) -> bool:
        """Led for one record's validity: every replica's busy Services were heard (a
        report not heard yet is not idleness)."""
        if self.shared is None:
            return True
        return self._leading_since is not None and \
            now - self._leading_since >= self.shared.valid_for

    async def _sleep(self, key: Key, service: dict[str, Any], idle: float) -> None:
        label = f"{key[0]}/{key[1]}"
        workload = await self._workload(key, service)
        if workload is None:
            self._limited.warning(f"noworkload:{label}", "scale to zero: no workload found "
                                  "for a Service; name it with nodeagent.io/workload",
                                  service=label)
            return
        resource = WORKLOADS[workload[0]]
        scale = await self._get_scale(resource, key[0], workload[1])
        replicas = int((scale.get("spec") or {}).get("replicas") or 0)
        if replicas == 0:
            await self._set_state(service, "sleeping", self.clock(), workload, None)
            return
        await self.kube.patch(resource, workload[1], namespace=key[0], patch={
            "metadata": {"annotations": {REPLICAS_BEFORE_SLEEP: str(replicas)}}})
        try:
            await self.kube.request(
                "PUT", resource.path(key[0], workload[1], "scale"), write=True,
                body={"apiVersion": "autoscaling/v1", "kind": "Scale",
                      "metadata": {"name": workload[1], "namespace": key[0]},
                      "spec": {"replicas": 0}})
        except Conflict:
            return  # changed meanwhile: the next pass decides again
        self.scale_writes += 1
        self.sleeps += 1
        if self.metrics is not None:
            self.metrics.scale_to_zero.labels("sleep").inc()
        log.info("put a Service's workload to sleep", service=label,
                 workload=f"{workload[0]}/{workload[1]}", replicas=replicas,
                 idle=f"{idle:.1f}s")
        await self._set_state(service, "sleeping", self.clock(), workload, replicas)
        await self._event(service, "Sleeping", f"no request for {idle:.0f}s: scaled "
                          f"{resource.kind.lower()}/{workload[1]} from {replicas} to 0 "
                          f"replicas; the next request wakes it")

    async def _wake_disabled(self) -> None:
        """Services left asleep when the feature was switched off or their annotation
        removed: woken (their workload restored) and their state removed."""
        for service in self.services.by_index(STATE_INDEX, STATE):
            meta = service.get("metadata") or {}
            key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
            if key in self.enabled and self.feature_on:
                continue
            state = read_state(service)
            if not state:
                continue
            if state.get("state") == "sleeping":
                status, _ = await self._wake(key, "controller")
                if status >= 300:
                    continue  # no workload to restore: keep the record, try again later
            await self.kube.patch(SERVICES, key[1], namespace=key[0], patch={
                "metadata": {"annotations": {STATE: None, LAST_REQUEST: None}}})

    async def _set_state(self, service: dict[str, Any], phase: str, when: float,
                         workload: tuple[str, str] | None, replicas: Any) -> None:
        meta = service.get("metadata") or {}
        doc: dict[str, Any] = {"state": phase, "since": _now_text(when)}
        if workload is not None:
            doc["workload"] = f"{workload[0]}/{workload[1]}"
        if replicas is not None:
            doc["replicas"] = replicas
        await self.kube.patch(SERVICES, str(meta.get("name")),
                              namespace=str(meta.get("namespace")), patch={
                                  "metadata": {"annotations": {
                                      STATE: json.dumps(doc, separators=(",", ":"))}}})

    async def _event(self, service: dict[str, Any], reason: str, message: str) -> None:
        assert self._events is not None
        try:
            await self._events.normal(service, reason, message)
        except KubeError as exc:
            self._limited.warning("event", "scale to zero: Event not written",
                                  error=str(exc)[:200])

