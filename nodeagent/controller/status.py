"""What the controller tells users about their objects, and what replicas tell each other.

- `StatusWriter` (leader only) writes, from the latest recompute's `Outcome`: the servers'
  public address into every served Ingress's status (what `kubectl get ingress` shows
  under ADDRESS), ClusterTunnel status (nodes covered and connected, config version, a
  Ready condition) and finalizer, and an Event for each Problem in a user's object. Each
  write happens only when the object differs from what it should show.
- `WatcherReports` (every replica): agents watch whichever replica the Service picks, so
  each replica publishes the nodes watching it in a ConfigMap of its own, and the leader
  sums the live ones up for ClusterTunnel status. They feed status only, never config.
  The leader deletes the reports of replicas gone for `WATCHERS_GC_AFTER` (`collect`):
  every rollout of the controller leaves one behind.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import trio

from nodeagent.controller.bootstrap import SERVER_SERVICE
from nodeagent.controller.clustertunnel import CLUSTER_TUNNELS, FINALIZER
from nodeagent.controller.compute import Tunnel
from nodeagent.controller.ingress import Problem
from nodeagent.kube import (
    CONFIGMAPS,
    INGRESSES,
    NODES,
    SERVICES,
    Cache,
    EventRecorder,
    KubeClient,
    KubeError,
)
from nodeagent.kube.events import rfc3339
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.controller")
WATCHERS_LABEL = "nodeagent.io/watchers"
WATCHERS_PERIOD = 5.0
WATCHERS_STALE = 30.0  # reports older than this are from dead replicas
# A report not renewed for this long is deleted by the leader. Well past WATCHERS_STALE,
# so that a live replica cut off from the API for a while is not deleted meanwhile (it
# would create its report again anyway).
WATCHERS_GC_AFTER = 600.0
Obj = dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What one recompute found that the leader's writes need."""

    problems: tuple[Problem, ...]
    served: tuple[tuple[str, str], ...]  # (namespace, name) of the Ingresses we serve
    tunnels: tuple[Tunnel, ...]  # the valid ClusterTunnels, now in the configs
    tunnel_objects: tuple[Obj, ...]  # the ClusterTunnel objects they were parsed from
    nodes: tuple[Obj, ...]
    config_version: int  # of the servers' config


def public_addresses(services: Cache, namespace: str,
                     name: str = SERVER_SERVICE) -> list[dict[str, str]]:
    """The servers' public address: the LoadBalancer status of the server Service (or of
    Service `name`)."""
    service = services.get(name, namespace)
    if service is None:
        return []
    found = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    return [{k: v for k, v in entry.items() if k in ("ip", "hostname")} for entry in found
            if isinstance(entry, dict)]


class WatcherReports:
    """This replica's report of the nodes watching it, and the sum of all live reports."""

    def __init__(self, kube: KubeClient, cache: Cache, namespace: str, identity: str,
                 subscribers: Iterable[str]) -> None:
        self.kube = kube
        self.cache = cache
        self.namespace = namespace
        self.name = f"nodeagent-watchers-{identity}"[:253]
        self.subscribers = subscribers  # the config stream's keys of open watches

    async def publish(self) -> None:
        """Every WATCHERS_PERIOD: this replica's watching nodes into its ConfigMap (the
        `updated` stamp is the heartbeat that tells a live report from a dead one)."""
        ns = self.namespace
        while True:
            nodes = sorted(k[5:] for k in self.subscribers if k.startswith("node/"))
            body: dict[str, Any] = {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": self.name, "namespace": ns,
                             "labels": {WATCHERS_LABEL: "true",
                                        "app.kubernetes.io/name": "nodeagent"}},
                "data": {"nodes": "\n".join(nodes), "updated": rfc3339()}}
            try:
                current = self.cache.get(self.name, ns)
                if current is None:
                    await self.kube.create(CONFIGMAPS, body)
                else:
                    body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                    await self.kube.update(CONFIGMAPS, body)
            except KubeError as exc:
                log.info("watcher report not written", error=str(exc))
            await trio.sleep(WATCHERS_PERIOD)

    def connected_nodes(self) -> set[str]:
        """Nodes with a config watch open on any live replica (from their reports)."""
        now = datetime.now(UTC)
        nodes: set[str] = set()
        for report in self.cache.list():
            age = _report_age(report, now)
            if age is not None and age <= WATCHERS_STALE:
                data = report.get("data") or {}
                nodes.update(n for n in str(data.get("nodes", "")).split("\n") if n)
        return nodes

    async def collect(self) -> list[str]:
        """Delete the reports not renewed for WATCHERS_GC_AFTER (replicas gone); the
        leader's. Returns the names deleted. A report whose stamp cannot be read is left
        alone: it is not known to be old, and it counts for nothing meanwhile."""
        now = datetime.now(UTC)
        deleted = []
        for report in self.cache.list(namespace=self.namespace):
            meta = report.get("metadata") or {}
            name = str(meta.get("name"))
            age = _report_age(report, now)
            if name == self.name or age is None or age < WATCHERS_GC_AFTER:
                continue
            try:
                # The version as a precondition: a replica that came back and wrote its
                # report since keeps it.
                await self.kube.delete(CONFIGMAPS, name, namespace=self.namespace,
                                       resource_version=str(meta.get("resourceVersion")))
            except KubeError as exc:
                log.info("stale watcher report not deleted", report=name, error=str(exc)[:200])
                continue
            log.info("stale watcher report deleted", report=name, age_seconds=round(age))
            deleted.append(name)
        return deleted

    async def collect_forever(self, period: float = 60.0) -> None:
        while True:
            await self.collect()
            await trio.sleep(period)


def _report_age(report: Obj, now: datetime) -> float | None:
    """Seconds since a watcher report was last written, or None if its stamp is unreadable."""
    data = report.get("data") or {}
    try:
        updated = datetime.fromisoformat(str(data.get("updated", "")).replace("Z", "+00:00"))
    except ValueError:
        return None
    if updated.tzinfo is None:
        return None
    return (now - updated).total_seconds()


class StatusWriter:
    """The leader's writes about users' objects. Each method returns False if some write
    failed (a conflict, the API unreachable): the leader runs it again a little later."""

    def __init__(self, kube: KubeClient, caches: dict[str, Cache], namespace: str,
                 identity: str, watchers: WatcherReports) -> None:
        self.kube = kube
        self.caches = caches
        self.namespace = namespace
        self.watchers = watchers
        self.outcome: Outcome | None = None
        self.events = EventRecorder(kube, component="nodeagent-controller",
                                    instance=identity)

    async def write_events(self) -> bool:
        for problem in self.outcome.problems if self.outcome else ():
            resource = {"Ingress": INGRESSES, "ClusterTunnel": CLUSTER_TUNNELS,
                        "Node": NODES, "Service": SERVICES}.get(problem.kind)
            if resource is None:
                continue
            obj = self.caches[resource.plural].get(problem.name, problem.namespace or None)
            if obj is not None:  # best effort: the recorder logs what it cannot write
                await self.events.warning(obj, problem.reason, problem.message)
        return True

    async def write_ingress_status(self) -> bool:
        """Every Ingress we serve shows the servers' public address; written only when
        it differs."""
        if self.outcome is None:
            return True
        wanted = public_addresses(self.caches["services"], self.namespace)
        ingresses = self.caches["ingresses"]
        complete = True
        for namespace, name in self.outcome.served:
            ingress = ingresses.get(name, namespace)
            if ingress is None:
                continue
            current = ((ingress.get("status") or {}).get("loadBalancer") or {}).get("ingress")
            if (current or []) == wanted:
                continue
            update = dict(ingress, status={"loadBalancer": {"ingress": wanted}})
            try:
                await self.kube.update_status(INGRESSES, update)
            except KubeError as exc:
                log.info("Ingress status not written yet", ingress=f"{namespace}/{name}",
                         error=str(exc))
                complete = False
        return complete

    async def write_tunnel_status(self) -> bool:
        """ClusterTunnel status and finalizer: added to live tunnels; removed from a
        deleted one once a published config no longer carries its rules (the latest
        recompute left it out)."""
        outcome = self.outcome
        if outcome is None:
            return True
        report = tunnel_report(outcome, self.watchers.connected_nodes())
        in_config = {t.name for t in outcome.tunnels}
        complete = True
        for obj in self.caches["clustertunnels"].list():
            meta = obj["metadata"]
            name = meta["name"]
            finalizers = list(meta.get("finalizers") or [])
            try:
                if meta.get("deletionTimestamp"):
                    if FINALIZER in finalizers and name not in in_config:
                        finalizers.remove(FINALIZER)
                        await self.kube.update(CLUSTER_TUNNELS, dict(
                            obj, metadata=dict(meta, finalizers=finalizers)))
                        log.info("ClusterTunnel released: its rules are out of every node "
                                 "config", tunnel=name)
                    continue
                if FINALIZER not in finalizers:
                    obj = await self.kube.update(CLUSTER_TUNNELS, dict(
                        obj, metadata=dict(meta, finalizers=[*finalizers, FINALIZER])))
                status = report.get(name)
                if status is not None:
                    status = _keep_transition_times(obj.get("status") or {}, status)
                if status is not None and obj.get("status") != status:
                    await self.kube.update_status(CLUSTER_TUNNELS, dict(obj, status=status))
            except KubeError as exc:
                log.info("ClusterTunnel not updated yet", tunnel=name, error=str(exc))
                complete = False
        return complete


def tunnel_report(outcome: Outcome, connected: set[str]) -> dict[str, dict[str, Any]]:
    """The status each ClusterTunnel of the outcome should show (camelCase, as in the
    CRD)."""
    valid = {t.name: t for t in outcome.tunnels}
    report = {}
    for obj in outcome.tunnel_objects:
        meta = obj.get("metadata") or {}
        name = meta.get("name", "")
        mine = [p for p in outcome.problems if p.kind == "ClusterTunnel" and p.name == name]
        tunnel = valid.get(name)
        names = [] if tunnel is None else [
            str((n.get("metadata") or {}).get("name")) for n in outcome.nodes
            if tunnel.spec.covers((n.get("metadata") or {}).get("labels") or {})]
        covered = len(names)
        ready = "True" if tunnel is not None and not mine else "False"
        condition = {"type": "Ready", "status": ready,
                     "reason": mine[0].reason if mine else "Applied",
                     "message": mine[0].message if mine else
                     f"config for {covered} node(s) published"}
        report[name] = {"observedGeneration": meta.get("generation", 0),
                        "nodesCovered": covered,
                        "nodesConnected": sum(1 for n in names if n in connected),
                        "configVersion": outcome.config_version,
                        "conditions": [condition]}
    return report


def _keep_transition_times(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """lastTransitionTime changes only when a condition's status does."""
    before = {c.get("type"): c for c in old.get("conditions") or []}
    conditions = []
    for cond in new["conditions"]:
        prior = before.get(cond["type"])
        same = prior is not None and prior.get("status") == cond["status"]
        when = prior.get("lastTransitionTime") if same and prior else rfc3339()
        conditions.append(dict(cond, lastTransitionTime=when))
    return dict(new, conditions=conditions)
