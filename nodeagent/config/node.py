"""What an agent does and needs: `NodeConfig` (allow list, interception — the part the
controller computes per node) and `AgentConfig` (a node's file or flags: its identity,
server, credentials). `intercept_model` is the intercept section as the netfilter
package's model: files are validated with it at load time."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from netfilter.model import (
    InterceptModel,
    InterceptRule,
    Mode,
    NetfilterError,
    ProxyPorts,
    parse_cidrs,
    validate_model,
)
from nodeagent.config.base import (
    DEFAULT_AGENT_SOCKET,
    DEFAULT_SOCKET_MARK,
    DNS_NAME,
    MIN_TOKEN_LENGTH,
    Cidr,
    ConfigError,
    ConfigPath,
    ControllerUrl,
    HostPort,
    InlineToken,
    Keepalive,
    ListenAddress,
    Model,
    PortRange,
    Reconnect,
    TransportProtocol,
    _check_host,
    _check_tunnel_url,
    _read_secret,
    _split_host_port,
    raise_problems,
)
from tunnel.proxy import DIRECT, ProxyRules, parse_proxy_url


def _rule_from_string(value: str) -> dict[str, Any]:
    """An AllowRule's string form as its fields."""
    protocol = "tcp"
    for prefix in ("udp/", "tcp/"):
        if value.lower().startswith(prefix):
            protocol, value = prefix[:3], value[len(prefix):]
    where, port = _split_host_port(value)
    ports: list[str] = [] if port == "*" else [port]
    try:
        return {"cidr": str(ipaddress.ip_network(where, strict=True)), "ports": ports,
                "protocol": protocol}
    except ValueError as exc:
        if "/" in where:
            raise ValueError(f"{where!r} is not a valid CIDR: {exc}") from None
    return {"host": where, "ports": ports, "protocol": protocol}


class AllowRule(Model):
    """A target the server may ask this agent to dial. String form: `10.0.0.0/8:80-443`,
    `127.0.0.1:8080`, `db.local:5432`, `[::1]:80`, `10.1.0.0/16:*`; TCP unless prefixed
    `udp/` (`udp/10.96.0.10:53`; `tcp/` is allowed too). A rule allows one protocol."""

    cidr: Cidr | None = None
    host: str | None = None
    ports: tuple[PortRange, ...] = ()  # empty: any port
    protocol: TransportProtocol = "tcp"

    # One wrap validator, not a `before` and an `after` one (see PortRange's).
    @model_validator(mode="wrap")
    @classmethod
    def _checked(cls, value: Any, handler: ModelWrapValidatorHandler[AllowRule]
                 ) -> AllowRule:
        if isinstance(value, AllowRule):
            return value
        if isinstance(value, str):
            value = _rule_from_string(value)
        self = handler(value)
        if (self.cidr is None) == (self.host is None):
            raise ValueError("give exactly one of cidr or host")
        return self

    @field_validator("host")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        return None if v is None else _check_host(v)

    def allows(self, host: str, port: int, protocol: str) -> bool:
        if protocol != self.protocol:
            return False
        if self.ports and not any(r.contains(port) for r in self.ports):
            return False
        if self.host is not None:
            return host.lower() == self.host
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        assert self.cidr is not None
        return address.version == self.cidr.version and address in self.cidr


class ClientTls(Model):
    """How the agent verifies the server and (for mutual TLS) proves itself."""

    ca_file: ConfigPath | None = None  # None: the system trust store
    # Mutual TLS: this node's certificate (URI SAN nodeagent://node/NAME).
    cert_file: ConfigPath | None = None
    key_file: ConfigPath | None = None  # mutual TLS: its private key
    server_name: str | None = None  # SNI / verification name if not the URL's host
    # Do not verify the server at all (a lab only; the agent logs a warning).
    insecure_skip_verify: bool = False

    @model_validator(mode="after")
    def _pair(self) -> ClientTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class InterceptRuleConfig(Model):
    """Connections from pods (or the node itself) to catch and carry elsewhere."""

    name: str = Field(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*$")
    protocol: TransportProtocol = "tcp"
    destinations: tuple[str, ...] = Field(min_length=1)
    ports: tuple[int | str, ...] = ()  # empty: every port
    source_interfaces: tuple[str, ...] = ()
    source_cidrs: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    host_traffic: bool = False  # also the node's own processes (OUTPUT hook)
    # tunnel: the server dials the destination (egress allow list) or relays it to the
    # node that owns it; direct: the agent dials it itself, marked so it is not caught.
    via: Literal["tunnel", "direct"] = "tunnel"
    # DNS by zone (a udp rule catching pods' DNS, like `sshuttle --dns`): queries for
    # names in these zones go through the tunnel to `dns_resolver` (a cloud-side
    # resolver, reached as egress); every other query goes directly where the pod sent
    # it. Answers come back from the address the pod asked either way.
    dns_zones: tuple[str, ...] = Field(default=(), max_length=64)
    # The zones' resolver, `ip:port` (`10.200.0.10:53`): reached through the tunnel as
    # egress, so the server's egress rules must allow it for udp.
    dns_resolver: Annotated[HostPort, WithJsonSchema(
        {"type": "string", "description": "ip:port of the zones' resolver"})] | None = None

    @field_validator("dns_zones")
    @classmethod
    def _zones(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        zones = []
        for zone in v:
            name = zone.lower().strip(".")
            if not DNS_NAME.fullmatch(name):
                raise ValueError(f"{zone!r} is not a DNS zone (e.g. cloud.internal)")
            zones.append(name + ".")
        return tuple(zones)

    @model_validator(mode="after")
    def _dns(self) -> InterceptRuleConfig:
        if (self.dns_resolver is None) != (not self.dns_zones):
            raise ValueError("dns_zones and dns_resolver go together")
        if self.dns_zones:
            if self.protocol != "udp":
                raise ValueError("dns_zones needs protocol udp")
            if self.via != "tunnel":
                raise ValueError("dns_zones sends its zones through the tunnel: via must "
                                 "be tunnel (the other queries go direct anyway)")
            assert self.dns_resolver is not None
            try:
                ipaddress.ip_address(self.dns_resolver.host)
            except ValueError:
                raise ValueError("dns_resolver must be an IP address and port") from None
        return self


class InterceptConfig(Model):
    mode: Literal["redirect", "tproxy"] = "redirect"
    backend: Literal["auto", "nftables", "iptables"] = "auto"
    proxy_port: int = Field(default=15001, ge=1, le=65535)
    exclude: tuple[str, ...] = ()  # never intercepted, whatever the rules say
    rules: tuple[InterceptRuleConfig, ...] = ()

    @model_validator(mode="after")
    def _valid_for_netfilter(self) -> InterceptConfig:
        # The netfilter model's own validation (overlapping or invalid CIDRs, port
        # ranges, duplicate names), so a bad file is refused at load with the rule's
        # name; interfaces are checked against the host when applied.
        try:
            intercept_model(self, skip_mark=DEFAULT_SOCKET_MARK)
        except NetfilterError as exc:
            # pydantic reports ValueErrors as field errors; anything else would escape as
            # a traceback instead of "agent.yaml: intercept: ...".
            raise ValueError(str(exc)) from None
        return self


def intercept_model(config: InterceptConfig, *, skip_mark: int,
                interfaces: list[str] | None = None) -> InterceptModel:
    """The intercept section as the netfilter package's model, validated. Raises NetfilterError (its
    InvalidRule names the rule) for overlapping or invalid CIDRs, bad ports, unknown
    interfaces (when `interfaces` is given)."""
    rules = tuple(
        InterceptRule.parse(
            rule.name, rule.protocol, rule.destinations, ports=rule.ports,
            source_interfaces=rule.source_interfaces, source_cidrs=rule.source_cidrs,
            exclude=rule.exclude, host_traffic=rule.host_traffic)
        for rule in config.rules
    )
    model = InterceptModel(
        rules=rules,
        # UDP on the same port number: the agent's TPROXY UDP sockets (udp needs tproxy
        # mode; the netfilter model says so by rule name).
        proxy_ports=ProxyPorts(tcp4=config.proxy_port, tcp6=config.proxy_port,
                               udp4=config.proxy_port, udp6=config.proxy_port),
        mode=Mode(config.mode),
        exclude=parse_cidrs("(global)", "exclude", config.exclude),
        skip_mark=skip_mark,
    )
    return validate_model(model, interfaces)


class NodeConfig(Model):
    """What an agent does: the part the controller computes per node."""

    # The config's version: 0 in a file; the controller numbers its changes (shown by
    # `nodeagent debug status` and nodeagent_config_version).
    version: int = Field(default=0, ge=0)
    # The only targets the server may ask this node to dial; anything else is refused
    # (FORBIDDEN). Strings (`127.0.0.1:22`, `10.0.0.0/8:80-443`, `udp/10.96.0.10:53`)
    # or mappings.
    allow: tuple[AllowRule, ...] = ()
    # Catch selected pod or host traffic in netfilter and carry it through the tunnel
    # (docs/operations.md, Node interception); needs CAP_NET_ADMIN.
    intercept: InterceptConfig | None = None
    # What streams the server's CONNECT front opens (kube-apiserver, Prometheus: stream
    # metadata purpose=control-plane) may reach on this node, checked instead of `allow`:
    # the node's own addresses on the ClusterTunnel's allowedNodePorts, pod addresses
    # only on its allowedPodPorts. Empty: no control-plane stream.
    control_plane: tuple[AllowRule, ...] = ()
    # How many server replicas to hold a tunnel to. Controller mode: the ready endpoints
    # of the server Service, pushed when it changes (a replica added during a rollout is
    # dialed at once, not at the next handshake). None: what the servers' handshake says.
    server_replicas: int | None = Field(default=None, ge=1, le=64)

    def allows(self, host: str, port: int, protocol: str = "tcp") -> bool:
        return any(rule.allows(host, port, protocol) for rule in self.allow)

    def allows_control_plane(self, host: str, port: int, protocol: str = "tcp") -> bool:
        return any(rule.allows(host, port, protocol) for rule in self.control_plane)


class AgentConfig(NodeConfig):
    """An agent's config file: who it is, where the server is, and its NodeConfig."""

    node: str  # this node's name (a lower-case DNS name), as the server's tokens name it
    # The server to dial: tls://HOST:PORT or wss://HOST[:PORT]/PATH.
    server: str
    # Server replicas this agent also dials at their own addresses, one tunnel each,
    # besides those it reaches through `server` (the public address).
    direct_servers: tuple[str, ...] = ()
    # The token the server binds to this node, written here; or token_file.
    token: InlineToken | None = Field(default=None, min_length=MIN_TOKEN_LENGTH)
    # A file holding the token. Neither: mutual TLS with tls.cert_file and tls.key_file.
    token_file: ConfigPath | None = None
    # How the server's certificate is verified and, for mutual TLS, this node's own.
    tls: ClientTls = ClientTls()
    # A forward proxy for the tunnel (branch offices often reach the internet only through
    # one): `http://[user:password@]host:port` (HTTP CONNECT, Basic auth) or
    # `socks5://[user:password@]host:port`. `direct`: no proxy, whatever the environment
    # says. Unset: HTTPS_PROXY (tls://, wss://), HTTP_PROXY (tcp://, ws://) and NO_PROXY,
    # read as kubelet reads them. The password never appears in logs or status.
    proxy: str | None = None
    debug_socket: ConfigPath = Path(DEFAULT_AGENT_SOCKET)  # what `nodeagent debug` reads
    # GET /metrics (Prometheus), /healthz and /readyz (ready while a tunnel is up);
    # unset: no such listener.
    metrics_listen: ListenAddress | None = None
    # SO_MARK on every socket the agent opens, so that its own interception rules skip
    # them; setting it needs root or CAP_NET_ADMIN.
    socket_mark: int = Field(default=DEFAULT_SOCKET_MARK, ge=1, le=0xFFFFFFFF)
    dial_timeout: float = Field(default=5.0, gt=0, le=300)  # seconds to reach a target
    # PINGs on every tunnel; one unanswered for the timeout ends it, and the agent redials.
    keepalive: Keepalive = Keepalive()
    reconnect: Reconnect = Reconnect()  # the delays between dials
    # tcp:// and ws:// with a token send it in clear: only when said explicitly.
    insecure: bool = False
    # Controller mode: the projected ServiceAccount token (audience nodeagent) that proves
    # this pod to the controller, which signs the node's certificate for it. It goes only
    # to the controller, inside TLS end to end: never to the server.
    identity_token_file: ConfigPath | None = None
    # Controller mode: URL of the controller's config stream (http://host:port), reached
    # through the tunnel. Set, the controller's NodeConfig replaces the file's.
    controller: ControllerUrl | None = None
    # On SIGTERM: stop taking new intercepted connections and new streams, let running
    # ones finish for up to this long, then exit.
    drain_seconds: float = Field(default=10.0, ge=0, le=3600)
    # Leave the interception rules in the kernel on exit, for the next agent to replace
    # (a DaemonSet restart): pods' intercepted connections are then refused or held,
    # never sent around the tunnel. `nodeagent agent --cleanup` removes them (uninstall).
    keep_rules_on_exit: bool = False

    @field_validator("node")
    @classmethod
    def _node(cls, v: str) -> str:
        if not DNS_NAME.fullmatch(v):
            raise ValueError(f"{v!r} is not a valid node name (lower-case DNS name)")
        return v

    @field_validator("server")
    @classmethod
    def _server(cls, v: str) -> str:
        return _check_tunnel_url(v, dial=True)

    @field_validator("proxy")
    @classmethod
    def _proxy(cls, v: str | None) -> str | None:
        if v is not None and v.strip().lower() != "direct":
            parse_proxy_url(v)  # the message never repeats the URL: it may hold a password
        return v

    @field_validator("direct_servers")
    @classmethod
    def _direct_servers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) > 16:
            raise ValueError("at most 16 direct servers")
        return tuple(_check_tunnel_url(url, dial=True) for url in v)

    @model_validator(mode="after")
    def _credentials(self) -> AgentConfig:
        problems = []  # every one at once
        if self.token is not None and self.token_file is not None:
            problems.append("give token or token_file, not both")
        if self.identity_token_file is not None:
            if self.controller is None:
                problems.append("identity_token_file needs controller (it proves this pod "
                                "to the controller, which signs the node's certificate)")
            if self.token is not None or self.token_file is not None:
                problems.append("with identity_token_file the node's certificate is its "
                                "only credential: drop token and token_file")
        elif self.token is None and self.token_file is None and self.tls.cert_file is None:
            problems.append("no credentials: set token, token_file, or tls.cert_file "
                            "(mutual TLS)")
        clear = [u for u in (self.server, *self.direct_servers)
                 if u.startswith(("tcp://", "ws://"))]
        if clear and not self.insecure and (
                self.token is not None or self.token_file is not None):
            problems.append(f"server {clear[0]}: the token would cross the network in "
                            f"clear; use tls:// or wss://, or set insecure: true (a lab "
                            f"on one host)")
        raise_problems(problems)
        return self

    def proxy_rules(self, environ: dict[str, str] | None = None) -> ProxyRules:
        """Which proxy each server address is dialed through: the `proxy` field, else the
        environment (`environ`, default os.environ). ConfigError for an invalid variable."""
        if self.proxy is not None:
            if self.proxy.strip().lower() == "direct":
                return DIRECT
            return ProxyRules(explicit=parse_proxy_url(self.proxy))
        try:
            return ProxyRules.from_environment(environ)
        except ValueError as exc:
            raise ConfigError(f"environment: {exc}") from None

    def read_token(self) -> str | None:
        if self.token is not None:
            return self.token
        if self.token_file is not None:
            return _read_secret(self.token_file)
        return None

    def node_config(self) -> NodeConfig:
        return NodeConfig(version=self.version, allow=self.allow, intercept=self.intercept,
                          control_plane=self.control_plane,
                          server_replicas=self.server_replicas)
