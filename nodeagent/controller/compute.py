"""The controller's config computation: cached Kubernetes objects in, one NodeConfig per
node and one RoutesConfig for the servers out. Pure (no I/O, no clock), so every rule here
is tested with plain dicts.

- A node's allow list: the Ingress backends that run on it (the server asks its agent to
  dial exactly those pod addresses and ports), plus the ClusterTunnel's
  `allowedNodePorts` on the node's own addresses (InternalIP/ExternalIP) and 127.0.0.1.
  Its `control_plane` rules (what the servers' CONNECT front may ask it to dial): the
  same node ports on the same addresses, and `allowedPodPorts` on its podCIDRs.
- The servers' `connect_nodes`: for every covered, not denied node, the names and
  addresses the CONNECT front accepts for it (InternalIP, ExternalIP, Hostname) and the
  ports, so kube-apiserver and Prometheus reach it by name or address.
- A node's interception: the `intercept` of the ClusterTunnel whose nodeSelector covers
  it (the oldest such tunnel if several do; the others get a Problem).
- The DNAT path (`dnat_paths`): the nodes a tunnel's `cloudNodeSelector` names (cloud
  nodes, where kube-apiserver or metrics-server dial <node IP>:10250 themselves) get one
  more intercept rule, `control-plane-N`, catching their host's and pods' dials to the IP
  addresses of the tunnel's other covered nodes on its `allowedNodePorts`; the servers
  list them in `control_plane_sources`, so those streams are decided like a CONNECT.
- The servers' routes: the Ingress routes; per ClusterTunnel a `NodeScope` with its
  egress rules and the nodes it covers (only those: a node's egress is its tunnel's, not
  the union of all); `protected`, the ranges refused as egress unless a rule names them:
  the kube-apiserver's addresses (the `kubernetes` Service in `default`: its ClusterIPs
  and its EndpointSlices' addresses) and the Service CIDR (the ClusterTunnels'
  `serviceCidrs`, or when none gives one, the ClusterIPs of every Service seen); and
  `node_cidrs` from each Node's spec.podCIDRs (so a stream to a pod address is relayed to
  the agent of the node that owns it — only where a ClusterTunnel's `relays` policy
  allows it: each policy is a scope of the covered nodes its fromNodeSelector matches);
  `nodes` (every Node) and `denied_nodes` (the ClusterTunnels' `deniedNodes`): the
  servers accept and keep only agents of known, not denied nodes (revocation).

`ConfigVersions` turns successive computations into versioned configs: a subscriber's
version goes up only when its content changes, so an unrelated object event sends nothing.

`ComputeMemo` (with `ingress.TranslationMemo`) keeps what earlier calls built, keyed on
exactly what each piece reads: a node's config is rebuilt only when its Node (labels,
addresses, podCIDRs), the tunnels, its Ingress targets, the replica count or its denial
changed. Still objects in, config out: the same inputs give the same result with or
without a memo (tests/controller/test_incremental.py), the memo only saves the work.
"""

from __future__ import annotations

import functools
import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from nodeagent.config import (
    AllowRule,
    ConfigError,
    ConnectNode,
    InterceptConfig,
    InterceptRuleConfig,
    NodeBandwidth,
    NodeConfig,
    NodeScope,
    PortRange,
    RoutesConfig,
)
from nodeagent.configstream.protocol import config_line
from nodeagent.controller.bandwidth import node_bandwidth
from nodeagent.controller.clustertunnel import ClusterTunnelSpec, parse_cluster_tunnel
from nodeagent.controller.ingress import SERVICE_NAME_LABEL, IngressTranslation, Problem
from nodeagent.controller.loadbalancers import LoadBalancerTranslation

Obj = dict[str, Any]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Tunnel:
    name: str
    created: str
    spec: ClusterTunnelSpec


@dataclass
class Computed:
    nodes: dict[str, NodeConfig]
    routes: RoutesConfig
    problems: list[Problem] = field(default_factory=list)


def parse_tunnels(objects: Iterable[Obj]) -> tuple[list[Tunnel], list[Problem]]:
    """Valid ClusterTunnels, oldest first (skipping those being deleted), and a Problem
    for each invalid one."""
    tunnels, problems = [], []
    for obj in objects:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name", ""))
        if meta.get("deletionTimestamp"):
            continue  # being deleted: its rules leave the nodes before the finalizer goes
        try:
            spec = parse_cluster_tunnel(obj)
        except ConfigError as exc:
            problems.append(Problem("ClusterTunnel", "", name, "InvalidSpec", str(exc)))
            continue
        tunnels.append(Tunnel(name, str(meta.get("creationTimestamp", "")), spec))
    tunnels.sort(key=lambda t: (t.created, t.name))
    return tunnels, problems


def node_addresses(node: Obj) -> list[str]:
    out = []
    for address in (node.get("status") or {}).get("addresses") or []:
        if address.get("type") in ("InternalIP", "ExternalIP") and address.get("address"):
            out.append(str(address["address"]))
    return out


def connect_addresses(node: Obj) -> list[str]:
    """The addresses the CONNECT front accepts for a node: InternalIP first (what the
    agent dials for a CONNECT by name), then ExternalIP and Hostname."""
    by_type: dict[str, list[str]] = {"InternalIP": [], "ExternalIP": [], "Hostname": []}
    for address in (node.get("status") or {}).get("addresses") or []:
        kind, value = address.get("type"), address.get("address")
        if kind in by_type and value:
            by_type[kind].append(str(value).lower())
    out: list[str] = []
    for values in by_type.values():
        out.extend(v for v in values if v not in out)
    return out


# The intercept rules the DNAT path adds on cloud nodes: `control-plane-0`, `-1`, ... (one
# per ClusterTunnel with a cloudNodeSelector, oldest first).
DNAT_RULE_PREFIX = "control-plane-"


@dataclass(frozen=True)
class DnatPaths:
    """What the DNAT path adds: per cloud node, the intercept rules its agent gets; and
    the cloud nodes the servers decide such streams for (`control_plane_sources`)."""

    rules: dict[str, tuple[InterceptRuleConfig, ...]]
    sources: tuple[str, ...]


def _ip_key(text: str) -> tuple[int, int]:
    address = ipaddress.ip_address(text)
    return address.version, int(address)


def dnat_paths(tunnels: list[Tunnel], labels: dict[str, dict[str, str]],
               addresses: dict[str, list[str]], covered: dict[str, list[str]],
               reachable: Iterable[str], denied: frozenset[str]) -> DnatPaths:
    """For each tunnel with a cloudNodeSelector: the nodes it names (not denied) catch
    dials to the IP addresses (InternalIP, ExternalIP) of the tunnel's covered nodes the
    CONNECT front reaches (`reachable`), on its allowedNodePorts. A cloud node's own
    addresses are never caught, whoever else claims them: its traffic stays direct."""
    reachable = frozenset(reachable)
    cloud_of = {t.name: sorted(n for n, node_labels in labels.items()
                               if t.spec.is_cloud_node(node_labels))
                for t in tunnels if t.spec.cloud_node_selector is not None}
    cloud = {n for names in cloud_of.values() for n in names}
    cloud_addresses = {a for n in cloud for a in addresses.get(n, ())}
    rules: dict[str, list[InterceptRuleConfig]] = {}
    for index, tunnel in enumerate(t for t in tunnels if t.name in cloud_of):
        ports = tunnel.spec.allowed_node_ports
        destinations = sorted({a for n in covered[tunnel.name]
                               if n in reachable and n not in cloud
                               for a in addresses.get(n, ()) if a not in cloud_addresses},
                              key=_ip_key)
        if not ports or not destinations:
            continue
        rule = InterceptRuleConfig(
            name=f"{DNAT_RULE_PREFIX}{index}", host_traffic=True,
            destinations=tuple(str(ipaddress.ip_network(a)) for a in destinations),
            ports=tuple(str(r.first) if r.first == r.last else f"{r.first}-{r.last}"
                        for r in ports))
        for name in cloud_of[tunnel.name]:
            if name not in denied:
                rules.setdefault(name, []).append(rule)
    sources = tuple(sorted(n for n in cloud if n not in denied))
    return DnatPaths({n: tuple(r) for n, r in rules.items()}, sources)


def _with_rules(base: InterceptConfig | None, rules: tuple[InterceptRuleConfig, ...]
                ) -> InterceptConfig:
    """`base` (the node's tunnel's intercept, or the defaults) with `rules` added,
    validated as a whole (ValidationError if, say, a rule name is taken)."""
    doc = (base or InterceptConfig()).model_dump()
    doc["rules"] = [*doc["rules"], *(r.model_dump() for r in rules)]
    return InterceptConfig.model_validate(doc)


def _ip_addresses(node: Obj) -> list[str]:
    out = []
    for text in node_addresses(node):
        try:
            out.append(str(ipaddress.ip_address(text)))
        except ValueError:
            continue
    return out


# A fan-out (a ClusterTunnel edit) rebuilds every node's config from mostly the same
# rules: validating each AllowRule again (its host parsed as an address) was a third of
# the rebuild. Frozen models, so one object serves every config that holds the rule.
# Bounded (a rule is ~0.7 KB): at 65,536 entries, the rules of five successive
# allowedNodePorts edits at 5,000 nodes stayed cached, +50 MiB of RSS for nothing.
@functools.lru_cache(maxsize=1 << 14)
def _allow_exact(host: str, port: int, protocol: str = "tcp") -> AllowRule:
    return AllowRule(host=host, ports=(PortRange(first=port, last=port),),
                     protocol=protocol)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1 << 13)
def _allow_ports(host: str, ports: tuple[PortRange, ...]) -> AllowRule:
    return AllowRule(host=host, ports=ports)


def _host_network(text: Any) -> Network | None:
    return _parse_host_network(str(text))


# Every Service's ClusterIP is parsed at every recompute (when no ClusterTunnel declares
# the Service CIDR): 20,000 parses were half of a recompute at 10,000 Services.
@functools.lru_cache(maxsize=1 << 17)
def _parse_host_network(text: str) -> Network | None:
    try:
        return ipaddress.ip_network(text)  # one address: /32 or /128
    except ValueError:
        return None


def protected_ranges(tunnels: list[Tunnel], services: Iterable[Obj],
                     endpoint_slices: Iterable[Obj]) -> tuple[Network, ...]:
    """The kube-apiserver's addresses and the Service CIDR: never egress unless a
    ClusterTunnel's rule names them (the servers add loopback and link-local)."""
    out: set[Network] = set()
    declared = {c for t in tunnels for c in t.spec.service_cidrs}
    out.update(declared)
    for svc in services:
        meta = svc.get("metadata") or {}
        spec = svc.get("spec") or {}
        apiserver = meta.get("namespace") == "default" and meta.get("name") == "kubernetes"
        if not (apiserver or not declared):
            continue
        for ip in [*(spec.get("clusterIPs") or []), spec.get("clusterIP")]:
            if ip and ip != "None" and (net := _host_network(ip)) is not None:
                out.add(net)
    for es in endpoint_slices:
        meta = es.get("metadata") or {}
        if meta.get("namespace") != "default" or (
                (meta.get("labels") or {}).get(SERVICE_NAME_LABEL) != "kubernetes"):
            continue
        for endpoint in es.get("endpoints") or []:
            for ip in endpoint.get("addresses") or []:
                if (net := _host_network(ip)) is not None:
                    out.add(net)
    return tuple(sorted(out, key=lambda n: (n.version, n.network_address, n.prefixlen)))


# The servers' Services (nodeagent.controller.bootstrap.SERVER_SERVICE and
# TUNNEL_SERVICE; not imported: bootstrap does I/O and compute must not).
SERVER_SERVICE_NAME = "nodeagent-server"
TUNNEL_SERVICE_NAME = "nodeagent-tunnel"


def server_replicas(endpoint_slices: Iterable[Obj], namespace: str | None) -> int | None:
    """How many server replicas agents must hold a tunnel to: the not terminating
    endpoints of the tunnel Service in `namespace` (distinct addresses), ready or not —
    a new replica becomes ready only once the agents reached it, so counting ready ones
    would wait for ever. Without a tunnel Service (an older install, the tunnel port on
    the server Service), the ready, not terminating endpoints of the server Service.
    None when there is none (or no namespace): agents hold one tunnel. A terminating
    replica is draining, so it no longer counts."""
    if namespace is None:
        return None
    tunnel: set[str] = set()
    server: set[str] = set()
    for es in endpoint_slices:
        meta = es.get("metadata") or {}
        service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if meta.get("namespace") != namespace or service not in (TUNNEL_SERVICE_NAME,
                                                                 SERVER_SERVICE_NAME):
            continue
        for endpoint in es.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("terminating") is True:
                continue
            if service == TUNNEL_SERVICE_NAME:
                tunnel.update(str(a) for a in endpoint.get("addresses") or [])
            elif conditions.get("ready") is not False:
                server.update(str(a) for a in endpoint.get("addresses") or [])
    return min(len(tunnel or server), 64) or None


@dataclass(frozen=True)
class NodePart:
    """What one Node contributes: its config (before the DNAT path's rules) and its share
    of the servers' routes. A function of the Node object, the tunnels, the Ingress
    targets on it, the replica count and whether it is denied (`NodeKey`)."""

    labels: dict[str, str]
    ip_addresses: tuple[str, ...]
    tunnel: str | None  # the ClusterTunnel that covers it (the oldest of several)
    config: NodeConfig
    cidrs: tuple[Network, ...]
    connect: ConnectNode | None
    problems: tuple[Problem, ...]


# An allowed target: (host, port) for TCP, (host, port, protocol) for LoadBalancer ports.
Target = tuple[str, int] | tuple[str, int, str]
# (what node_part reads of the Node, tunnels, its targets, server replicas, denied)
NodeKey = tuple[Any, list[Tunnel], frozenset[Target], int | None, bool]


def node_view(node: Obj) -> tuple[Any, ...]:
    """What `node_part` reads of a Node: labels, podCIDRs and addresses; not the status
    conditions and heartbeats a kubelet rewrites every few seconds (a Node object that
    changed only there keeps its part)."""
    return ((node.get("metadata") or {}).get("labels"),
            (node.get("spec") or {}).get("podCIDRs"),
            (node.get("status") or {}).get("addresses"))


@dataclass(frozen=True)
class NodeFacts:
    """What a Node's part reads of the Node alone, whatever the tunnels and targets:
    parsed once per `node_view`, so a ClusterTunnel edit, which rebuilds every node's
    part, does not parse 5,000 nodes' addresses and podCIDRs again (a third of that
    rebuild)."""

    labels: dict[str, str]
    addresses: tuple[str, ...]  # node_addresses
    ip_addresses: tuple[str, ...]  # the same, parsed and normalised (valid ones only)
    connect: tuple[str, ...]  # connect_addresses
    cidrs: tuple[Network, ...]
    problems: tuple[Problem, ...]  # its invalid podCIDRs


def node_facts(name: str, node: Obj) -> NodeFacts:
    problems: list[Problem] = []
    cidrs = []
    for text in (node.get("spec") or {}).get("podCIDRs") or []:
        try:
            cidrs.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            problems.append(Problem("Node", "", name, "InvalidPodCIDR",
                                    f"spec.podCIDRs: {text!r} is not a CIDR"))
    return NodeFacts(labels=(node.get("metadata") or {}).get("labels") or {},
                     addresses=tuple(node_addresses(node)),
                     ip_addresses=tuple(_ip_addresses(node)),
                     connect=tuple(connect_addresses(node)), cidrs=tuple(cidrs),
                     problems=tuple(problems))


def node_part(name: str, node: Obj, tunnels: list[Tunnel],
              targets: frozenset[Target], replicas: int | None,
              denied: bool, facts: NodeFacts | None = None) -> NodePart:
    """`facts`: `node_facts(name, node)`, if known already."""
    facts = facts or node_facts(name, node)
    labels = facts.labels
    problems: list[Problem] = []
    covering = [t for t in tunnels if t.spec.covers(labels)]
    allow: list[AllowRule] = [_allow_exact(*target) for target in sorted(targets)]
    intercept: InterceptConfig | None = None
    control_plane: list[AllowRule] = []
    connect: ConnectNode | None = None
    if covering:
        tunnel = covering[0]
        for extra in covering[1:]:
            problems.append(Problem(
                "ClusterTunnel", "", extra.name, "Overlapping",
                f"node {name} is also covered by the older ClusterTunnel {tunnel.name}; "
                "its settings are used there"))
        if tunnel.spec.allowed_node_ports:
            for host in ["127.0.0.1", *facts.addresses]:
                rule = _allow_ports(host, tunnel.spec.allowed_node_ports)
                allow.append(rule)
                control_plane.append(rule)
        intercept = tunnel.spec.intercept
    problems.extend(facts.problems)
    if covering and not denied:
        spec = covering[0].spec
        if spec.allowed_pod_ports:
            control_plane.extend(AllowRule(cidr=c, ports=spec.allowed_pod_ports)
                                 for c in facts.cidrs)
        if spec.allowed_node_ports or spec.allowed_pod_ports:
            connect = ConnectNode(addresses=facts.connect,
                                  ports=spec.allowed_node_ports,
                                  pod_ports=spec.allowed_pod_ports)
    # A denied node's agent is disconnected by the servers; its config allows nothing.
    config = (NodeConfig() if denied else
              NodeConfig(allow=tuple(allow), intercept=intercept,
                         control_plane=tuple(control_plane), server_replicas=replicas))
    return NodePart(labels=labels, ip_addresses=facts.ip_addresses,
                    tunnel=covering[0].name if covering else None, config=config,
                    cidrs=facts.cidrs, connect=connect, problems=tuple(problems))


class ComputeMemo:
    """Each Node's part from earlier calls of `compute`, reused while its `NodeKey` is
    the same (same or equal objects): a change that concerns one node rebuilds one
    NodeConfig, and an unchanged node keeps the very same NodeConfig object, which
    `ConfigVersions.update` recognises without serialising it. The memo never changes an
    outcome, only its cost. `built` counts node parts built (not reused), `parsed` the
    `NodeFacts` parsed, `walked` the walks of every Service for `protected_ranges`."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[NodeKey, NodePart]] = {}
        self._facts: dict[str, tuple[Any, NodeFacts]] = {}  # name → (node_view, facts)
        self.parsed = 0
        self.walked = 0
        self._tunnels: list[Tunnel] = []
        self.built = 0
        # protected_ranges and server_replicas read every Service and EndpointSlice:
        # reused while those are the very same objects (and the tunnels' serviceCidrs
        # the same)
        self._cluster: tuple[Any, ...] = (None, (), None, None, (), None)

    def cluster_wide(self, tunnels: list[Tunnel], services: list[Obj],
                     endpoint_slices: list[Obj], namespace: str | None
                     ) -> tuple[tuple[Network, ...], int | None]:
        # Of the tunnels, only their serviceCidrs count: an allowedNodePorts edit (a
        # fan-out) does not walk 10,000 Services again.
        declared = frozenset(c for t in tunnels for c in t.spec.service_cidrs)
        last_declared, last_services, last_slices, last_ns, protected, replicas = \
            self._cluster
        if not (declared == last_declared and namespace == last_ns
                and same_objects(services, last_services)
                and same_objects(endpoint_slices, last_slices)):
            protected = protected_ranges(tunnels, services, endpoint_slices)
            self.walked += 1
            replicas = server_replicas(endpoint_slices, namespace)
            self._cluster = (declared, services, endpoint_slices, namespace, protected,
                             replicas)
        return protected, replicas

    def tunnels(self, tunnels: list[Tunnel]) -> list[Tunnel]:
        """`tunnels`, or the equal list seen before (so node keys compare by identity)."""
        if tunnels != self._tunnels:
            self._tunnels = tunnels
        return self._tunnels

    def part(self, name: str, node: Obj, key: NodeKey) -> NodePart:
        known = self._parts.get(name)
        if known is not None and known[0] == key:
            return known[1]
        self.built += 1
        facts = self._facts.get(name)
        if facts is None or facts[0] != key[0]:
            facts = self._facts[name] = (key[0], node_facts(name, node))
            self.parsed += 1
        part = node_part(name, node, *key[1:], facts=facts[1])
        self._parts[name] = (key, part)
        return part

    def forget_except(self, names: set[str]) -> None:
        for name in [n for n in self._parts if n not in names]:
            del self._parts[name]
        for name in [n for n in self._facts if n not in names]:
            del self._facts[name]


NO_TARGETS: frozenset[Target] = frozenset()


def same_objects(a: list[Obj], b: list[Obj]) -> bool:
    """The very same objects in the same order (a cache listed again, nothing changed)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def compute(*, nodes: Iterable[Obj], tunnels: list[Tunnel], translation: IngressTranslation,
            services: Iterable[Obj], endpoint_slices: Iterable[Obj],
            namespace: str | None = None, memo: ComputeMemo | None = None,
            server_workers: int = 1,
            load_balancers: LoadBalancerTranslation | None = None) -> Computed:
    """Every node's config and the servers' routes. With a `memo` kept from earlier
    calls, the parts of nodes whose inputs did not change are reused: the result is the
    same as without one. `server_workers`: worker processes per server pod (the servers'
    --workers). The servers' routes count pods (each server multiplies by its own workers
    when it announces); a node's `server_replicas` counts every server process it must
    hold a tunnel to: pods x workers."""
    memo = memo if memo is not None else ComputeMemo()
    tunnels = memo.tunnels(tunnels)
    services, endpoint_slices = list(services), list(endpoint_slices)
    protected, replicas = memo.cluster_wide(tunnels, services, endpoint_slices, namespace)
    tunnels_to_hold = (min(replicas * server_workers, 64)
                       if replicas is not None and server_workers > 1 else replicas)
    problems: list[Problem] = list(translation.problems)
    node_configs: dict[str, NodeConfig] = {}
    node_cidrs: dict[str, tuple[Network, ...]] = {}
    connect_nodes: dict[str, ConnectNode] = {}
    # tunnel → the nodes it covers, with their labels
    covered: dict[str, list[tuple[str, dict[str, str]]]] = {t.name: [] for t in tunnels}
    denied = frozenset(n for t in tunnels for n in t.spec.denied_nodes)
    all_labels: dict[str, dict[str, str]] = {}
    ip_addresses: dict[str, list[str]] = {}
    balancers = load_balancers or LoadBalancerTranslation()
    problems.extend(balancers.problems)
    targets: dict[str, frozenset[Target]] = translation.node_targets  # type: ignore[assignment]
    if balancers.node_targets:  # a copy only then: most clusters have no such Service
        targets = dict(targets)
        for name, extra in balancers.node_targets.items():
            targets[name] = targets.get(name, NO_TARGETS) | extra
    bandwidth: dict[str, NodeBandwidth] = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        name = str(meta.get("name", ""))
        if not name:
            continue
        if annotations := meta.get("annotations"):  # bandwidth shaping (limits.md)
            try:
                if (limit := node_bandwidth(annotations)) is not None:
                    bandwidth[name] = limit
            except ValueError as exc:
                problems.append(Problem("Node", "", name, "InvalidBandwidth", str(exc)))
        part = memo.part(name, node, (node_view(node), tunnels,
                                      targets.get(name, NO_TARGETS), tunnels_to_hold,
                                      name in denied))
        all_labels[name] = part.labels
        ip_addresses[name] = list(part.ip_addresses)
        if part.tunnel is not None:
            covered[part.tunnel].append((name, part.labels))
        problems.extend(part.problems)
        if part.cidrs:
            node_cidrs[name] = part.cidrs
        if part.connect is not None:
            connect_nodes[name] = part.connect
        node_configs[name] = part.config
    memo.forget_except(set(node_configs))
    dnat = dnat_paths(tunnels, all_labels, ip_addresses,
                      {t: [n for n, _ in c] for t, c in covered.items()}, connect_nodes,
                      denied)
    for name, rules in dnat.rules.items():
        config = node_configs[name]
        try:
            intercept = _with_rules(config.intercept, rules)
        except ValidationError as exc:
            owner = next(t.name for t in tunnels if t.spec.is_cloud_node(all_labels[name]))
            problems.append(Problem(
                "ClusterTunnel", "", owner, "InvalidCloudNodeRule",
                f"node {name}: the control-plane intercept rules cannot join its intercept "
                f"rules: {_first_error(exc)}"))
            continue
        node_configs[name] = config.model_copy(update={"intercept": intercept})
    scopes: list[NodeScope] = []
    for t in tunnels:
        names = sorted(n for n, _ in covered[t.name])
        if names and t.spec.egress:
            scopes.append(NodeScope(name=t.name, nodes=tuple(names), egress=t.spec.egress))
        for i, policy in enumerate(t.spec.relays):
            sources = sorted(n for n, labels in covered[t.name] if policy.covers(labels))
            if sources:
                scopes.append(NodeScope(name=f"{t.name}/relays[{i}]", nodes=tuple(sources),
                                        relays=policy.to))
    routes = RoutesConfig(ingress=translation.routes, scopes=tuple(scopes),
                          load_balancers=balancers.services,
                          node_cidrs=node_cidrs,
                          protected=protected,
                          nodes=tuple(sorted(node_configs)), denied_nodes=tuple(sorted(denied)),
                          connect_nodes=connect_nodes, control_plane_sources=dnat.sources,
                          replicas=replicas, bandwidth=bandwidth)
    return Computed(nodes=node_configs, routes=routes, problems=problems)


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    return str(errors[0]["msg"]) if errors else str(exc)


def canonical(config: NodeConfig | RoutesConfig) -> str:
    """The content of a config without its version, as a stable string."""
    doc = config.model_dump(mode="json", exclude={"version"})
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


class ConfigVersions:
    """Per subscriber key ("node/NAME", "servers"): the latest config and its version,
    which rises by one each time the content changes (and only then).

    Content is compared with the models' equality (field by field; the same object, as
    `ComputeMemo` hands back for an unchanged node, compares at once), not by
    serialising: serialising 5,000 node configs and 10,000 Ingress rules at every change
    cost ~0.2 s. Only configs that differ in their `version` field are compared by
    their canonical text.

    `line(key)` is the config stream's line for the current version, encoded the first
    time a watch asks and then the very same bytes for every watch of that version (the
    servers' replicas, a reconnecting agent): at a fan-out each new version is encoded
    once, and no copy of a config carrying its version is made or kept per node; the
    line replaces that copy in memory."""

    def __init__(self) -> None:
        self._entries: dict[str, _Versioned] = {}

    def update(self, key: str, config: NodeConfig | RoutesConfig) -> bool:
        """Record `config` for `key`; True if it differs from the previous one."""
        entry = self._entries.get(key)
        if entry is not None and _same_content(entry.config, config):
            entry.config = config  # keep the newest object: next time, `is` decides
            return False
        self._entries[key] = _Versioned(entry.version + 1 if entry else 1, config)
        return True

    def get(self, key: str) -> tuple[int, Any] | None:
        """The version and the config carrying it (a copy made on demand)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        return entry.version, entry.config.model_copy(update={"version": entry.version})

    def line(self, key: str) -> tuple[int, bytes] | None:
        """The version and its config line (`protocol.config_line`), encoded once."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.line is None:
            entry.line = config_line(entry.version, entry.config)
        return entry.version, entry.line

    def keys(self) -> list[str]:
        return list(self._entries)


class _Versioned:
    """One key's current version: its config as given and, once a watch asked, its
    encoded line (`__slots__`: one of these per node)."""

    __slots__ = ("config", "line", "version")

    def __init__(self, version: int, config: NodeConfig | RoutesConfig) -> None:
        self.version = version
        self.config = config
        self.line: bytes | None = None


def _same_content(old: NodeConfig | RoutesConfig, new: NodeConfig | RoutesConfig) -> bool:
    if old is new:
        return True
    if type(old) is not type(new):
        return False
    if old.version == new.version:
        return bool(old == new)
    return canonical(old) == canonical(new)
