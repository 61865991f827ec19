"""The routes a server runs and the tables its HTTP fronts read.

`RouteTables` holds the RoutesConfig in force, each HTTP listener's route table, the
Ingress route table and the Ingress certificates (by SNI). `replace(routes)` builds all
of them first and then swaps them in one step: a request in flight keeps the table it
matched, the next one sees the new routes. Listeners are fixed for the process's life, so
a change of TCP mappings or HTTP listen addresses is refused (ConfigError) and nothing
changes. A bad Ingress rule or certificate is refused alone and logged; the controller
checks them too, and one bad rule must not take the others down.
"""

from __future__ import annotations

import ssl

from nodeagent.config import (
    ConfigError,
    HttpListener,
    IngressRoutes,
    IngressRule,
    RoutesConfig,
)
from nodeagent.http.gate import GateRegistry
from nodeagent.http.routetable import (
    Backend,
    PathType,
    Route,
    RouteSpec,
    RouteTable,
    WakeSpec,
)
from nodeagent.http.tls import CertStore, context_from_pem
from nodeagent.ops.logs import StructuredLogger
from nodeagent.runtime.gcpause import gc_paused


def build_route_table(listener: HttpListener, gates: GateRegistry | None = None) -> RouteTable:
    """A listener's routes from config → the HTTP front's route table. ConfigError for a
    route whose htpasswd file cannot be used."""
    specs = []
    gates = gates if gates is not None else GateRegistry()
    for index, route in enumerate(listener.routes):
        backend = Backend(node=route.node, host=route.target.host, port=route.target.port)
        name = f"{listener.name or 'http'}[{index}]"
        try:
            gate = gates.gate(name, route.auth, route.rate_limit)
        except ValueError as exc:
            raise ConfigError(f"route {name}: {exc}") from None
        specs.append(RouteSpec(host=route.host, path=route.path,
                               route=Route(name=name, backends=(backend,),
                                           backend_protocol=route.backend_protocol,
                                           gate=gate),
                               path_type=_path_type(route.path_type)))
    return RouteTable.build(specs)


def _ingress_route(rule: IngressRule, gates: GateRegistry) -> Route:
    wake = rule.wake
    return Route(name=rule.name, tls_redirect=rule.tls_redirect,
                 gate=gates.gate(rule.name, rule.auth, rule.rate_limit),
                 backend_protocol=rule.backend_protocol, backends=tuple(
        Backend(node=b.node, host=b.target.host, port=b.target.port) for b in rule.backends),
        wake=None if wake is None else WakeSpec(wake.service, wake.timeout,
                                                wake.max_pending, wake.failure,
                                                wake.starting_page))


def build_ingress_table(ingress: IngressRoutes, gates: GateRegistry | None = None
                        ) -> tuple[RouteTable, list[str]]:
    """The Ingress listeners' route table, and one line per rule the table refused (the
    controller checks rules too; a bad one must not take the others down)."""
    with gc_paused():
        return _build_ingress_table(ingress, gates if gates is not None else GateRegistry())


def _build_ingress_table(ingress: IngressRoutes, gates: GateRegistry
                         ) -> tuple[RouteTable, list[str]]:
    specs, refused = [], []
    for rule in ingress.rules:
        try:
            specs.append(RouteSpec(host=rule.host, path=rule.path,
                                   route=_ingress_route(rule, gates),
                                   path_type=_path_type(rule.path_type), rank=rule.rank))
        except ValueError as exc:
            refused.append(f"{rule.name}: {exc}")
    default = (_ingress_route(ingress.default_backend, gates)
               if ingress.default_backend is not None else None)
    return RouteTable.build(specs, default=default), refused


def build_cert_store(ingress: IngressRoutes) -> tuple[dict[str, ssl.SSLContext], list[str]]:
    """Host → SSLContext for the HTTPS Ingress listener; unusable certificates refused."""
    certs: dict[str, ssl.SSLContext] = {}
    refused = []
    for tls in ingress.tls:
        try:
            ctx = context_from_pem(tls.cert_pem.encode(), tls.key_pem.encode())
        except (ValueError, OSError) as exc:
            refused.append(f"{tls.name}: {exc}")
            continue
        for host in tls.hosts:
            certs.setdefault(host, ctx)
    return certs, refused


_PATH_TYPES = {t.value: t for t in PathType}  # a dict lookup: an Enum call is 10x slower


def _path_type(name: str) -> PathType:
    return _PATH_TYPES[name]


class RouteTables:
    """The routes in force and the route tables and certificates built from them."""

    def __init__(self, routes: RoutesConfig, log: StructuredLogger) -> None:
        self.log = log
        self.routes = routes
        # Routes' rate limits and authentication, kept across rebuilds (http/gate.py).
        self.gates = GateRegistry()
        self.gates.begin()
        self.tables: dict[int, RouteTable] = {
            i: build_route_table(h, self.gates) for i, h in enumerate(routes.http)}
        self.ingress_table, refused = build_ingress_table(routes.ingress, self.gates)
        self.gates.end()
        certs, refused_certs = build_cert_store(routes.ingress)
        self.ingress_certs = CertStore(certs)
        self._log_refused(refused + refused_certs)

    def current(self) -> RoutesConfig:
        """The routes in force (what the other pieces read per stream or request)."""
        return self.routes

    def http_table(self, index: int) -> RouteTable:
        """The current table of HTTP listener `index` (read per request)."""
        return self.tables[index]

    def current_ingress_table(self) -> RouteTable:
        """The current Ingress table (read per request)."""
        return self.ingress_table

    def replace(self, routes: RoutesConfig) -> int:
        """Switch to `routes` at once; returns the number of Ingress certificates now
        served. ConfigError (and nothing changes) if the listeners would change."""
        old = self.routes
        if [m.model_dump() for m in routes.tcp] != [m.model_dump() for m in old.tcp] or \
                [m.model_dump() for m in routes.udp] != [m.model_dump() for m in old.udp] or \
                [h.listen for h in routes.http] != [h.listen for h in old.http]:
            raise ConfigError("TCP and UDP mappings and HTTP listen addresses cannot change "
                              "while running; restart the server for that")
        self.gates.begin()
        tables = {i: build_route_table(h, self.gates) for i, h in enumerate(routes.http)}
        ingress_table, refused = build_ingress_table(routes.ingress, self.gates)
        self.gates.end()
        certs, refused_certs = build_cert_store(routes.ingress)
        self.tables, self.ingress_table, self.routes = tables, ingress_table, routes
        self.ingress_certs.replace(certs)
        self._log_refused(refused + refused_certs)
        return len(certs)

    def _log_refused(self, lines: list[str]) -> None:
        for line in lines:
            self.log.warning("ingress rule refused", problem=line)
