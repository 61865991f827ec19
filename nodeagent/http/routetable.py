"""The HTTP route table: Host + path → Route, with Kubernetes Ingress semantics.

One immutable `RouteTable` serves both the standalone config file's `host + path prefix →
backend` listeners and the controller's Ingress objects. The owner builds a new table with
`RouteTable.build(specs)` and swaps its reference; requests in flight keep the table (and
the `Route`) they looked up, so a route change never drops a connection.

Matching, in order:

* **Host.** The request host is lowercased, its port and one trailing dot stripped. Rule
  hosts are exact (`app.example.com`) or wildcard (`*.example.com`, which matches exactly
  one extra DNS label: `a.example.com`, not `example.com` nor `a.b.example.com`), or absent
  (any host). Host tiers are tried from the most specific: exact, then wildcard, then the
  rules without a host. A tier only claims the request if one of its paths matches;
  otherwise the next tier is tried (Gateway API semantics; it is what the Ingress spec's
  "if the host is unspecified, the rule applies to all inbound traffic" implies).
  Then the default backend, if any; then no match (404).
* **Path**, within a host tier. `Exact` matches the path (query removed) byte for byte,
  case-sensitively. `Prefix` matches element-wise: `/foo` (or `/foo/`: a trailing slash is
  ignored) matches `/foo`, `/foo/` and `/foo/bar`, not `/foobar`; `/` matches every path.
  `ImplementationSpecific` is treated as `Prefix`. An Exact match beats any Prefix match;
  among Prefix matches the longest wins (which is the spec's "longest path, then Exact").
  The table matches the path it is given byte for byte; the front gives it the path
  normalised by `paths.normalize_target` (dot-segments removed, unreserved characters
  decoded), the one it then forwards, so rule paths should be written in that form.
* **Ties** (the same host, path and type from two specs, e.g. two Ingresses): the spec with
  the smallest `(rank, route.name)` wins, then the first in input order. The controller
  sets `rank` to the Ingress's creationTimestamp (RFC 3339, sorts as text), so the oldest
  Ingress wins, as in ingress-nginx; the standalone config leaves it empty.

Lookup is a dict probe for the host and at most (number of `/` in the longest prefix of
that host + 2) dict probes for the path, whatever the table size; `Match` objects are made
at build time, so a lookup allocates only the path slices it probes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from nodeagent.config.httprules import check_rule_host, check_rule_path
from nodeagent.runtime.gcpause import gc_paused

if TYPE_CHECKING:
    from nodeagent.http.headers import ClientRequest


class Gate(Protocol):
    """What the front asks of a route's gate (`gate.RouteGate`: rate limits, then
    authentication): a Protocol here, since the gate imports this module and an import
    either way back would make a circle. `routed` and the answer are a `Route` or a
    `dispatch.Refusal`."""

    async def admit(self, routed: Any, creq: ClientRequest, client: str) -> Any: ...


BackendProtocol = Literal["h1", "h2c"]


@dataclass(frozen=True, slots=True)
class Backend:
    """One place a route's traffic can go: `host:port` as seen from `node`'s agent.

    `node` None means the server reaches `host:port` itself (no tunnel).
    """

    node: str | None
    host: str
    port: int

    def __str__(self) -> str:
        where = f"{self.host}:{self.port}"
        return where if self.node is None else f"{self.node}/{where}"


@dataclass(frozen=True, slots=True)
class WakeSpec:
    """A route whose Service sleeps when idle (scale to zero; `holds.py`)."""

    service: str  # "namespace/name"
    timeout: float  # a held request gets 504 after this many seconds
    max_pending: int  # held requests per Service; beyond, 503 with Retry-After
    failure: str = ""  # the workload fails to start: 502 with this reason
    starting_page: bool = False  # browsers get a page that reloads itself, not a hold


@dataclass(frozen=True, slots=True)
class Route:
    """What a matching request is sent to. Empty `backends` answers 503 (or, with
    `wake`, holds the request until the route has backends)."""

    name: str
    backends: tuple[Backend, ...]
    tls_redirect: bool = False
    """Answer plain-HTTP requests with a 308 to the https:// URL (Ingress with TLS)."""
    backend_protocol: BackendProtocol = "h1"
    """What the backends speak: HTTP/1.1 (a stream per client connection, kept alive), or
    h2c (one shared HTTP/2 connection per backend, each request balanced on its own)."""
    wake: WakeSpec | None = None
    gate: Gate | None = None
    """Rate limits and authentication asked before forwarding (`gate.py`); None: open."""


class PathType(enum.Enum):
    EXACT = "Exact"
    PREFIX = "Prefix"
    IMPLEMENTATION_SPECIFIC = "ImplementationSpecific"




class _RouteSpecFields(NamedTuple):
    host: str | None
    path: str
    route: Route
    path_type: PathType
    rank: str


class RouteSpec(_RouteSpecFields):
    """One rule: requests for `host` (None: any) and `path` go to `route`.

    Invalid values raise ValueError at construction, so a caller turning an Ingress into
    specs can report the bad object and keep the others. A NamedTuple rather than a frozen
    dataclass: a rebuild makes 20,000 of them, and a frozen dataclass's field-by-field
    `object.__setattr__` doubled the cost of each.
    """

    __slots__ = ()

    def __new__(cls, host: str | None, path: str, route: Route,
                path_type: PathType = PathType.PREFIX, rank: str = "") -> RouteSpec:
        # The same rule syntax the controller checks Ingresses with (routerules).
        if host is not None:
            host = check_rule_host(host)
        return super().__new__(cls, host, check_rule_path(path), route, path_type, rank)


class Match(NamedTuple):
    """The result of a lookup: the route and the rule that selected it.

    A NamedTuple rather than a dataclass: the table makes one per rule, and building
    20,000 of them is a measurable part of a rebuild.
    """

    route: Route
    host: str | None
    """The rule's host (`*.example.com` for a wildcard), None for any-host and default."""
    path: str
    """The rule's path as written ("" for the default backend)."""
    path_type: PathType | None
    """None when the default backend matched."""
    order: tuple[str, int] = ("", 0)
    """The spec this match came from: its rank and its position in the input."""


def normalize_host(host: str) -> str:
    """The request's Host header as the table compares it: lowercase, no port, no final dot."""
    if host.startswith("["):
        end = host.find("]")
        host = host[: end + 1] if end > 0 else host
    else:
        colon = host.find(":")
        if colon >= 0:
            host = host[:colon]
    if host.endswith("."):
        host = host[:-1]
    return host.lower()


class _HostRules:
    """The path rules of one host tier entry."""

    __slots__ = ("depth", "exact", "prefix")

    def __init__(self) -> None:
        self.exact: dict[str, Match] = {}
        self.prefix: dict[str, Match] = {}  # key: the prefix without its trailing '/'
        self.depth = 0  # the most '/' in a prefix key: longer candidates cannot match

    def match(self, path: str) -> Match | None:
        if self.exact:
            m = self.exact.get(path)
            if m is not None:
                return m
        prefix = self.prefix
        if not prefix:
            return None
        s = path
        depth = self.depth
        if depth and s.count("/") > depth:
            # Cut after `depth` slashes: a crafted path with thousands of '/' costs one scan.
            pos = -1
            for _ in range(depth + 1):
                pos = s.find("/", pos + 1)
            s = s[:pos]
        while s:
            m = prefix.get(s)
            if m is not None:
                return m
            cut = s.rfind("/")
            if cut < 0:
                break
            s = s[:cut]
        return prefix.get("")


class RouteTable:
    """An immutable Host/path → Route table. Build with `RouteTable.build`."""

    __slots__ = ("_any", "_default", "_exact", "_size", "_wild")

    def __init__(
        self,
        exact: dict[str, _HostRules],
        wild: dict[str, _HostRules],
        any_host: _HostRules | None,
        default: Match | None,
        size: int,
    ) -> None:
        self._exact = exact
        self._wild = wild
        self._any = any_host
        self._default = default
        self._size = size

    @classmethod
    def empty(cls) -> RouteTable:
        return cls({}, {}, None, None, 0)

    @classmethod
    def build(cls, specs: Iterable[RouteSpec], default: Route | None = None) -> RouteTable:
        with gc_paused():  # tens of thousands of small objects at once, none garbage
            return cls._build(specs, default)

    @classmethod
    def _build(cls, specs: Iterable[RouteSpec], default: Route | None) -> RouteTable:
        exact: dict[str, _HostRules] = {}
        wild: dict[str, _HostRules] = {}
        any_host: _HostRules | None = None
        size = 0
        exact_type = PathType.EXACT
        for spec in specs:
            host = spec.host
            if host is None:
                if any_host is None:
                    any_host = _HostRules()
                rules = any_host
            else:
                tier, name = (wild, host[2:]) if host[0] == "*" else (exact, host)
                found = tier.get(name)
                if found is None:
                    found = tier[name] = _HostRules()
                rules = found
            path = spec.path
            if spec.path_type is exact_type:
                key = path
                table = rules.exact
            else:
                key = path.rstrip("/")
                table = rules.prefix
                depth = key.count("/")
                if depth > rules.depth:
                    rules.depth = depth
            held = table.get(key)
            if held is None:
                table[key] = Match(spec.route, host, path, spec.path_type, (spec.rank, size))
            else:
                # A tie: the smallest (rank, route name) wins, then the first given.
                order = (spec.rank, size)
                if (spec.rank, spec.route.name) < (held.order[0], held.route.name):
                    table[key] = Match(spec.route, host, path, spec.path_type, order)
            size += 1
        default_match = Match(default, None, "", None) if default is not None else None
        return cls(exact, wild, any_host, default_match, size)

    def __len__(self) -> int:
        return self._size

    def lookup(self, host: str, path: str) -> Match | None:
        """The match for a request, or None (404). `host` is the raw Host header value."""
        q = path.find("?")
        if q >= 0:
            path = path[:q]
        host = normalize_host(host)
        rules = self._exact.get(host)
        if rules is not None:
            m = rules.match(path)
            if m is not None:
                return m
        if self._wild:
            dot = host.find(".")
            if dot > 0:
                rules = self._wild.get(host[dot + 1 :])
                if rules is not None:
                    m = rules.match(path)
                    if m is not None:
                        return m
        if self._any is not None:
            m = self._any.match(path)
            if m is not None:
                return m
        return self._default
