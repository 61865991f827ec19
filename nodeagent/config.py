"""The one config model: typed, validated, versioned, for files and for the controller.

Files are YAML because the same model appears inside Kubernetes objects (the controller
renders it from CRDs and serves it to agents and servers), and one format for both modes
means an example in the docs works in either. Validation is pydantic: every error names
the field path and the problem, and nothing starts on invalid config.

Two halves per role:
- what it should do (allowed targets, interception, routes): `NodeConfig`, `RoutesConfig`;
  from a file in standalone mode, from the controller in cluster mode, with a version
  either way;
- what a process needs to run at all (its identity, where to connect, credentials, the
  debug socket): `AgentConfig` and `ServerConfig` extend those halves with it; only ever
  from a file or flags.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from netfilter.model import (
    InterceptModel,
    InterceptRule,
    InvalidRule,
    Mode,
    NetfilterError,
    ProxyPorts,
    parse_cidrs,
    validate_model,
)

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_NAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def valid_node_name(name: str) -> bool:
    """A Kubernetes node name: a DNS-1123 subdomain (lower case, at most 253 characters).
    Node names become dict keys, metric labels and log fields: nothing else gets in."""
    return bool(DNS_NAME.match(name))


DEFAULT_AGENT_SOCKET = "/run/nodeagent/agent.sock"
DEFAULT_SERVER_SOCKET = "/run/nodeagent/server.sock"
# SO_MARK of the agent's own sockets; its netfilter rules skip this mark. Bit 20: clear
# of kube-proxy's 0x4000/0x8000 masquerade/drop bits.
DEFAULT_SOCKET_MARK = 0x100000


M = TypeVar("M", bound="BaseModel")


class ConfigError(Exception):
    """Invalid configuration; the message names the source, the field and the problem."""


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


# ------------------------------------------------------------------ small types


def _cidr_as_text(value: Any) -> Any:
    # pydantic would read a bare number as an address (5 → 0.0.0.5/32): in a config
    # file that is always a mistake, so a CIDR must be written as text.
    if isinstance(value, str | ipaddress.IPv4Network | ipaddress.IPv6Network):
        return value
    raise ValueError(f"{value!r} is not a CIDR; write it as text, e.g. 10.0.0.0/8")


Cidr = Annotated[ipaddress.IPv4Network | ipaddress.IPv6Network, BeforeValidator(_cidr_as_text)]


def _split_host_port(text: str) -> tuple[str, str]:
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{text!r}: expected [ipv6]:port")
        return host, rest[1:]
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r}: expected host:port")
    return host, port


def _parse_port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"port {text!r} out of range 1-65535")
    return int(text)


def _check_host(host: str) -> str:
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not DNS_NAME.match(host.lower()):
        raise ValueError(f"{host!r} is neither an IP address nor a DNS name")
    return host.lower()


class HostPort(Model):
    """`host:port`, `[v6]:port`; parsed from that string form."""

    host: str
    port: int

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            host, port = _split_host_port(value)
            return {"host": host, "port": _parse_port(port)}
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return _check_host(v)

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 < v < 65536:
            raise ValueError(f"port {v} out of range 1-65535")
        return v

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class ListenAddress(HostPort):
    """Like HostPort but also accepts `:port` for all addresses, and port 0 (tests)."""

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value.startswith(":"):
                value = "0.0.0.0" + value
            host, port = _split_host_port(value)
            if not port.isdigit() or not 0 <= int(port) < 65536:
                raise ValueError(f"port {port!r} out of range 0-65535")
            return {"host": host, "port": int(port)}
        return value

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 <= v < 65536:
            raise ValueError(f"port {v} out of range 0-65535")
        return v


class PortRange(Model):
    first: int
    last: int

    @model_validator(mode="before")
    @classmethod
    def _from_scalar(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return {"first": value, "last": value}
        if isinstance(value, str):
            a, _, b = value.partition("-")
            first = _parse_port(a.strip())
            return {"first": first, "last": _parse_port(b.strip()) if b else first}
        return value

    @model_validator(mode="after")
    def _ordered(self) -> PortRange:
        for v in (self.first, self.last):
            if not 0 < v < 65536:
                raise ValueError(f"port {v} out of range 1-65535")
        if self.first > self.last:
            raise ValueError(f"port range {self.first}-{self.last} is reversed")
        return self

    def contains(self, port: int) -> bool:
        return self.first <= port <= self.last


class AllowRule(Model):
    """A target the server may ask this agent to dial. String form: `10.0.0.0/8:80-443`,
    `127.0.0.1:8080`, `db.local:5432`, `[::1]:80`, `10.1.0.0/16:*`."""

    cidr: Cidr | None = None
    host: str | None = None
    ports: tuple[PortRange, ...] = ()  # empty: any port
    protocol: Literal["tcp", "udp"] = "tcp"

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        where, port = _split_host_port(value)
        ports: list[str] = [] if port == "*" else [port]
        try:
            return {"cidr": str(ipaddress.ip_network(where, strict=True)), "ports": ports}
        except ValueError as exc:
            if "/" in where:
                raise ValueError(f"{where!r} is not a valid CIDR: {exc}") from None
        return {"host": where, "ports": ports}

    @field_validator("host")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        return None if v is None else _check_host(v)

    @model_validator(mode="after")
    def _one_of(self) -> AllowRule:
        if (self.cidr is None) == (self.host is None):
            raise ValueError("give exactly one of cidr or host")
        return self

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

    ca_file: Path | None = None  # None: the system trust store
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None  # SNI / verification name if not the URL's host
    insecure_skip_verify: bool = False

    @model_validator(mode="after")
    def _pair(self) -> ClientTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class ServerTls(Model):
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None  # set: agents may (or must) present certificates
    require_client_cert: bool = False

    @model_validator(mode="after")
    def _mtls(self) -> ServerTls:
        if self.require_client_cert and self.client_ca_file is None:
            raise ValueError("require_client_cert needs client_ca_file")
        return self


class TokenEntry(Model):
    """A token an agent may present. node "*" accepts any node name (a shared token:
    convenient for a lab, weaker: any holder can claim any node)."""

    node: str
    token: str | None = Field(default=None, min_length=16)
    token_file: Path | None = None

    @field_validator("node")
    @classmethod
    def _node(cls, v: str) -> str:
        if v != "*" and not DNS_NAME.match(v):
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


def _read_secret(path: Path) -> str:
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if len(value) < 16:
        raise ConfigError(f"{path}: token is shorter than 16 characters")
    return value


class Keepalive(Model):
    interval: float = Field(default=15.0, gt=0, le=3600)
    timeout: float = Field(default=10.0, gt=0, le=3600)


class Reconnect(Model):
    initial: float = Field(default=0.2, gt=0, le=60)
    maximum: float = Field(default=15.0, gt=0, le=3600)


# ------------------------------------------------------------------ what a node does


class InterceptRuleConfig(Model):
    """Connections from pods (or the node itself) to catch and carry elsewhere."""

    name: str = Field(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*$")
    protocol: Literal["tcp", "udp"] = "tcp"
    destinations: tuple[str, ...] = Field(min_length=1)
    ports: tuple[int | str, ...] = ()  # empty: every port
    source_interfaces: tuple[str, ...] = ()
    source_cidrs: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    host_traffic: bool = False  # also the node's own processes (OUTPUT hook)
    # tunnel: the server dials the destination (egress allow list) or relays it to the
    # node that owns it; direct: the agent dials it itself, marked so it is not caught.
    via: Literal["tunnel", "direct"] = "tunnel"


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
    for rule in config.rules:
        if rule.protocol != "tcp":
            # The rule model and both backends render udp, but the agent has no UDP relay
            # yet: a udp rule would divert datagrams to a port nobody serves.
            raise InvalidRule(rule.name, "protocol udp is not supported by the agent yet; "
                                         "intercept rules are tcp only")
    rules = tuple(
        InterceptRule.parse(
            rule.name, rule.protocol, rule.destinations, ports=rule.ports,
            source_interfaces=rule.source_interfaces, source_cidrs=rule.source_cidrs,
            exclude=rule.exclude, host_traffic=rule.host_traffic)
        for rule in config.rules
    )
    model = InterceptModel(
        rules=rules,
        proxy_ports=ProxyPorts(tcp4=config.proxy_port, tcp6=config.proxy_port),
        mode=Mode(config.mode),
        exclude=parse_cidrs("(global)", "exclude", config.exclude),
        skip_mark=skip_mark,
    )
    return validate_model(model, interfaces)



class NodeConfig(Model):
    """What an agent does: the part the controller computes per node."""

    version: int = Field(default=0, ge=0)
    allow: tuple[AllowRule, ...] = ()
    intercept: InterceptConfig | None = None

    def allows(self, host: str, port: int, protocol: str = "tcp") -> bool:
        return any(rule.allows(host, port, protocol) for rule in self.allow)


class Backend(Model):
    node: str | None = None  # None: the server dials it directly
    target: HostPort


class TcpMapping(Model):
    """A public TCP port on the server that leads to a target through a node."""

    name: str | None = None
    listen: ListenAddress
    node: str
    target: HostPort


class HttpRoute(Model):
    host: str | None = None  # exact or "*.example.com"; None: any host
    path: str = "/"
    path_type: Literal["Prefix", "Exact", "ImplementationSpecific"] = "Prefix"
    node: str | None = None
    target: HostPort

    @field_validator("host")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        if v is None:
            return None
        name = v.lower()
        if not DNS_NAME.match(name.removeprefix("*.")):
            raise ValueError(f"{v!r} is not a host name (wildcards: *.example.com)")
        return name

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"path {v!r} must start with /")
        return v


class HttpListener(Model):
    name: str | None = None
    listen: ListenAddress
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


class RoutesConfig(Model):
    """What a server does: the part the controller computes per server."""

    version: int = Field(default=0, ge=0)
    tcp: tuple[TcpMapping, ...] = ()
    http: tuple[HttpListener, ...] = ()
    # Destinations the server dials itself for streams agents open (intercepted traffic).
    egress: tuple[AllowRule, ...] = ()
    # Which node owns which addresses (pod CIDRs, site ranges): streams agents open to
    # such an address are relayed to that node's agent.
    node_cidrs: dict[str, tuple[Cidr, ...]] = {}
    # Routes for the Ingress listeners (controller mode).
    ingress: IngressRoutes = IngressRoutes()

    def node_for_address(self, host: str) -> str | None:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return None
        for node, cidrs in self.node_cidrs.items():
            if any(address.version == c.version and address in c for c in cidrs):
                return node
        return None

    def egress_allows(self, host: str, port: int, protocol: str = "tcp") -> bool:
        return any(rule.allows(host, port, protocol) for rule in self.egress)

    @model_validator(mode="after")
    def _unique_ports(self) -> RoutesConfig:
        seen: dict[tuple[str, int], str] = {}
        listens = [(f"tcp[{i}]", m.listen) for i, m in enumerate(self.tcp)]
        listens += [(f"http[{i}]", h.listen) for i, h in enumerate(self.http)]
        for where, addr in listens:
            key = (addr.host, addr.port)
            if addr.port and key in seen:
                raise ValueError(f"{where} listens on {addr}, already used by {seen[key]}")
            seen[key] = where
        return self


# ------------------------------------------------------------------ process settings


def _check_tunnel_url(url: str) -> str:
    if not re.match(r"^(tls|tcp|wss|ws)://", url):
        raise ValueError(f"{url!r}: use tls://host:port, wss://host[:port]/path, ws://, tcp://")
    return url


class AgentConfig(NodeConfig):
    """An agent's config file: who it is, where the server is, and its NodeConfig."""

    node: str
    server: str
    token: str | None = Field(default=None, min_length=16)
    token_file: Path | None = None
    tls: ClientTls = ClientTls()
    debug_socket: Path = Path(DEFAULT_AGENT_SOCKET)
    metrics_listen: ListenAddress | None = None
    socket_mark: int = Field(default=DEFAULT_SOCKET_MARK, ge=1, le=0xFFFFFFFF)
    dial_timeout: float = Field(default=5.0, gt=0, le=300)
    keepalive: Keepalive = Keepalive()
    reconnect: Reconnect = Reconnect()
    # tcp:// and ws:// with a token send it in clear: only when said explicitly.
    insecure: bool = False
    # Controller mode: the projected ServiceAccount token (audience nodeagent) that proves
    # this pod to the controller, which signs the node's certificate for it. It goes only
    # to the controller, inside TLS end to end: never to the server.
    identity_token_file: Path | None = None
    # Controller mode: URL of the controller's config stream (http://host:port), reached
    # through the tunnel. Set, the controller's NodeConfig replaces the file's.
    controller: str | None = None

    @field_validator("node")
    @classmethod
    def _node(cls, v: str) -> str:
        if not DNS_NAME.match(v):
            raise ValueError(f"{v!r} is not a valid node name (lower-case DNS name)")
        return v

    @field_validator("server")
    @classmethod
    def _server(cls, v: str) -> str:
        return _check_tunnel_url(v)

    @model_validator(mode="after")
    def _credentials(self) -> AgentConfig:
        if self.token is not None and self.token_file is not None:
            raise ValueError("give token or token_file, not both")
        if self.identity_token_file is not None:
            if self.controller is None:
                raise ValueError("identity_token_file needs controller (it proves this pod "
                                 "to the controller, which signs the node's certificate)")
            if self.token is not None or self.token_file is not None:
                raise ValueError("with identity_token_file the node's certificate is its "
                                 "only credential: drop token and token_file")
        elif self.token is None and self.token_file is None and self.tls.cert_file is None:
            raise ValueError("no credentials: set token, token_file, or tls.cert_file "
                             "(mutual TLS)")
        if self.server.startswith(("tcp://", "ws://")) and not self.insecure and (
                self.token is not None or self.token_file is not None):
            raise ValueError(f"server {self.server}: the token would cross the network in "
                             f"clear; use tls:// or wss://, or set insecure: true (a lab "
                             f"on one host)")
        return self

    def read_token(self) -> str | None:
        if self.token is not None:
            return self.token
        if self.token_file is not None:
            return _read_secret(self.token_file)
        return None

    def node_config(self) -> NodeConfig:
        return NodeConfig(version=self.version, allow=self.allow, intercept=self.intercept)


class TunnelListen(Model):
    url: str = "tls://0.0.0.0:8443"
    # tcp:// and ws:// carry agents' tokens in clear: only when said explicitly.
    insecure: bool = False

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

    server_id: str = "nodeagent-server"
    tunnel: TunnelListen = TunnelListen()
    tls: ServerTls | None = None
    tokens: tuple[TokenEntry, ...] = ()
    debug_socket: Path = Path(DEFAULT_SERVER_SOCKET)
    metrics_listen: ListenAddress | None = None
    dial_timeout: float = Field(default=10.0, gt=0, le=300)
    keepalive: Keepalive = Keepalive()
    # Controller mode: URL of the controller's config stream; set, the controller's
    # RoutesConfig replaces the file's.
    controller: str | None = None
    # Listeners that serve `ingress` routes: plain HTTP and HTTPS (certificates by SNI).
    ingress_http: ListenAddress | None = None
    ingress_https: ListenAddress | None = None

    @model_validator(mode="after")
    def _secure(self) -> ServerConfig:
        scheme = self.tunnel.url.split("://")[0]
        if scheme in ("tls", "wss") and self.tls is None:
            raise ValueError(f"tunnel {self.tunnel.url} needs a tls section (cert_file, key_file)")
        if not self.tokens and (self.tls is None or self.tls.client_ca_file is None):
            raise ValueError("no way to authenticate agents: add tokens, or "
                             "tls.client_ca_file for mutual TLS")
        if scheme in ("tcp", "ws") and self.tokens and not self.tunnel.insecure:
            raise ValueError(f"tunnel {self.tunnel.url}: agents' tokens would cross the "
                             f"network in clear; use tls:// or wss://, or set "
                             f"tunnel.insecure: true (a lab on one host)")
        return self

    def routes(self) -> RoutesConfig:
        return RoutesConfig(version=self.version, tcp=self.tcp, http=self.http,
                            egress=self.egress, node_cidrs=self.node_cidrs,
                            ingress=self.ingress)


# ------------------------------------------------------------------ loading


def format_errors(source: str, exc: ValidationError) -> str:
    """pydantic errors as one line per field: `source: field.path: problem`."""
    lines = []
    for err in exc.errors():
        loc = ""
        for part in err["loc"]:
            loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field (typo?)"
        elif err["type"] == "missing":
            message = "required field is missing"
        lines.append(f"{source}: {loc or '(top level)'}: {message}")
    return "\n".join(lines)


def parse_config(model: type[M], doc: Any, source: str) -> M:
    """Validate a parsed document; raises ConfigError naming every bad field."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, "
                          f"got {type(doc).__name__}")
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(format_errors(source, exc)) from None


def load_config(model: type[M], path: Path) -> M:
    """Read and validate a YAML file; raises ConfigError with a human message."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    return parse_config(model, doc, str(path))


# Fields whose values are secrets wherever they appear in a config document.
SECRET_FIELDS = frozenset({"key_pem", "token"})
REDACTED = "[redacted]"


def redacted(doc: Any) -> Any:
    """A JSON config document with every secret value replaced (as Envoy's config_dump
    does): what the debug socket and `nodeagent debug config` show, so a dump pasted
    into a ticket leaks no private key or token. File paths to secrets stay visible."""
    if isinstance(doc, dict):
        return {key: REDACTED if key in SECRET_FIELDS and value is not None
                else redacted(value) for key, value in doc.items()}
    if isinstance(doc, list):
        return [redacted(value) for value in doc]
    return doc
