"""nodeagent's custom resources: the ClusterTunnel model (group nodeagent.io, v1alpha1).

The CRD's OpenAPI schema is generated from these models (nodeagent/controller/crds.py), so
what the API server accepts and what the controller parses cannot drift apart. Where a
ClusterTunnel carries the same data as an agent's file (intercept rules, egress and allow
rules, port ranges) it embeds the very same models from nodeagent.config: one config model
for both modes. Field names are camelCase in Kubernetes (API conventions) and snake_case in
Python; pydantic aliases translate.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from nodeagent.config import (
    DNS_LABEL,
    DNS_NAME,
    AllowRule,
    Cidr,
    ConfigError,
    InterceptConfig,
    JwtAuth,
    PortRange,
    RateLimit,
    format_errors,
)
from nodeagent.kube.resources import custom_resource

CLUSTER_TUNNELS = custom_resource("clustertunnels", "ClusterTunnel", namespaced=False)
# Deleting a ClusterTunnel must first take its intercept rules off every node.
FINALIZER = "nodeagent.io/cleanup"
# On the CRD object: the schema revision it was generated from (see crds.ensure_crds).
CRD_VERSION_ANNOTATION = "nodeagent.io/crd-version"


class CrdModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              alias_generator=to_camel)


class RelayPolicy(CrdModel):
    """Which covered nodes' agents may reach which addresses of other nodes (pod CIDRs
    and site ranges the servers relay to the owning node's agent)."""

    from_node_selector: dict[str, str] = Field(
        default={}, description="Labels the source Node must carry (besides being covered "
        "by this tunnel); empty: every node the tunnel covers.")
    to: tuple[AllowRule, ...] = Field(
        min_length=1, description="Destinations on other nodes: each {cidr, ports, "
        "protocol}.")

    def covers(self, node_labels: dict[str, str]) -> bool:
        return all(node_labels.get(k) == v for k, v in self.from_node_selector.items())


class LoadBalancerSettings(CrdModel):
    """How the servers satisfy Services of type LoadBalancer (docs/loadbalancer.md)."""

    addresses: tuple[str, ...] = Field(
        default=(), max_length=16, description="The servers' public addresses (IPs or "
        "DNS names) written into status.loadBalancer.ingress of every Service served. "
        "Empty in every tunnel: the LoadBalancer address of the nodeagent-server Service. "
        "The oldest tunnel that sets it wins.")
    classless: bool = Field(
        default=False, description="Also serve Services of type LoadBalancer without "
        "spec.loadBalancerClass (those the cluster's default implementation would take). "
        "true in any ClusterTunnel turns it on; leave false where a cloud or MetalLB "
        "serves them. Services with loadBalancerClass nodeagent.io/tunnel are served "
        "either way.")

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for address in v:
            try:
                ipaddress.ip_address(address)
            except ValueError:
                if not DNS_NAME.fullmatch(address.lower()):
                    raise ValueError(f"{address[:64]!r} is neither an IP address nor a DNS "
                                     "name") from None
        return v


class ClusterTunnelSpec(CrdModel):
    """Tunnel-wide settings for every node the tunnel covers."""

    server_url: str | None = Field(
        default=None, description="The tunnel URL agents dial (tls://host:port or "
        "wss://host[:port]/path); informational when agents get it from their flags.")
    allowed_node_ports: tuple[PortRange, ...] = Field(
        default=(PortRange(first=10250, last=10250),), description="Ports on each node's "
        "own addresses (and 127.0.0.1) that servers may reach through the tunnel, and the "
        "control plane through the servers' CONNECT front (kube-apiserver's egress "
        "selector, Prometheus): kubelet 10250, node-exporter 9100, ...; default [10250].")
    allowed_pod_ports: tuple[PortRange, ...] = Field(
        default=(), description="Ports on pod addresses (inside the covered nodes' "
        "podCIDRs) the control plane may reach through the CONNECT front: admission "
        "webhooks, aggregated APIs on edge nodes. Empty: no pod address.")
    egress: tuple[AllowRule, ...] = Field(
        default=(), description="Destinations servers dial for the intercepted traffic of "
        "the nodes this tunnel covers: each {cidr or host, ports, protocol}. Loopback, "
        "link-local, the API server's addresses and the Service range are refused unless "
        "a rule's cidr lies inside that range (a wider rule does not unlock them).")
    service_cidrs: tuple[Cidr, ...] = Field(
        default=(), description="The cluster's Service range(s), refused as egress unless "
        "a rule names them; unset in every tunnel: the ClusterIPs of the Services seen.")
    relays: tuple[RelayPolicy, ...] = Field(
        default=(), description="Node-to-node paths: a stream a covered node's agent opens "
        "to an address another node owns is relayed only where a policy here allows it; "
        "none: no relays.")
    denied_nodes: tuple[str, ...] = Field(
        default=(), description="Nodes whose agents the servers refuse and disconnect "
        "(revocation), whichever tunnel covers them.")
    intercept: InterceptConfig | None = Field(
        default=None, description="Traffic the agents catch on their node and carry "
        "through the tunnel (same model as the agent config file).")
    node_selector: dict[str, str] = Field(
        default={}, description="Labels a Node must carry to be covered; empty: all nodes.")
    direct_backend_namespaces: tuple[str, ...] = Field(
        default=(), description="Namespaces whose Ingresses may opt in (annotation "
        "nodeagent.io/allow-direct-backends: \"true\") to backends the controller cannot "
        "tie to a Pod of their own namespace: ExternalName Services and endpoints without "
        "a nodeName (the servers dial them from their pods), and endpoints whose targetRef "
        "is not a Pod of the Service's namespace on that node with that IP. \"*\": every "
        "namespace. The cluster admin's choice: the annotation alone opens nothing. Never "
        "unlocks the protected floor.")
    cloud_node_selector: dict[str, str] | None = Field(
        default=None, description="Labels of the cloud-side nodes where control-plane "
        "components run (kube-apiserver, metrics-server, Prometheus) that dial "
        "<node IP>:<port> themselves. Their agents catch dials to the addresses of the "
        "other nodes this tunnel covers, on allowedNodePorts (an intercept rule, updated as "
        "Nodes come and go), and the servers carry them like a CONNECT. Unset: no such "
        "path; it must name at least one label.")

    ingress_jwt: JwtAuth | None = Field(
        default=None, description="JWT authentication for every Ingress that sets no auth "
        "annotation of its own (docs/auth.md: the same fields as a route's auth.jwt). An "
        "Ingress cannot opt out, only choose its own JWT or basic auth by annotations. "
        "Several ClusterTunnels setting it: the oldest one's applies.")
    ingress_rate_limit: RateLimit | None = Field(
        default=None, description="Request rate limits for every Ingress that sets none "
        "of its own (docs/limits.md: rate, burst, per_client_rate, per_client_burst). "
        "Several ClusterTunnels setting it: the oldest one's applies.")

    load_balancers: LoadBalancerSettings = Field(
        default=LoadBalancerSettings(), description="Services of type LoadBalancer: the "
        "servers listen on their ports (TCP and UDP) and balance across their ready "
        "endpoints on every node.")
    scale_to_zero: bool = Field(
        default=True, description="Whether Services may opt in to scale to zero "
        "(annotation nodeagent.io/idle-after): idle workloads are scaled to 0 and the next "
        "request wakes them. false in any ClusterTunnel switches it off for the cluster: "
        "sleeping workloads are woken and none is put to sleep.")

    @field_validator("server_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tls://", "wss://", "ws://", "tcp://")):
            raise ValueError(f"{v!r}: use tls://host:port or wss://host[:port]/path")
        return v

    @field_validator("direct_backend_namespaces")
    @classmethod
    def _namespaces(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if name != "*" and not DNS_LABEL.fullmatch(name):
                raise ValueError(f"{name[:64]!r} is not a namespace name (or \"*\")")
        return v

    @field_validator("cloud_node_selector")
    @classmethod
    def _cloud(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and not v:
            raise ValueError("an empty selector would make every node a cloud node; name "
                             "a label of the cloud-side nodes, or leave it unset")
        return v

    def covers(self, node_labels: dict[str, str]) -> bool:
        return all(node_labels.get(k) == v for k, v in self.node_selector.items())

    def is_cloud_node(self, node_labels: dict[str, str]) -> bool:
        """Whether `cloudNodeSelector` names this node (never, when unset)."""
        selector = self.cloud_node_selector
        return selector is not None and all(node_labels.get(k) == v
                                            for k, v in selector.items())


class Condition(CrdModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str = ""


class ClusterTunnelStatus(CrdModel):
    """Kept current by the leading controller."""

    observed_generation: int = 0
    nodes_covered: int = Field(default=0, description="Nodes whose config this tunnel sets.")
    nodes_connected: int = Field(default=0, description="Of those, nodes whose agent holds "
                                 "a config watch on a controller replica.")
    config_version: int = Field(default=0, description="Version of the servers' config that "
                                "includes this tunnel.")
    conditions: tuple[Condition, ...] = ()


def parse_cluster_tunnel(obj: dict[str, Any]) -> ClusterTunnelSpec:
    """Validate a ClusterTunnel's spec; ConfigError names the object and the field."""
    name = (obj.get("metadata") or {}).get("name", "?")
    spec = obj.get("spec")
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        raise ConfigError(f"ClusterTunnel {name}: spec must be an object")
    try:
        return ClusterTunnelSpec.model_validate(spec)
    except ValidationError as exc:
        raise ConfigError(format_errors(f"ClusterTunnel {name}: spec", exc)) from None
