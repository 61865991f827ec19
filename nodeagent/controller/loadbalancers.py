"""Services of type LoadBalancer → the servers' `load_balancers` and what each Service's
status should say: a pure function of cached objects (objects in, config out).

Which Services are ours: `spec.type: LoadBalancer` with `spec.loadBalancerClass:
nodeagent.io/tunnel`, or with no class at all when a ClusterTunnel sets
`loadBalancers.classless` (off by default: the cluster's default implementation, a cloud
or MetalLB, takes those). A Service being deleted is not served.

Ports: each Service port (TCP or UDP; SCTP is refused with a port error) asks the servers
for that port number. Two Services asking for the same port and protocol: the oldest
Service (creationTimestamp, then namespace/name) gets it, the other gets a port error
`PortConflict`, a `LoadBalancerPortsError` condition and an Event naming the winner; never
two claims on one socket. Ports the servers use themselves (`reserved`: those of the
servers' own Services) are refused as `PortReserved`. A Service with
`loadBalancerSourceRanges` is not served at all (`SourceRangesUnsupported`): the servers
cannot enforce them yet, and serving it open would widen what its owner asked for.

Backends: the Service's EndpointSlice endpoints for that port (matched by port name and
protocol), ready ones, or — only when none is ready — serving ones that are terminating,
believed on the same terms as an Ingress's (`endpoints.py`: the address is the node's
own, and the targetRef a Pod of the Service's namespace on that node holding it). Each
reaches its node's allow list as (address, port, protocol). Endpoints without a nodeName
are refused: the servers reach pods only through their node's agent here.

Status (`service_status`): `status.loadBalancer.ingress` lists the servers' public
addresses (`ipMode: Proxy` for IPs: traffic arrives from the servers, not at the node with
the address as destination, so kube-proxy must not short-circuit it) with each port and
its error, if any; the `LoadBalancerPortsError` condition (the core API's own type for
this) says whether some port could not be given.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from nodeagent.config import Backend, HostPort, LoadBalancerPort, LoadBalancerService
from nodeagent.controller.endpoints import endpoint_refusal, networks_of, on_node
from nodeagent.controller.ingress import SERVICE_NAME_LABEL, Problem
from nodeagent.controller.serviceannotations import health_check_of, proxy_protocol_of

LOAD_BALANCER_CLASS = "nodeagent.io/tunnel"
# Seconds a UDP flow of the Service's ports lives without a datagram (default 60; DNS: a
# few seconds frees the flow caps sooner).
UDP_IDLE_ANNOTATION = "nodeagent.io/udp-idle-timeout"
DEFAULT_UDP_IDLE = 60.0
PORTS_CONDITION = "LoadBalancerPortsError"  # core/v1's condition type for port errors
PROTOCOLS: dict[str, Literal["tcp", "udp"]] = {"TCP": "tcp", "UDP": "udp"}

Obj = dict[str, Any]


@dataclass(frozen=True)
class PortState:
    """One Service port as served (error None) or refused (error: a CamelCase reason)."""

    port: int
    protocol: str  # "TCP", "UDP", as in the Service
    error: str | None = None
    message: str = ""


@dataclass(frozen=True)
class LoadBalancerTranslation:
    services: tuple[LoadBalancerService, ...] = ()
    # node → (address, port, protocol) its agent must let the server dial
    node_targets: dict[str, frozenset[tuple[str, int, str]]] = field(default_factory=dict)
    problems: tuple[Problem, ...] = ()
    # (namespace, name) → its ports' states: every Service we serve, in order
    ports: dict[tuple[str, str], tuple[PortState, ...]] = field(default_factory=dict)

    @property
    def served(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.ports)


def _meta(obj: Obj) -> Obj:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _key(obj: Obj) -> tuple[str, str]:
    meta = _meta(obj)
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def is_ours(service: Obj, classless: bool) -> bool:
    """Whether nodeagent satisfies this Service (see the module docstring)."""
    spec = service.get("spec") or {}
    if spec.get("type") != "LoadBalancer" or _meta(service).get("deletionTimestamp"):
        return False
    cls = spec.get("loadBalancerClass")
    return cls == LOAD_BALANCER_CLASS or (cls is None and classless)


def reserved_ports(services: Iterable[Obj], namespace: str | None,
                   names: Iterable[str]) -> frozenset[tuple[str, int]]:
    """(protocol, port) the servers use themselves: the ports and numeric targetPorts of
    their own Services (`names` in `namespace`)."""
    wanted = set(names)
    out: set[tuple[str, int]] = set()
    for svc in services:
        ns, name = _key(svc)
        if namespace is None or ns != namespace or name not in wanted:
            continue
        for port in (svc.get("spec") or {}).get("ports") or []:
            protocol = str(port.get("protocol") or "TCP")
            for number in (port.get("port"), port.get("targetPort")):
                if isinstance(number, int):
                    out.add((protocol, number))
    return frozenset(out)


def translate_load_balancers(*, services: Iterable[Obj], endpoint_slices: Iterable[Obj],
                             nodes: Iterable[Obj], pods: Iterable[Obj], classless: bool,
                             reserved: frozenset[tuple[str, int]] = frozenset()
                             ) -> LoadBalancerTranslation:
    """The servers' load balancers and each served Service's port states."""
    ours = sorted((s for s in services if is_ours(s, classless)),
                  key=lambda s: (str(_meta(s).get("creationTimestamp", "")), _key(s)))
    if not ours:
        return LoadBalancerTranslation()
    slices: dict[tuple[str, str], list[Obj]] = {}
    for es in endpoint_slices:
        svc = (_meta(es).get("labels") or {}).get(SERVICE_NAME_LABEL)
        if svc:
            slices.setdefault((_key(es)[0], str(svc)), []).append(es)
    nodes_by_name = {str(_meta(n).get("name", "")): n for n in nodes}
    networks = _Networks(nodes_by_name)
    pods_by_key = {_key(p): p for p in pods}
    claimed: dict[tuple[str, int], str] = {}
    out_services: list[LoadBalancerService] = []
    targets: dict[str, set[tuple[str, int, str]]] = {}
    problems: list[Problem] = []
    states: dict[tuple[str, str], tuple[PortState, ...]] = {}
    for svc in ours:
        namespace, name = _key(svc)
        label = f"{namespace}/{name}"
        spec = svc.get("spec") or {}

        def problem(reason: str, message: str, namespace: str = namespace,
                    name: str = name) -> None:
            problems.append(Problem("Service", namespace, name, reason, message))

        port_states: list[PortState] = []
        lb_ports: list[LoadBalancerPort] = []
        idle = udp_idle_timeout(svc, problem)
        annotations = _meta(svc).get("annotations") or {}
        proxy_protocol, why = proxy_protocol_of(annotations)
        if why is not None:
            problem("InvalidProxyProtocol", why)
        health_check, why = health_check_of(annotations)
        if why is not None:
            problem("InvalidHealthCheck", why)
        if spec.get("loadBalancerSourceRanges"):
            message = ("spec.loadBalancerSourceRanges cannot be enforced by nodeagent's "
                       "servers yet; the Service is not served (remove the ranges, or "
                       "filter in front of the servers)")
            problem("SourceRangesUnsupported", message)
            states[(namespace, name)] = tuple(
                PortState(int(p.get("port") or 0), str(p.get("protocol") or "TCP"),
                          "SourceRangesUnsupported", message)
                for p in spec.get("ports") or [] if isinstance(p, dict))
            continue
        for svc_port in spec.get("ports") or []:
            if not isinstance(svc_port, dict) or not isinstance(svc_port.get("port"), int):
                continue
            number, protocol = int(svc_port["port"]), str(svc_port.get("protocol") or "TCP")
            ours_protocol = PROTOCOLS.get(protocol)
            if ours_protocol is None:
                message = f"port {number}/{protocol}: only TCP and UDP are carried"
                problem("UnsupportedProtocol", message)
                port_states.append(PortState(number, protocol, "UnsupportedProtocol",
                                             message))
                continue
            if (protocol, number) in reserved:
                message = (f"port {number}/{protocol} is used by nodeagent's servers "
                           "themselves; choose another port")
                problem("PortReserved", message)
                port_states.append(PortState(number, protocol, "PortReserved", message))
                continue
            owner = claimed.get((protocol, number))
            if owner is not None:
                message = (f"port {number}/{protocol} is already served for Service {owner} "
                           "(older); this port is not served until it is free")
                problem("PortConflict", message)
                port_states.append(PortState(number, protocol, "PortConflict", message))
                continue
            claimed[(protocol, number)] = label
            backends = _backends(namespace, name, svc_port, slices.get((namespace, name), []),
                                 networks, pods_by_key, problem)
            for backend in backends:
                assert backend.node is not None
                targets.setdefault(backend.node, set()).add(
                    (backend.target.host, backend.target.port, ours_protocol))
            tcp = ours_protocol == "tcp"
            lb_ports.append(LoadBalancerPort(
                protocol=ours_protocol, port=number, backends=backends, idle_timeout=idle,
                proxy_protocol=proxy_protocol if tcp else None,
                health_check=health_check if tcp else None))
            port_states.append(PortState(number, protocol))
        states[(namespace, name)] = tuple(port_states)
        if lb_ports:
            out_services.append(LoadBalancerService(name=label, ports=tuple(lb_ports)))
    return LoadBalancerTranslation(
        services=tuple(out_services),
        node_targets={n: frozenset(t) for n, t in sorted(targets.items())},
        problems=tuple(problems), ports=states)


def udp_idle_timeout(service: Obj, problem: Any) -> float:
    """The Service's `nodeagent.io/udp-idle-timeout` (seconds, 0 < t <= 3600); the
    default, with a Problem, when it is not a number in that range."""
    text = (_meta(service).get("annotations") or {}).get(UDP_IDLE_ANNOTATION)
    if text is None:
        return DEFAULT_UDP_IDLE
    try:
        value = float(str(text).strip().removesuffix("s"))
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:  # NaN fails too
        problem("InvalidUdpIdleTimeout", f"annotation {UDP_IDLE_ANNOTATION}: {str(text)[:64]!r} "
                f"is not a number of seconds in (0, 3600]; {DEFAULT_UDP_IDLE:g} s is used")
        return DEFAULT_UDP_IDLE
    return value


def _backends(namespace: str, name: str, svc_port: Obj, slices: list[Obj],
              networks: _Networks, pods: dict[tuple[str, str], Obj],
              problem: Any) -> tuple[Backend, ...]:
    ready: list[Backend] = []
    terminating: list[Backend] = []
    refused: dict[str, set[str]] = {}  # reason → "address on node"
    protocol = str(svc_port.get("protocol") or "TCP")
    for es in slices:
        port = _slice_port(es, svc_port, protocol)
        if port is None:
            continue
        for endpoint in es.get("endpoints") or []:
            if not isinstance(endpoint, dict):
                continue
            conditions = endpoint.get("conditions") or {}
            is_ready = conditions.get("ready") is not False  # nil means ready
            serving = conditions.get("serving", is_ready)
            if not is_ready and not (serving and conditions.get("terminating")):
                continue
            node = endpoint.get("nodeName")
            for address in endpoint.get("addresses") or []:
                address = str(address)
                if not node:
                    refused.setdefault("no_node_name", set()).add(address)
                    continue
                if not on_node(address, networks.of(str(node))):
                    refused.setdefault("off_node", set()).add(f"{address} on {node}")
                    continue
                reason = endpoint_refusal(namespace, endpoint, address, port, pods)
                if reason is not None:
                    refused.setdefault(reason, set()).add(f"{address} on {node}")
                    continue
                backend = Backend(node=str(node), target=HostPort(host=address, port=port))
                (ready if is_ready else terminating).append(backend)
    for reason, where in sorted(refused.items()):
        problem("EndpointRefused", f"port {svc_port.get('port')}/{protocol}: endpoints "
                f"not tied to a Pod of namespace {namespace} on their node are not served "
                f"({reason}, {len(where)}: {', '.join(sorted(where)[:3])})")
    chosen = ready or terminating
    return tuple(sorted(set(chosen), key=lambda b: (b.node or "", _ip_key(b.target.host),
                                                    b.target.port)))


class _Networks:
    """Each Node's networks (podCIDRs, addresses), parsed when an endpoint names it: at
    thousands of nodes most are named by no LoadBalancer Service's endpoint."""

    def __init__(self, nodes: dict[str, Obj]) -> None:
        self._nodes = nodes
        self._parsed: dict[str, list[Any]] = {}

    def of(self, name: str) -> list[Any]:
        found = self._parsed.get(name)
        if found is None:
            node = self._nodes.get(name)
            found = self._parsed[name] = networks_of(node) if node is not None else []
        return found


def _ip_key(text: str) -> tuple[int, int, str]:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return 0, 0, text
    return address.version, int(address), ""


def _slice_port(es: Obj, svc_port: Obj, protocol: str) -> int | None:
    """The target port an EndpointSlice gives for this Service port: matched by name and
    protocol (EndpointSlice ports carry the Service port's name), or the numeric
    targetPort when the slice lists no ports."""
    ports = es.get("ports")
    name = svc_port.get("name") or ""
    for port in ports or []:
        if isinstance(port, dict) and (port.get("name") or "") == name and \
                str(port.get("protocol") or "TCP") == protocol and \
                isinstance(port.get("port"), int):
            return int(port["port"])
    target = svc_port.get("targetPort")
    if isinstance(target, int) and not ports:
        return target
    return None


def service_status(states: tuple[PortState, ...], addresses: list[dict[str, str]],
                   observed_generation: int, conditions: list[Obj], now: str) -> Obj:
    """The status a served Service should show: `loadBalancer.ingress` (one entry per
    public address, each with every port and its error) and the LoadBalancerPortsError
    condition beside the Service's other conditions (its lastTransitionTime kept unless
    its status changes)."""
    ports = [{"port": s.port, "protocol": s.protocol, **({"error": s.error} if s.error
                                                          else {})} for s in states]
    ingress = []
    for address in addresses if any(s.error is None for s in states) else ():
        entry: Obj = dict(address)
        if "ip" in entry:
            entry["ipMode"] = "Proxy"
        if ports:
            entry["ports"] = ports
        ingress.append(entry)
    errors = [s for s in states if s.error]
    status = "True" if errors else "False"
    if errors:
        reason, message = errors[0].error or "", "; ".join(s.message for s in errors)
    elif not addresses:
        reason, message = "NoPublicAddress", (
            f"{len(states)} port(s) served, but no public address is known yet: set a "
            "ClusterTunnel's loadBalancers.addresses, or give the nodeagent-server Service "
            "a LoadBalancer address")
    else:
        reason, message = "PortsServed", f"{len(states)} port(s) served by nodeagent"
    prior = next((c for c in conditions if c.get("type") == PORTS_CONDITION), None)
    when = prior.get("lastTransitionTime") if prior and prior.get("status") == status \
        else now
    condition = {"type": PORTS_CONDITION, "status": status, "reason": reason,
                 "message": message[:32_000], "observedGeneration": observed_generation,
                 "lastTransitionTime": when or now}
    others = [c for c in conditions if c.get("type") != PORTS_CONDITION]
    return {"loadBalancer": {"ingress": ingress} if ingress else {},
            "conditions": [*others, condition]}
