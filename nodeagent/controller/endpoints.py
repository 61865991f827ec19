"""Which endpoints of an EndpointSlice the controller believes, and what it reads of the
Nodes and Pods to decide: pure functions of cached objects, used by the Ingress
translation (`ingress.py`) and by the inputs that decide when to translate again.

An endpoint with a `nodeName` is reached through that node's agent, so the address must
be the node's own (`networks_of`: its podCIDRs and addresses) and what the EndpointSlice
controller would have written (`endpoint_refusal`: its targetRef names a Pod of the
Service's namespace, on that node, holding that address). Whoever can write an
EndpointSlice could otherwise aim the server at another namespace's pod or the node's
own services (the class of CVE-2021-25740).
"""

from __future__ import annotations

import ipaddress
from typing import Any

Obj = dict[str, Any]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _meta(obj: Obj) -> Obj:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def pod_view(pod: Obj | None) -> tuple[Any, ...] | None:
    """What the endpoint check reads of a Pod: its uid, node, IPs, whether it shares the
    node's network and then the ports it declares; not its status conditions."""
    if pod is None:
        return None
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    host = spec.get("hostNetwork") is True
    return (_meta(pod).get("uid"), spec.get("nodeName"), host, status.get("podIP"),
            status.get("podIPs"),
            tuple(port.get("containerPort") for c in spec.get("containers") or []
                  if isinstance(c, dict) for port in c.get("ports") or []
                  if isinstance(port, dict)) if host else ())


def _ip(text: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(str(text))
    except ValueError:
        return None


def _pod_ips(view: tuple[Any, ...]) -> set[Any]:
    texts = [view[3], *(p.get("ip") for p in view[4] or [] if isinstance(p, dict))]
    return {ip for text in texts if text and (ip := _ip(text)) is not None}


def endpoint_refusal(namespace: str, endpoint: Obj, address: str, port: int,
                     pods: dict[tuple[str, str], Obj]) -> str | None:
    """Why an endpoint (with a nodeName) of a Service in `namespace` is not believed, as
    a reason code; None if its targetRef is a Pod of `namespace` (in `pods`, uid matching
    when given) on the endpoint's node that holds `address` — and, for a Pod on the
    node's own network, declares `port`: its address is the node's, so any other port
    there is the node's service, not the Pod's."""
    ref = endpoint.get("targetRef")
    if not isinstance(ref, dict):
        return "no_target_ref"
    if ref.get("kind") != "Pod" or ref.get("apiVersion", "v1") not in ("v1", ""):
        return "target_not_pod"
    if str(ref.get("namespace") or namespace) != namespace:
        return "other_namespace"
    view = pod_view(pods.get((namespace, str(ref.get("name", "")))))
    if view is None:
        return "pod_not_found"
    if ref.get("uid") and ref.get("uid") != view[0]:
        return "pod_uid_mismatch"
    if not view[1] or view[1] != endpoint.get("nodeName"):
        return "pod_on_other_node"
    ip = _ip(address)
    if ip is None or ip not in _pod_ips(view):
        return "not_pod_address"
    if view[2] and port not in view[5]:
        return "host_port_undeclared"
    return None



def networks_of(node: Obj) -> list[Network]:
    """A Node's spec.podCIDRs and its status addresses (IPs, as /32 or /128)."""
    nets: list[Network] = []
    texts = [*((node.get("spec") or {}).get("podCIDRs") or []),
             *(a.get("address") for a in (node.get("status") or {}).get("addresses") or []
               if isinstance(a, dict))]
    for text in texts:
        try:
            nets.append(ipaddress.ip_network(str(text), strict=False))
        except ValueError:
            continue  # a Hostname address, or a bad podCIDR (compute reports those)
    return nets


def on_node(address: str, networks: list[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip.version == net.version and ip in net for net in networks)


def node_view(node: Obj | None) -> tuple[Any, ...] | None:
    """What the translation reads of a Node: its podCIDRs and addresses, not the status
    conditions a kubelet rewrites every few seconds."""
    if node is None:
        return None
    return ((node.get("spec") or {}).get("podCIDRs"),
            (node.get("status") or {}).get("addresses"))
