"""Which changes to cached objects matter, and to whom: a recompute of the config, or only
one of the leader's writes. Pure functions of a cache event; the controller wires them to
its caches.

A recompute (every replica; ~0.4 s of CPU at 10k Ingresses) runs only when a part of an
object that `compute`/`translate_ingresses` reads changed. An informer already drops an
event whose resourceVersion it has seen; what is left and filtered here are writes that
touch only what the config does not read: status (much of which the leader writes itself,
so without this filter its own writes would trigger recomputes), finalizers,
managedFields, annotations nobody reads, Node heartbeats. Each projection below lists what
the computation reads of that resource, and why the rest can be ignored.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

from nodeagent.controller.bandwidth import FROM_NODE, TO_NODE
from nodeagent.controller.bootstrap import (
    CA_SECRET,
    SERVER_SERVICE,
    SERVER_TLS_SECRET,
    TUNNEL_SERVICE,
)
from nodeagent.controller.clustertunnel import CLUSTER_TUNNELS
from nodeagent.controller.endpoints import pod_view
from nodeagent.controller.ingressgate import basic_secret_name
from nodeagent.controller.loadbalancers import UDP_IDLE_ANNOTATION
from nodeagent.controller.serviceannotations import gateway_view
from nodeagent.controller.wakeroutes import pod_failure_view, settings_view
from nodeagent.kube import (
    ENDPOINTSLICES,
    INGRESSCLASSES,
    INGRESSES,
    NODES,
    PODS,
    SECRETS,
    SERVICES,
    CacheEvent,
)

Obj = dict[str, Any]


class LeaderWrite(enum.Enum):
    """The leader's writes, each redone when its inputs change (in this order)."""

    PKI = "pki"  # CA Secret and ConfigMap, the servers' certificate
    EVENTS = "events"  # Events for the Problems of the latest recompute
    INGRESS_STATUS = "ingress status"  # the servers' address on every Ingress served
    TUNNEL_STATUS = "tunnel status"  # ClusterTunnel status and finalizer
    SERVICE_STATUS = "service status"  # the servers' address on LoadBalancer Services


def _meta(obj: Obj) -> Obj:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _node(obj: Obj) -> Any:
    # Labels (ClusterTunnel nodeSelectors), addresses (allowedNodePorts are allowed on
    # them) and podCIDRs (the servers' node_cidrs). Not conditions, heartbeats, images or
    # capacity, which kubelets rewrite on their own schedule.
    # And its bandwidth annotations (bandwidth.py).
    annotations = _meta(obj).get("annotations") or {}
    return (_meta(obj).get("labels"), (obj.get("spec") or {}).get("podCIDRs"),
            (obj.get("status") or {}).get("addresses"),
            annotations.get(TO_NODE), annotations.get(FROM_NODE))


def _service(obj: Obj) -> Any:
    # Ports, type and externalName, the scale-to-zero settings (not the controller's
    # own state annotations), a LoadBalancer's UDP idle timeout and the gateway ones
    # (health checks, PROXY protocol). The status (a LoadBalancer address) feeds only the
    # leader's writes: see `leader_writes`.
    return (obj.get("spec"), settings_view(obj),
            (_meta(obj).get("annotations") or {}).get(UDP_IDLE_ANNOTATION), gateway_view(obj))


def _endpoint_slice(obj: Obj) -> Any:
    # The service-name label that ties it to a Service, its ports and endpoints (with
    # their conditions and nodeName). EndpointSlices have no status.
    return (_meta(obj).get("labels"), obj.get("ports"), obj.get("endpoints"))


def _ingress(obj: Obj) -> Any:
    # The spec and the annotations (legacy class, ssl-redirect). The status is what the
    # leader writes; the creationTimestamp (rule rank) never changes.
    return (obj.get("spec"), _meta(obj).get("annotations"))


def _ingress_class(obj: Obj) -> Any:
    # spec.controller and the is-default-class annotation.
    return (obj.get("spec"), _meta(obj).get("annotations"))


def _cluster_tunnel(obj: Obj) -> Any:
    # The spec, and the deletionTimestamp (a tunnel being deleted leaves every config).
    # Status and finalizers are the leader's own writes.
    return (obj.get("spec"), _meta(obj).get("deletionTimestamp"))


def _pod(obj: Obj) -> Any:
    # What an endpoint's targetRef is checked against (ingress.pod_view): uid, node, IPs,
    # hostNetwork and its declared ports; and whether a container fails to start (scale
    # to zero tells held requests why). Not phase, conditions or the rest of container
    # statuses, which kubelets rewrite all the time.
    return (pod_view(obj), pod_failure_view(obj))


def _secret(obj: Obj) -> Any:
    # An Ingress TLS certificate and key, or a basic-auth htpasswd. Which Secrets matter
    # at all is decided by `secret_feeds_config` (only those an Ingress names).
    return (obj.get("data"), obj.get("stringData"))


CONFIG_INPUTS: dict[str, Callable[[Obj], Any]] = {
    NODES.plural: _node,
    SERVICES.plural: _service,
    ENDPOINTSLICES.plural: _endpoint_slice,
    INGRESSES.plural: _ingress,
    INGRESSCLASSES.plural: _ingress_class,
    CLUSTER_TUNNELS.plural: _cluster_tunnel,
    SECRETS.plural: _secret,
    PODS.plural: _pod,
}


def feeds_config(plural: str, event: CacheEvent) -> bool:
    """Whether this change of a `plural` object can change the computed config. Objects
    that appear or go always can; a modification only if the projection above changed.
    Resources not in CONFIG_INPUTS (the watcher reports) never do."""
    project = CONFIG_INPUTS.get(plural)
    if project is None:
        return False
    if event.type != "MODIFIED" or event.old is None:
        return True
    return bool(project(event.old) != project(event.object))


def secret_references(ingresses: Iterable[Obj]) -> frozenset[tuple[str, str]]:
    """(namespace, name) of every Secret an Ingress names in spec.tls or its basic-auth
    annotation (ingressgate), ours or not, found or not (so a missing one appearing later
    is noticed)."""
    refs = set()
    for ingress in ingresses:
        namespace = str(_meta(ingress).get("namespace", ""))
        basic = basic_secret_name(_meta(ingress).get("annotations") or {})
        if basic is not None:
            refs.add((namespace, basic))
        for entry in (ingress.get("spec") or {}).get("tls") or []:
            if isinstance(entry, dict) and entry.get("secretName"):
                refs.add((namespace, str(entry["secretName"])))
    return frozenset(refs)


def secret_feeds_config(event: CacheEvent, referenced: frozenset[tuple[str, str]]) -> bool:
    """A Secret feeds the config only as an Ingress's TLS certificate or htpasswd:
    clusters hold many Secrets (service account tokens, Helm release records rewritten at
    every upgrade) that no Ingress names."""
    meta = _meta(event.object)
    key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
    return key in referenced and feeds_config(SECRETS.plural, event)


def status_changed(event: CacheEvent) -> bool:
    """Whether the object's status (or, for the finalizer the leader keeps, its
    finalizers) changed: someone else's write the leader may have to correct."""
    if event.type != "MODIFIED" or event.old is None:
        return True
    return bool(event.old.get("status") != event.object.get("status") or
                _meta(event.old).get("finalizers") != _meta(event.object).get("finalizers"))


def leader_writes(plural: str, event: CacheEvent, namespace: str) -> set[LeaderWrite]:
    """The leader's writes a change calls for beyond those every recompute calls for
    (a recompute's outcome redoes them all): changes to what they read that are not
    config inputs."""
    meta = _meta(event.object)
    ours = meta.get("namespace") == namespace
    if plural == "watchers":  # another replica's (or our own) report: nodesConnected
        return {LeaderWrite.TUNNEL_STATUS}
    if plural == SERVICES.plural and ours and meta.get("name") == TUNNEL_SERVICE:
        return {LeaderWrite.PKI}  # its LoadBalancer address: in the servers' certificate
    if plural == SERVICES.plural and ours and meta.get("name") == SERVER_SERVICE:
        # Its LoadBalancer address: on every Ingress and LoadBalancer Service served, and
        # in the servers' certificate.
        return {LeaderWrite.INGRESS_STATUS, LeaderWrite.SERVICE_STATUS, LeaderWrite.PKI}
    if plural == SERVICES.plural and status_changed(event):
        return {LeaderWrite.SERVICE_STATUS}  # someone else wrote it: put ours back
    if plural == SECRETS.plural and ours and meta.get("name") in (CA_SECRET,
                                                                  SERVER_TLS_SECRET):
        return {LeaderWrite.PKI}  # deleted, replaced or relabelled
    if plural == INGRESSES.plural and status_changed(event):
        return {LeaderWrite.INGRESS_STATUS}  # someone else wrote it: put ours back
    if plural == CLUSTER_TUNNELS.plural and status_changed(event):
        return {LeaderWrite.TUNNEL_STATUS}  # likewise, or our finalizer removed
    return set()
