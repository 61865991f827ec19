"""The leader's writes on the Services of type LoadBalancer it serves: their status
(`loadbalancers.service_status`: the servers' public address with each port and its
error, the LoadBalancerPortsError condition), through a merge patch of the status
subresource that carries the resourceVersion it was computed from (a concurrent writer's
change is re-read, never overwritten). RBAC: `patch` on `services/status`, nothing more.

The public address: the oldest ClusterTunnel's `loadBalancers.addresses`, or else the
LoadBalancer address of the nodeagent-server Service (the address the Ingresses show).

A Service we no longer serve (class-less serving switched off, its type or class changed)
loses what we wrote: our condition, and the address if no other implementation put its
own there since.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from typing import Any

from nodeagent.controller.compute import Tunnel
from nodeagent.controller.loadbalancers import (
    PORTS_CONDITION,
    LoadBalancerTranslation,
    service_status,
)
from nodeagent.controller.status import public_addresses
from nodeagent.kube import SERVICES, Cache, KubeClient, KubeError
from nodeagent.kube.events import rfc3339
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.controller")
Obj = dict[str, Any]
# The condition reasons this controller writes (service_status): how a Service it served
# before is told from one another implementation serves.
OUR_REASONS = frozenset({"PortsServed", "NoPublicAddress", "PortConflict", "PortReserved",
                         "UnsupportedProtocol", "SourceRangesUnsupported"})


def configured_addresses(tunnels: Iterable[Tunnel]) -> list[dict[str, str]]:
    """The oldest tunnel's loadBalancers.addresses, as status entries (ip or hostname)."""
    for tunnel in tunnels:
        addresses = tunnel.spec.load_balancers.addresses
        if addresses:
            return [{"ip": a} if _is_ip(a) else {"hostname": a} for a in addresses]
    return []


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class LoadBalancerStatusWriter:
    """Writes each served Service's status; `outcome()` gives the latest translation and
    tunnels (None before the first recompute)."""

    def __init__(self, kube: KubeClient, services: Cache, namespace: str,
                 outcome: Callable[[], tuple[LoadBalancerTranslation, tuple[Tunnel, ...]]
                                   | None]) -> None:
        self.kube = kube
        self.services = services
        self.namespace = namespace
        self.outcome = outcome

    def addresses(self, tunnels: Iterable[Tunnel]) -> list[dict[str, str]]:
        return configured_addresses(tunnels) or public_addresses(self.services,
                                                                 self.namespace)

    async def write(self) -> bool:
        latest = self.outcome()
        if latest is None:
            return True
        translation, tunnels = latest
        addresses = self.addresses(tunnels)
        complete = True
        now = rfc3339()
        for (namespace, name), states in translation.ports.items():
            service = self.services.get(name, namespace)
            if service is None:
                continue
            status = service.get("status") or {}
            wanted = service_status(states, addresses,
                                    int((service.get("metadata") or {}).get("generation")
                                        or 0),
                                    list(status.get("conditions") or []), now)
            complete &= await self._patch(service, status, wanted)
        served = set(translation.ports)
        for service in self.services.list():
            meta = service.get("metadata") or {}
            if (meta.get("namespace"), meta.get("name")) in served:
                continue
            status = service.get("status") or {}
            conditions = list(status.get("conditions") or [])
            ours = [c for c in conditions if c.get("type") == PORTS_CONDITION
                    and c.get("reason") in OUR_REASONS]
            if not ours:
                continue
            ingress = (status.get("loadBalancer") or {}).get("ingress") or []
            mine = all(isinstance(e, dict) and (e.get("ipMode") == "Proxy" or "ip" not in e)
                       for e in ingress)
            wanted = {"loadBalancer": {} if mine else status.get("loadBalancer") or {},
                      "conditions": [c for c in conditions if c not in ours]}
            complete &= await self._patch(service, status, wanted)
        return complete

    async def _patch(self, service: Obj, status: Obj, wanted: Obj) -> bool:
        meta = service.get("metadata") or {}
        current = {"loadBalancer": status.get("loadBalancer") or {},
                   "conditions": list(status.get("conditions") or [])}
        if current == wanted:
            return True
        body = {"metadata": {"resourceVersion": meta.get("resourceVersion")},
                # Merge patch: a list is replaced whole, so `conditions` carries the
                # others' conditions too; `ingress: null` removes the address.
                "status": {"loadBalancer": {"ingress": wanted["loadBalancer"].get("ingress")},
                           "conditions": wanted["conditions"] or None}}
        try:
            await self.kube.patch(SERVICES, str(meta.get("name")), body,
                                  namespace=str(meta.get("namespace")), subresource="status")
        except KubeError as exc:
            log.info("Service status not written yet",
                     service=f"{meta.get('namespace')}/{meta.get('name')}", error=str(exc))
            return False
        return True
