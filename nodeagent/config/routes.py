"""What a server does and needs: `RoutesConfig` (TCP mappings, HTTP and Ingress routes,
egress, node CIDRs — what the controller computes for the servers) and `ServerConfig`
(a server's file or flags: its tunnel listener, TLS, the agent credentials it accepts).

Egress is deny by default with a floor: `check_egress` refuses an address in a protected
range (`ALWAYS_PROTECTED`: loopback, link-local, "this host"; plus the config's
`protected`: the kube-apiserver's addresses and the Service CIDR) unless one of the node's
egress rules names it by a CIDR that lies inside every protected range holding the
address (the exact CIDR containment rule): `169.254.169.254/32` or `169.254.0.0/16`
unlock the metadata address, `0.0.0.0/0` or `10.0.0.0/8` never do. The floor and the
owner of an address (`node_for_address`, which decides relays) both judge every address a
target stands for (`addresses.addresses_meant`: the IPv4 address inside `::ffff:a.b.c.d`,
NAT64, 6to4, Teredo), so `64:ff9b::a9fe:a9fe` is the metadata address too."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from nodeagent.config.addresses import IPAddress, addresses_meant
from nodeagent.config.base import (
    DEFAULT_SERVER_SOCKET,
    DNS_NAME,
    MIN_TOKEN_LENGTH,
    Cidr,
    ConfigPath,
    ControllerUrl,
    HostPort,
    InlineToken,
    Keepalive,
    ListenAddress,
    Model,
    _check_tunnel_url,
    _read_secret,
    raise_problems,
)
from nodeagent.config.connect import ConnectFrontConfig, ConnectNode
from nodeagent.config.gateway import NodeBandwidth, RateLimit, RouteAuth
from nodeagent.config.health import HealthCheck
from nodeagent.config.node import (
    AllowRule,
)
from tunnel.limits import DEFAULT_HANDSHAKE_BURST, DEFAULT_HANDSHAKE_RATE


class ServerTls(Model):
    cert_file: ConfigPath  # the tunnel's certificate (PEM, chain included)
    key_file: ConfigPath  # its private key (PEM)
    client_ca_file: ConfigPath | None = None  # set: agents may (or must) present certificates
    # Refuse agents without a certificate of client_ca_file (false: a token will do).
    require_client_cert: bool = False

    @model_validator(mode="after")
    def _mtls(self) -> ServerTls:
        if self.require_client_cert and self.client_ca_file is None:
            raise ValueError("require_client_cert needs client_ca_file")
        return self


class TokenEntry(Model):
    """A token an agent may present. node "*" accepts any node name (a shared token:
    convenient for a lab, weaker: any holder can claim any node)."""

    node: str  # the node this token may register, or "*" for any
    # The token itself, written here; or token_file.
    token: InlineToken | None = Field(default=None, min_length=MIN_TOKEN_LENGTH)
    # A file holding the token, re-read when it changes: tunnels opened with the old
    # token are then closed (token_revoked).
    token_file: ConfigPath | None = None

    @field_validator("node")
    @classmethod
    def _node(cls, v: str) -> str:
        if v != "*" and not DNS_NAME.fullmatch(v):
            raise ValueError(f"{v!r} is not a valid node name (lower-case DNS name)")
        return v

    @model_validator(mode="after")
    def _one_of(self) -> TokenEntry:
        if (self.token is None) == (self.token_file is None):
            raise ValueError("give exactly one of token or token_file")
        return self

    def read(self) -> str:
        if self.token is not None:
            return self.token
        assert self.token_file is not None
        return _read_secret(self.token_file)


class Backend(Model):
    node: str | None = None  # None: the server dials it directly
    target: HostPort


class TcpMapping(Model):
    """A public TCP port on the server that leads to a target through a node."""

    name: str | None = None  # for logs, metrics and debug views (default: the port)
    listen: ListenAddress  # host:port, or :port for every address
    node: str  # whose agent dials the target
    target: HostPort  # host:port as that agent dials it (its allow list must permit it)
    # Send the backend a PROXY header (v1 text or v2 binary) naming the client and the
    # address it connected to, before any of its bytes (docs/proxy-protocol.md).
    proxy_protocol: Literal["v1", "v2"] | None = None
    # Checked by the node's agent beside the target (docs/health-checks.md).
    health_check: HealthCheck | None = None


class UdpMapping(Model):
    """A public UDP port on the server that leads to a target through a node: each client
    address (host and port) becomes a flow, replies go back to it (docs/udp.md)."""

    name: str | None = None  # for logs, metrics and debug views (default: the port)
    listen: ListenAddress  # host:port, or :port for every address
    node: str  # whose agent sends the datagrams to the target
    target: HostPort  # an IP address and port, allowed by a udp/ rule of that agent
    # A flow with no datagram either way for this long ends (DNS: a few seconds).
    idle_timeout: float = Field(default=60.0, gt=0, le=3600)
    # Flows at once through this mapping's node (all its UDP mappings on this server):
    # beyond, a new client's datagrams are dropped (flow_limit).
    max_flows: int = Field(default=10_000, ge=1, le=1_000_000)
    # Flows at once from one client IP, whatever its ports (client_flow_limit). Behind a
    # NAT or a load balancer that hides client addresses, raise it.
    max_flows_per_client: int = Field(default=64, ge=1, le=1_000_000)
    # Anti-amplification (as QUIC's, RFC 9000 8.1): until a client has sent a second
    # datagram on its flow, replies toward it stop at this many times the bytes it sent.
    amplification_factor: float = Field(default=3.0, ge=1, le=100)


# Stream metadata the server sets on a stream to a backend of a Service that scales to
# zero (a route or port with `wake`): its node's allow list may reach the agent a moment
# after the servers' routes, so the agent waits briefly for its config before refusing
# (agent/agent.py); it still dials only what its own config allows.
WAKE_KEY = "wake"


class WakeRoute(Model):
    """Scale to zero for the Service behind an Ingress rule or a LoadBalancer port
    (controller mode; the Service opts in by annotation). With no backends, a request
    (or TCP connection) is held: the server asks the controller to wake `service` and
    forwards when its endpoints arrive in a new config, or answers 504 after `timeout`;
    over `max_pending` held requests, 503 with Retry-After. `failure`: the controller
    sees the workload failing to start; held and new requests get 502 with this reason
    instead of waiting."""

    service: str  # "namespace/name"
    timeout: float = Field(default=120.0, gt=0, le=3600)
    max_pending: int = Field(default=1000, ge=0, le=1_000_000)
    failure: str = ""
    # Browsers (GET/HEAD accepting text/html) get a small "starting" page that reloads
    # itself (503 with Refresh) instead of a held request; the wake is asked all the same.
    starting_page: bool = False


class LoadBalancerPort(Model):
    """One port of a LoadBalancer Service (controller mode; or a file's, as a TCP/UDP
    mapping balanced across nodes): the servers listen on `port` for `protocol` at
    `load_balancer_host`, and each connection (TCP) or client flow (UDP) goes to one of
    `backends` (round robin over those whose node's agent holds a tunnel here). No
    backends: the port stays open and refuses (TCP reset; UDP dropped, `no_backends`),
    unless `wake` says the Service sleeps."""

    protocol: Literal["tcp", "udp"] = "tcp"
    port: int = Field(ge=1, le=65535)
    backends: tuple[Backend, ...] = ()
    # UDP: a flow with no datagram either way for this long ends.
    idle_timeout: float = Field(default=60.0, gt=0, le=3600)
    # TCP: a PROXY header to each backend (the Service's nodeagent.io/proxy-protocol).
    proxy_protocol: Literal["v1", "v2"] | None = None
    # TCP: each backend checked by its node's agent; unhealthy ones skipped while another
    # is left (the Service's nodeagent.io/health-check; docs/health-checks.md).
    health_check: HealthCheck | None = None
    # Scale to zero (the Service's nodeagent.io/idle-after): with no backends, TCP
    # connections are held while the Service wakes; UDP datagrams are dropped, the wake
    # asked all the same (docs/scale-to-zero.md).
    wake: WakeRoute | None = None

    @field_validator("backends")
    @classmethod
    def _through_nodes(cls, v: tuple[Backend, ...]) -> tuple[Backend, ...]:
        if any(b.node is None for b in v):
            raise ValueError("every backend of a load balancer port names its node")
        return v


class LoadBalancerService(Model):
    """A Service of type LoadBalancer the servers satisfy (docs/loadbalancer.md)."""

    name: str  # "namespace/name", for logs, metrics and `nodeagent debug loadbalancers`
    ports: tuple[LoadBalancerPort, ...] = ()


class HttpRoute(Model):
    host: str | None = None  # exact or "*.example.com"; None: any host
    path: str = "/"
    path_type: Literal["Prefix", "Exact", "ImplementationSpecific"] = "Prefix"
    node: str | None = None
    target: HostPort
    # What the target speaks: h1 (HTTP/1.1) or h2c (HTTP/2 without TLS, prior knowledge;
    # gRPC servers): h2c backends get one shared HTTP/2 connection, each request balanced.
    backend_protocol: Literal["h1", "h2c"] = "h1"
    # Checked by the node's agent beside the target (docs/health-checks.md).
    health_check: HealthCheck | None = None
    auth: RouteAuth | None = None  # who may use it (docs/auth.md); None: anyone
    rate_limit: RateLimit | None = None  # requests per second (docs/limits.md)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        if v is None:
            return None
        name = v.lower()
        if not DNS_NAME.fullmatch(name.removeprefix("*.")):
            raise ValueError(f"{v!r} is not a host name (wildcards: *.example.com)")
        return name

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"path {v!r} must start with /")
        return v


class HttpListener(Model):
    name: str | None = None  # for logs, metrics and debug views
    listen: ListenAddress  # host:port, or :port for every address
    # Chosen by Host (exact before *.wildcard), then the longest matching path; none: 404.
    routes: tuple[HttpRoute, ...] = ()


class IngressRule(Model):
    """One Ingress path (controller mode): requests for `host` + `path` are balanced across
    `backends`. No backends: 503."""

    name: str  # "namespace/ingress", for logs, metrics and Events
    host: str | None = None  # exact or "*.example.com"; None: any host
    path: str = "/"
    path_type: Literal["Prefix", "Exact", "ImplementationSpecific"] = "Prefix"
    backends: tuple[Backend, ...] = ()
    # Tie-break between Ingresses claiming the same host+path: the smallest rank wins (the
    # controller uses creationTimestamp, so the oldest Ingress wins).
    rank: str = ""
    tls_redirect: bool = False  # answer plain HTTP with 308 to https://
    # What the backends speak (the Service port's appProtocol: kubernetes.io/h2c or grpc
    # → h2c).
    backend_protocol: Literal["h1", "h2c"] = "h1"
    wake: WakeRoute | None = None  # its Service sleeps when idle (scale to zero)
    # Each backend checked by its node's agent (the Service's nodeagent.io/health-check).
    health_check: HealthCheck | None = None
    auth: RouteAuth | None = None  # from the Ingress's auth annotations (docs/auth.md)
    rate_limit: RateLimit | None = None  # from its rate annotations (docs/limits.md)


class IngressTls(Model):
    """A certificate the HTTPS listener serves by SNI for `hosts`."""

    name: str  # "namespace/secret"
    hosts: tuple[str, ...] = ()
    cert_pem: str
    key_pem: str


class IngressRoutes(Model):
    """What the server's Ingress listeners (`ingress_http`, `ingress_https`) serve."""

    rules: tuple[IngressRule, ...] = ()
    default_backend: IngressRule | None = None
    tls: tuple[IngressTls, ...] = ()


# Never egress unless a rule names them (see check_egress): loopback, link-local (cloud
# metadata at 169.254.169.254), and 0.0.0.0/8 and :: which a connect() treats as this host.
ALWAYS_PROTECTED: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = tuple(
    ipaddress.ip_network(c) for c in ("127.0.0.0/8", "169.254.0.0/16", "0.0.0.0/8",
                                      "::1/128", "::/128", "fe80::/10"))


class NodeScope(Model):
    """Egress and relays for the streams of some nodes' agents (controller mode: one per
    ClusterTunnel for the nodes it covers, one per relay policy). Node "*": every node."""

    name: str = ""  # the ClusterTunnel, for logs
    nodes: tuple[str, ...] = ()
    egress: tuple[AllowRule, ...] = ()
    # Addresses of other nodes (their node_cidrs) these nodes' streams may be relayed to;
    # no scope naming a destination: no relay.
    relays: tuple[AllowRule, ...] = ()


class RoutesConfig(Model):
    """What a server does: the part the controller computes per server."""

    # The config's version: 0 in a file; the controller numbers its changes (shown by
    # `nodeagent debug status` and nodeagent_config_version).
    version: int = Field(default=0, ge=0)
    # Public TCP ports, each carried to a target through a node's agent.
    tcp: tuple[TcpMapping, ...] = ()
    # Public UDP ports: each client address is a flow to a target through a node
    # (docs/udp.md). Changing them needs a restart.
    udp: tuple[UdpMapping, ...] = ()
    # LoadBalancer Services: ports opened and closed while running, as these change.
    load_balancers: tuple[LoadBalancerService, ...] = ()
    # Public HTTP listeners, routing requests by Host and path to targets through nodes.
    http: tuple[HttpListener, ...] = ()
    # Destinations the server dials itself for streams agents open (intercepted traffic),
    # for every node; `scopes` add egress for some nodes only.
    egress: tuple[AllowRule, ...] = ()
    # Egress and relays for some nodes only (controller mode: one per ClusterTunnel).
    scopes: tuple[NodeScope, ...] = ()
    # Refused as egress unless a rule names them, besides ALWAYS_PROTECTED: the
    # kube-apiserver's addresses and the Service CIDR (the controller computes them).
    protected: tuple[Cidr, ...] = ()
    # Which node owns which addresses (pod CIDRs, site ranges): streams agents open to
    # such an address are relayed to that node's agent.
    node_cidrs: dict[str, tuple[Cidr, ...]] = {}
    # Routes for the Ingress listeners (controller mode).
    ingress: IngressRoutes = IngressRoutes()
    # Controller mode: the nodes that exist (Node objects) and those revoked; a server
    # accepts only agents of `nodes` not in `denied_nodes`, and disconnects the others
    # when new routes apply. None: no such list (a file's routes: its tokens decide).
    nodes: tuple[str, ...] | None = None
    denied_nodes: tuple[str, ...] = ()  # refused, their tunnels closed (node_revoked)
    # The CONNECT front (kube-apiserver's egress selector, Prometheus): the nodes it may
    # reach, by name, by their addresses, and (pod_ports) by pod addresses in node_cidrs.
    connect_nodes: dict[str, ConnectNode] = {}
    # Nodes whose agents catch dials to `connect_nodes` addresses (cloud nodes where
    # kube-apiserver or metrics-server dial <edge node IP>:10250; the agent's intercept
    # rules REDIRECT them): their streams to such an address are decided like a CONNECT.
    control_plane_sources: tuple[str, ...] = ()
    # How many server replicas serve the public tunnel address: announced in every
    # server's handshake so agents hold a tunnel to each (controller mode: the ready
    # endpoints of the server Service). None: not announced, agents hold one tunnel.
    replicas: int | None = Field(default=None, ge=1, le=64)
    # Bandwidth of nodes' tunnels at the server, by node ("*": every node not named);
    # controller mode: from Node annotations (docs/limits.md).
    bandwidth: dict[str, NodeBandwidth] = {}
    # Scale to zero: seconds between a server's reports of its routes' activity (last
    # request, requests in flight) to the controller, for the routes with `wake`.
    activity_interval: float = Field(default=10.0, gt=0, le=3600)

    def connect_node_for(self, host: str) -> str | None:
        """The node whose name or one of whose `connect_nodes` addresses is `host`."""
        host = host.lower()
        if host in self.connect_nodes:
            return host
        return self._connect_addresses.get(host)

    def node_for_address(self, host: str) -> str | None:
        """The node whose `node_cidrs` hold `host` or an IPv4 address it embeds
        (`addresses_meant`: `::ffff:10.1.2.3` is 10.1.2.3, as the floor sees it)."""
        for address in addresses_meant(host):
            for node, cidrs in self.node_cidrs.items():
                if any(address.version == c.version and address in c for c in cidrs):
                    return node
        return None

    _egress_by_node: dict[str, tuple[AllowRule, ...]] = PrivateAttr(default_factory=dict)
    _relays_by_node: dict[str, tuple[AllowRule, ...]] = PrivateAttr(default_factory=dict)
    _known: frozenset[str] | None = PrivateAttr(default=None)
    _denied: frozenset[str] = PrivateAttr(default=frozenset())
    _connect_addresses: dict[str, str] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any, /) -> None:
        for name in sorted(self.connect_nodes):
            for address in self.connect_nodes[name].addresses:
                self._connect_addresses.setdefault(address, name)
        self._known = None if self.nodes is None else frozenset(self.nodes)
        self._denied = frozenset(self.denied_nodes)
        egress: dict[str, list[AllowRule]] = {}
        relays: dict[str, list[AllowRule]] = {}
        for scope in self.scopes:
            for node in scope.nodes:
                egress.setdefault(node, []).extend(scope.egress)
                relays.setdefault(node, []).extend(scope.relays)
        everyone = [*self.egress, *egress.pop("*", [])]
        self._egress_by_node = {"*": tuple(everyone)}
        for node, rules in egress.items():
            self._egress_by_node[node] = (*everyone, *rules)
        everyone = relays.pop("*", [])
        self._relays_by_node = {"*": tuple(everyone)}
        for node, rules in relays.items():
            self._relays_by_node[node] = (*everyone, *rules)

    def bandwidth_of(self, node: str) -> tuple[float | None, float | None]:
        """(to_node, from_node) bytes/s for `node`'s tunnel; None each way: unlimited."""
        limit = self.bandwidth.get(node) or self.bandwidth.get("*")
        return (None, None) if limit is None else (limit.to_node, limit.from_node)

    def admits(self, node: str) -> bool:
        """Whether `node`'s agent may hold a tunnel (known, not denied)."""
        return node not in self._denied and (self._known is None or node in self._known)

    def relay_allows(self, node: str, host: str, port: int, protocol: str = "tcp") -> bool:
        """Whether `node`'s agent may reach host:port on the node that owns it."""
        rules = self._relays_by_node.get(node) or self._relays_by_node["*"]
        return any(rule.allows(host, port, protocol) for rule in rules)

    def egress_rules(self, node: str) -> tuple[AllowRule, ...]:
        """The egress rules for `node`'s agent: the global ones and its scopes'."""
        return self._egress_by_node.get(node) or self._egress_by_node["*"]

    def check_egress(self, node: str, host: str, port: int,
                     protocol: str = "tcp") -> str | None:
        """None if the server may dial host:port for `node`'s agent; otherwise why not:
        "not_allowed" (no rule of the node's) or "protected" (only wider rules cover a
        protected address). A name passes here on its rules; the server then resolves it
        and checks every address with `address_protected` before dialing one."""
        if not any(r.allows(host, port, protocol) for r in self.egress_rules(node)):
            return "not_allowed"
        return "protected" if self.address_protected(node, host, port, protocol) else None

    def address_protected(self, node: str, address: str, port: int,
                          protocol: str = "tcp") -> bool:
        """Whether `address` (an IP; a name never is) or an IPv4 address it embeds
        (`addresses_meant`) lies in a protected range that no CIDR rule of `node`'s unlocks.
        Each is judged on its own: a rule unlocks it only if it allows that address and
        port and its CIDR lies inside *every* protected range holding that address."""
        rules = self.egress_rules(node)
        for meant in addresses_meant(address):
            ranges = self._ranges_holding(meant)
            if ranges and not any(
                    rule.cidr is not None and rule.allows(str(meant), port, protocol) and all(
                        rule.cidr.version == r.version and rule.cidr.subnet_of(r)  # type: ignore[arg-type]
                        for r in ranges)
                    for rule in rules):
                return True
        return False

    def protected_ranges(self, host: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """The protected ranges that hold `host` or an IPv4 address it embeds
        (`addresses_meant`); none for a name."""
        return [net for meant in addresses_meant(host) for net in self._ranges_holding(meant)]

    def _ranges_holding(self, address: IPAddress) -> list[ipaddress.IPv4Network |
                                                           ipaddress.IPv6Network]:
        return [net for net in (*ALWAYS_PROTECTED, *self.protected)
                if net.version == address.version and address in net]

    def egress_allows(self, host: str, port: int, protocol: str = "tcp",
                      node: str = "*") -> bool:
        return self.check_egress(node, host, port, protocol) is None

    @model_validator(mode="after")
    def _consistent(self) -> RoutesConfig:
        # One validator for the whole model, which subclasses extend through problems():
        # pydantic stops at the first validator that raises, and a file should hear of
        # every problem at once.
        raise_problems(self.problems())
        return self

    def problems(self) -> list[str]:
        """What is wrong across fields (each field alone being valid)."""
        problems = []
        seen: dict[tuple[str, str, int], str] = {}
        listens = [(f"tcp[{i}]", m.listen) for i, m in enumerate(self.tcp)]
        listens += [(f"http[{i}]", h.listen) for i, h in enumerate(self.http)]
        # UDP ports are their own space: tcp :53 and udp :53 may both be mapped.
        listens += [(f"udp[{i}]", m.listen) for i, m in enumerate(self.udp)]
        for where, addr in listens:
            key = ("udp" if where.startswith("udp") else "tcp", addr.host, addr.port)
            if addr.port and key in seen:
                problems.append(f"{where} listens on {addr}, already used by {seen[key]}")
            seen.setdefault(key, where)
        claimed: dict[tuple[str, int], str] = {}
        for service in self.load_balancers:
            for lb_port in service.ports:
                claim = (lb_port.protocol, lb_port.port)
                if claim in claimed:
                    problems.append(f"load_balancers: {service.name} asks for "
                                    f"{lb_port.protocol}/{lb_port.port}, already "
                                    f"{claimed[claim]}'s")
                claimed.setdefault(claim, service.name)
        return problems


# ------------------------------------------------------------------ process settings


class HttpLimitsConfig(Model):
    """Per-server caps of the HTTP and Ingress fronts (nodeagent.http.Limits has the
    reasons for each default). Behind a load balancer that hides client addresses (SNAT),
    every client shares a few addresses: raise or drop the per-client cap there."""

    max_connections: int | None = Field(default=10_000, ge=1)
    max_connections_per_client: int | None = Field(default=256, ge=1)
    max_header_fields: int = Field(default=100, ge=1, le=10_000)
    min_body_rate: float | None = Field(default=1024.0, gt=0)  # bytes/s; None: no floor
    body_grace: float = Field(default=5.0, ge=0, le=3600)


class TunnelListen(Model):
    # Where agents dial in: tls://HOST:PORT (TLS over TCP) or wss://HOST:PORT/PATH
    # (WebSocket over TLS: through HTTP proxies and L7 load balancers).
    url: str = "tls://0.0.0.0:8443"
    # tcp:// and ws:// carry agents' tokens in clear: only when said explicitly.
    insecure: bool = False
    # Admission: agent handshakes per second the server admits, and the burst; beyond
    # it agents are refused with a retry-after (tunnel/limits.py, HandshakeAdmission).
    handshake_rate: float = Field(default=DEFAULT_HANDSHAKE_RATE, gt=0, le=100_000)
    # Handshakes admitted at once before the rate applies.
    handshake_burst: int = Field(default=DEFAULT_HANDSHAKE_BURST, ge=1, le=1_000_000)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_tunnel_url(v)


class ServerConfig(RoutesConfig):
    """A server's config file: its listener, credentials it accepts, and RoutesConfig."""

    # This replica's name in every handshake: agents tell replicas apart by it, so each
    # replica needs its own when `replicas` is over 1.
    server_id: str = "nodeagent-server"
    # Where agents dial in: a URL, or a mapping with `url` and handshake admission.
    tunnel: TunnelListen = TunnelListen()
    # The tunnel's certificate and key (tls:// and wss:// need them) and, for mutual TLS,
    # the CA of the agents' certificates.
    tls: ServerTls | None = None
    # Tokens agents may present, each bound to a node; none: tls.client_ca_file must
    # authenticate them.
    tokens: tuple[TokenEntry, ...] = ()
    debug_socket: ConfigPath = Path(DEFAULT_SERVER_SOCKET)  # what `nodeagent debug` reads
    # GET /metrics (Prometheus), /healthz and /readyz; unset: no such listener.
    metrics_listen: ListenAddress | None = None
    # Seconds a stream to a node may take to open, the agent's dial of the target
    # included; beyond, the HTTP front answers 504.
    dial_timeout: float = Field(default=10.0, gt=0, le=300)
    # PINGs on every tunnel; one unanswered for the timeout ends it.
    keepalive: Keepalive = Keepalive()
    # Controller mode: URL of the controller's config stream; set, the controller's
    # RoutesConfig replaces the file's.
    controller: ControllerUrl | None = None
    # Listeners that serve `ingress` routes: plain HTTP and HTTPS (certificates by SNI).
    ingress_http: ListenAddress | None = None
    ingress_https: ListenAddress | None = None  # HTTPS: certificates by SNI, from Ingress TLS
    http_limits: HttpLimitsConfig = HttpLimitsConfig()  # caps of the HTTP and Ingress fronts
    # Load balancers in front of the public listeners (HTTP, Ingress, TCP mappings) that
    # send PROXY v2: from these addresses a header is required and names the client
    # (X-Forwarded-For, per-client caps, logs); from others none is taken.
    proxy_protocol_from: tuple[Cidr, ...] = ()
    # The CONNECT front for the control plane: off unless connect.uds or connect.listen.
    connect: ConnectFrontConfig = ConnectFrontConfig()
    # Where the ports of `load_balancers` listen (their port numbers are the Services').
    load_balancer_host: str = "0.0.0.0"

    @field_validator("load_balancer_host")
    @classmethod
    def _lb_host(cls, v: str) -> str:
        try:
            return str(ipaddress.ip_address(v.strip("[]")))
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address (0.0.0.0 or :: for every "
                             "interface)") from None

    def problems(self) -> list[str]:
        problems = super().problems()
        scheme = self.tunnel.url.split("://")[0]
        if scheme in ("tls", "wss") and self.tls is None:
            problems.append(f"tunnel {self.tunnel.url} needs a tls section (cert_file, "
                            "key_file)")
        if not self.tokens and (self.tls is None or self.tls.client_ca_file is None):
            problems.append("no way to authenticate agents: add tokens, or "
                            "tls.client_ca_file for mutual TLS")
        if scheme in ("tcp", "ws") and self.tokens and not self.tunnel.insecure:
            problems.append(f"tunnel {self.tunnel.url}: agents' tokens would cross the "
                            f"network in clear; use tls:// or wss://, or set "
                            f"tunnel.insecure: true (a lab on one host)")
        if (self.replicas or 1) > 1 and self.server_id == "nodeagent-server":
            problems.append("replicas > 1 needs a distinct server_id per replica (agents "
                            "tell replicas apart by it)")
        return problems

    def routes(self) -> RoutesConfig:
        return RoutesConfig(version=self.version, tcp=self.tcp, udp=self.udp,
                            load_balancers=self.load_balancers, http=self.http,
                            egress=self.egress, scopes=self.scopes,
                            protected=self.protected, node_cidrs=self.node_cidrs,
                            ingress=self.ingress, nodes=self.nodes,
                            denied_nodes=self.denied_nodes, connect_nodes=self.connect_nodes,
                            control_plane_sources=self.control_plane_sources,
                            replicas=self.replicas, bandwidth=self.bandwidth)


# ------------------------------------------------------------------ loading
