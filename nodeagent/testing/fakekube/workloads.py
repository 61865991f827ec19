"""A small simulated workload controller for the fake API server: what the Deployment,
ReplicaSet and StatefulSet controllers, the scheduler, the kubelet and the EndpointSlice
controller would do, just enough for scale-to-zero tests to run against the same client
code a real cluster runs.

    sim = WorkloadSimulator(fake.store, start_delay=1.0)
    nursery.start_soon(sim.run)

For every Deployment and StatefulSet it keeps `spec.replicas` pods (a Deployment through
one ReplicaSet it owns, pods named `<rs>-xxxxx`; a StatefulSet's pods `<name>-0..N-1`),
owned by their controller (ownerReferences, so the store's garbage collector removes
them with it). A new pod is created at once, Pending and without an address; it turns
Running and Ready `start_delay` seconds later. At 0 replicas the pods are deleted at once.
Every Service with a selector that matches simulated pods gets one EndpointSlice,
`<service>-sim`, listing those pods that have an address (ready or not), its ports
resolved from the Service's `targetPort` against the pod template's container ports; the
workload's status (replicas, readyReplicas, availableReplicas) follows.

Each EndpointSlice write carries the wall-clock time it was made (`WRITTEN_AT`), for
tests that time what follows an endpoint becoming ready.

Per-workload knobs, as annotations on the Deployment or StatefulSet:
- `sim.fakekube.nodeagent.io/start-delay: "2.5"` — seconds from creation to Ready.
- `sim.fakekube.nodeagent.io/crash: "<message>"` — the container never starts: the pod
  goes Running but not Ready, its container waiting in CrashLoopBackOff with the message
  as the last termination's, and the endpoint is listed not ready.
Pods go on the template's `spec.nodeName` (else `node`), holding `pod_ip`.

Differences from a cluster: no rolling updates (a template change does not replace pods),
no scheduling, no readiness probes, one ReplicaSet per Deployment, one EndpointSlice per
Service, and pods are deleted without a grace period.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from nodeagent.testing.fakekube.errors import ApiError
from nodeagent.testing.fakekube.objects import Obj, now_rfc3339
from nodeagent.testing.fakekube.registry import ResourceType
from nodeagent.testing.fakekube.scale import replicas_of
from nodeagent.testing.fakekube.selectors import labels_match, parse_label_selector
from nodeagent.testing.fakekube.store import Store

START_DELAY = "sim.fakekube.nodeagent.io/start-delay"
CRASH = "sim.fakekube.nodeagent.io/crash"
MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
# On each EndpointSlice the simulator writes: the wall-clock time (seconds, time.time())
# of that write, so a test can time what follows an endpoint becoming ready.
WRITTEN_AT = "sim.fakekube.nodeagent.io/written-at"
SIMULATOR = "workloads.fakekube.nodeagent.io"
WORKLOAD_KINDS = (("apps", "deployments"), ("apps", "statefulsets"))
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"


@dataclass
class WorkloadSimulator:
    """Reconciles the store's workloads into pods and EndpointSlices until cancelled."""

    store: Store
    start_delay: float = 1.0
    node: str = "node-1"
    pod_ip: str = "127.0.0.1"
    rng: random.Random = field(default_factory=random.Random)
    # pod key (namespace, name) → monotonic time it becomes Ready
    _starting: dict[tuple[str, str], float] = field(default_factory=dict)
    _poke: trio.Event = field(default_factory=trio.Event)

    def _rt(self, group: str, plural: str) -> ResourceType:
        return self.store.types[(group, plural)]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            for key in (*WORKLOAD_KINDS, ("", "services"), ("", "pods")):
                watcher = self.store.watch(self._rt(*key), "v1", None)
                nursery.start_soon(self._follow, watcher.receive)
            task_status.started()
            while True:
                self.reconcile(trio.current_time())
                wake = min(self._starting.values(), default=math.inf)
                with trio.move_on_at(wake):
                    await self._poke.wait()
                self._poke = trio.Event()

    async def _follow(self, events: trio.MemoryReceiveChannel[tuple[str, Obj]]) -> None:
        async for _ in events:
            self._poke.set()

    # -- one pass ---------------------------------------------------------------------------

    def reconcile(self, now: float) -> None:
        """Bring pods, workload status and EndpointSlices in line with the store."""
        live = {(p["metadata"]["namespace"], p["metadata"]["name"])
                for p in self.store.objects(self._rt("", "pods"))}
        for gone in set(self._starting) - live:
            del self._starting[gone]
        for key in WORKLOAD_KINDS:
            for workload in self.store.objects(self._rt(*key)):
                if not workload["metadata"].get("deletionTimestamp"):
                    self._reconcile_workload(key[1], workload, now)
        self._reconcile_slices()

    def _owned_pods(self, owner_uid: str, namespace: str) -> list[Obj]:
        return [p for p in self.store.objects(self._rt("", "pods"))
                if p["metadata"].get("namespace") == namespace
                and any(r.get("uid") == owner_uid and r.get("controller")
                        for r in p["metadata"].get("ownerReferences") or [])]

    def _reconcile_workload(self, plural: str, workload: Obj, now: float) -> None:
        meta = workload["metadata"]
        ns = meta["namespace"]
        desired = replicas_of(workload)
        template = (workload.get("spec") or {}).get("template") or {}
        if plural == "deployments":
            owner = self._replica_set(workload, template, desired)
            pod_labels = {**((template.get("metadata") or {}).get("labels") or {}),
                          "pod-template-hash": owner["metadata"]["labels"][
                              "pod-template-hash"]}
        else:
            owner = workload
            pod_labels = dict((template.get("metadata") or {}).get("labels") or {})
        pods = self._owned_pods(owner["metadata"]["uid"], ns)
        if plural == "statefulsets":
            wanted = {f"{meta['name']}-{i}" for i in range(desired)}
            excess = [p for p in pods if p["metadata"]["name"] not in wanted]
            missing = sorted(wanted - {p["metadata"]["name"] for p in pods})
        else:
            excess = pods[desired:]
            missing = [""] * max(0, desired - len(pods))
        for pod in excess:
            self._starting.pop((ns, pod["metadata"]["name"]), None)
            self._delete(self._rt("", "pods"), ns, pod["metadata"]["name"])
        delay = _float(meta.get("annotations", {}).get(START_DELAY), self.start_delay)
        for name in missing:
            created = self._create_pod(owner, template, pod_labels, name)
            self._starting[(ns, created["metadata"]["name"])] = now + delay
        crash = (meta.get("annotations") or {}).get(CRASH)
        pods = self._owned_pods(owner["metadata"]["uid"], ns)
        for pod in pods:
            key = (ns, pod["metadata"]["name"])
            if key in self._starting and self._starting[key] <= now:
                del self._starting[key]
                self._start_pod(pod, crash)
        ready = sum(1 for p in pods if _ready(p))
        status = {"observedGeneration": meta.get("generation", 1), "replicas": len(pods),
                  "readyReplicas": ready, "availableReplicas": ready,
                  "updatedReplicas": len(pods)}
        if plural == "deployments":
            self._write_status(self._rt("apps", "replicasets"), owner,
                               {k: v for k, v in status.items() if k != "updatedReplicas"})
        self._write_status(self._rt("apps", plural), workload, status)

    def _replica_set(self, deployment: Obj, template: Obj, desired: int) -> Obj:
        meta = deployment["metadata"]
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
        hash_ = "".join(_SUFFIX_CHARS[int(c, 16) % len(_SUFFIX_CHARS)] for c in digest[:10])
        name = f"{meta['name']}-{hash_}"
        rt = self._rt("apps", "replicasets")
        labels = {**((template.get("metadata") or {}).get("labels") or {}),
                  "pod-template-hash": hash_}
        try:
            rs = self.store.live(rt, meta["namespace"], name)
        except ApiError:
            selector = copy.deepcopy((deployment.get("spec") or {}).get("selector") or {})
            selector.setdefault("matchLabels", {})["pod-template-hash"] = hash_
            return self.store.create(rt, "v1", meta["namespace"], {
                "metadata": {"name": name, "namespace": meta["namespace"], "labels": labels,
                             "ownerReferences": [_owner_ref("Deployment", deployment)]},
                "spec": {"replicas": desired, "selector": selector,
                         "template": {**template, "metadata": {
                             **(template.get("metadata") or {}), "labels": labels}}}})
        if replicas_of(rs) != desired:
            updated = copy.deepcopy(rs)
            updated["spec"]["replicas"] = desired
            return self.store.update(rt, "v1", meta["namespace"], name, updated)
        return rs

    def _create_pod(self, owner: Obj, template: Obj, labels: dict[str, str], name: str
                    ) -> Obj:
        meta = owner["metadata"]
        spec = copy.deepcopy(template.get("spec") or {})
        spec.setdefault("nodeName", self.node)
        pod_meta: Obj = {"namespace": meta["namespace"], "labels": labels,
                         "ownerReferences": [_owner_ref(owner["kind"], owner)]}
        if name:
            pod_meta["name"] = name
        else:
            suffix = "".join(self.rng.choice(_SUFFIX_CHARS) for _ in range(5))
            pod_meta["name"] = f"{meta['name']}-{suffix}"
        return self.store.create(self._rt("", "pods"), "v1", meta["namespace"], {
            "metadata": pod_meta, "spec": spec,
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}],
                "containerStatuses": [
                    {"name": c.get("name", ""), "ready": False, "restartCount": 0,
                     "state": {"waiting": {"reason": "ContainerCreating"}}}
                    for c in spec.get("containers") or []]}}, keep_status=True)

    def _start_pod(self, pod: Obj, crash: str | None) -> None:
        containers = (pod.get("spec") or {}).get("containers") or []
        at = now_rfc3339()
        if crash is None:
            statuses = [{"name": c.get("name", ""), "ready": True, "restartCount": 0,
                         "started": True, "state": {"running": {"startedAt": at}}}
                        for c in containers]
            ready = "True"
        else:
            statuses = [{"name": c.get("name", ""), "ready": False, "restartCount": 1,
                         "started": False,
                         "state": {"waiting": {
                             "reason": "CrashLoopBackOff",
                             "message": f"back-off 10s restarting failed container="
                                        f"{c.get('name', '')} pod={pod['metadata']['name']}"}},
                         "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                                      "message": crash, "finishedAt": at}}}
                        for c in containers]
            ready = "False"
        status = {"phase": "Running", "podIP": self.pod_ip, "podIPs": [{"ip": self.pod_ip}],
                  "startTime": at,
                  "conditions": [{"type": "PodScheduled", "status": "True"},
                                 {"type": "Ready", "status": ready}],
                  "containerStatuses": statuses}
        self._write_status(self._rt("", "pods"), pod, status)

    def _reconcile_slices(self) -> None:
        pods = [p for p in self.store.objects(self._rt("", "pods"))
                if any(r.get("kind") in ("ReplicaSet", "StatefulSet")
                       for r in p["metadata"].get("ownerReferences") or [])]
        slices_rt = self._rt("discovery.k8s.io", "endpointslices")
        for service in self.store.objects(self._rt("", "services")):
            meta = service["metadata"]
            selector = (service.get("spec") or {}).get("selector")
            if not selector:
                continue
            ns = meta["namespace"]
            requirements = parse_label_selector(",".join(
                f"{k}={v}" for k, v in sorted(selector.items())))
            selected = [p for p in pods if p["metadata"]["namespace"] == ns
                        and labels_match(requirements, p)]
            name = f"{meta['name']}-sim"
            try:
                existing: Obj | None = self.store.live(slices_rt, ns, name)
            except ApiError:
                existing = None
            if not selected and existing is None:
                continue  # not a simulated workload's Service
            ports = _slice_ports(service, selected)
            endpoints = [
                {"addresses": [p["status"]["podIP"]], "nodeName": p["spec"].get("nodeName"),
                 "conditions": {"ready": _ready(p), "serving": _ready(p),
                                "terminating": False},
                 "targetRef": {"kind": "Pod", "namespace": ns,
                               "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]}}
                for p in sorted(selected, key=lambda p: p["metadata"]["name"])
                if (p.get("status") or {}).get("podIP")]
            body: Obj = {
                "metadata": {"name": name, "namespace": ns,
                             "labels": {"kubernetes.io/service-name": meta["name"],
                                        MANAGED_BY: SIMULATOR},
                             "ownerReferences": [_owner_ref("Service", service)]},
                "addressType": "IPv4", "ports": ports, "endpoints": endpoints}
            if existing is None:
                body["metadata"]["annotations"] = {WRITTEN_AT: f"{time.time():.6f}"}
                self.store.create(slices_rt, "v1", ns, body)
            elif (existing.get("endpoints") or []) != endpoints or existing.get(
                    "ports") != ports:
                updated = copy.deepcopy(existing)
                updated["endpoints"], updated["ports"] = endpoints, ports
                updated["metadata"].setdefault("annotations", {})[WRITTEN_AT] = \
                    f"{time.time():.6f}"
                self.store.update(slices_rt, "v1", ns, name, updated)

    # -- store helpers ----------------------------------------------------------------------

    def _write_status(self, rt: ResourceType, obj: Obj, status: Obj) -> None:
        meta = obj["metadata"]
        try:
            current = self.store.live(rt, meta.get("namespace"), meta["name"])
        except ApiError:
            return
        if current.get("status") == status:
            return
        self.store.update(rt, "v1", meta.get("namespace"), meta["name"],
                          {**copy.deepcopy(current), "status": status}, subresource="status")

    def _delete(self, rt: ResourceType, namespace: str, name: str) -> None:
        try:
            self.store.delete(rt, "v1", namespace, name)
        except ApiError:
            pass  # already gone


def _owner_ref(kind: str, owner: Obj) -> Obj:
    meta = owner["metadata"]
    api_version = "v1" if kind == "Service" else "apps/v1"
    return {"apiVersion": api_version, "kind": kind, "name": meta["name"], "uid": meta["uid"],
            "controller": kind != "Service", "blockOwnerDeletion": kind != "Service"}


def _ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _slice_ports(service: Obj, pods: list[Obj]) -> list[Obj]:
    """The Service's ports with each targetPort resolved: a number as is, a name against
    the first selected pod's container ports (a name no container declares is dropped,
    as the EndpointSlice controller does)."""
    declared: dict[str, int] = {}
    for pod in pods[:1]:
        for container in (pod.get("spec") or {}).get("containers") or []:
            for port in container.get("ports") or []:
                if port.get("name"):
                    declared[port["name"]] = int(port["containerPort"])
    out = []
    for port in (service.get("spec") or {}).get("ports") or []:
        target = port.get("targetPort", port.get("port"))
        number = declared.get(target) if isinstance(target, str) else target
        if number is None:
            continue
        entry: Obj = {"port": int(number), "protocol": port.get("protocol", "TCP")}
        if port.get("name"):
            entry["name"] = port["name"]
        out.append(entry)
    return out


def _float(text: Any, default: float) -> float:
    try:
        return float(text) if text is not None else default
    except (TypeError, ValueError):
        return default
