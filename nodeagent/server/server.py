"""The server role: terminate agents' tunnels; carry public TCP ports and HTTP into them.

- the tunnel listener (TLS or WebSocket) hands each agent connection to
  `tunnel.server.TunnelServer`, which authenticates it (a token, or the node name in its
  mutual-TLS certificate) and registers it by node name;
- each TCP mapping listens on a public port and splices every accepted connection into a
  stream to `node` → `target`;
- each HTTP listener routes requests by Host and path (nodeagent.http) into streams;
- the debug socket and metrics show all of it.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import Counter as MetricCounter
from prometheus_client.metrics_core import Metric

from nodeagent import __version__
from nodeagent.config import (
    ConfigError,
    HttpListener,
    IngressRoutes,
    IngressRule,
    RoutesConfig,
    ServerConfig,
    TcpMapping,
    valid_node_name,
)
from nodeagent.configstream.client import WatchStatus
from nodeagent.http.errors import UpstreamUnavailable
from nodeagent.http.routes import Backend, PathType, Route, RouteSpec, RouteTable
from nodeagent.http.stats import HttpStats
from nodeagent.http.tls import CertStore, context_from_pem
from nodeagent.ops.logs import StructuredLogger, get_logger
from nodeagent.ops.metrics import Metrics, counter, gauge
from nodeagent.ops.streams import (
    TO_NODE,
    StreamNotes,
    opener_from_metadata,
    stream_rows,
    tracked_opener,
)
from nodeagent.runtime.gcpause import gc_paused
from nodeagent.server.connectfront import ConnectFront
from nodeagent.server.dnat import POLICY_REASONS, DnatPath
from nodeagent.server.readiness import ReadinessGate, nodes_routed_to
from nodeagent.trust.filewatch import FileReloader
from tunnel import protocol as p
from tunnel.endpoint import (
    AuthenticationFailed,
    EndpointSettings,
    IncomingStream,
    StreamRefusedError,
)
from tunnel.errors import StreamFailed
from tunnel.log import RateLimitedLog
from tunnel.relay import relay_connection, relay_incoming
from tunnel.server import Bootstrap, HandshakeAdmission, TunnelServer
from tunnel.tcp import DialFailed, connect_tcp
from tunnel.transports import PeerInfo

if TYPE_CHECKING:  # controller mode only: it imports cryptography
    from nodeagent.trust.enrollment import IdentityKeeper

log = get_logger("nodeagent.server")


def build_route_table(listener: HttpListener) -> RouteTable:
    """A listener's routes from config → the HTTP front's route table."""
    specs = []
    for index, route in enumerate(listener.routes):
        backend = Backend(node=route.node, host=route.target.host, port=route.target.port)
        name = f"{listener.name or 'http'}[{index}]"
        specs.append(RouteSpec(host=route.host, path=route.path,
                               route=Route(name=name, backends=(backend,)),
                               path_type=_path_type(route.path_type)))
    return RouteTable.build(specs)


def _ingress_route(rule: IngressRule) -> Route:
    return Route(name=rule.name, tls_redirect=rule.tls_redirect, backends=tuple(
        Backend(node=b.node, host=b.target.host, port=b.target.port) for b in rule.backends))


def build_ingress_table(ingress: IngressRoutes) -> tuple[RouteTable, list[str]]:
    """The Ingress listeners' route table, and one line per rule the table refused (the
    controller checks rules too; a bad one must not take the others down)."""
    with gc_paused():
        return _build_ingress_table(ingress)


def _build_ingress_table(ingress: IngressRoutes) -> tuple[RouteTable, list[str]]:
    specs, refused = [], []
    for rule in ingress.rules:
        try:
            specs.append(RouteSpec(host=rule.host, path=rule.path, route=_ingress_route(rule),
                                   path_type=_path_type(rule.path_type), rank=rule.rank))
        except ValueError as exc:
            refused.append(f"{rule.name}: {exc}")
    default = (_ingress_route(ingress.default_backend)
               if ingress.default_backend is not None else None)
    return RouteTable.build(specs, default=default), refused


def build_cert_store(ingress: IngressRoutes) -> tuple[dict[str, Any], list[str]]:
    """Host → SSLContext for the HTTPS Ingress listener; unusable certificates refused."""
    certs: dict[str, Any] = {}
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


def _host_port(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


_PATH_TYPES = {t.value: t for t in PathType}  # a dict lookup: an Enum call is 10x slower


def _path_type(name: str) -> PathType:
    return _PATH_TYPES[name]


# The log line of each policy refusal (`Server._refuse`), by its metric reason.
_REFUSAL_LOG = {
    "egress_not_allowed": "agent stream refused: destination not allowed",
    "egress_protected": "agent stream refused: protected destination",
    "relay_not_allowed": "agent stream refused: relay not allowed",
    "backend_protected": "direct backend refused: protected destination",
}


async def resolve_tcp(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to for TCP, in the resolver's order, once each."""
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DialFailed("dns", f"cannot resolve {host}: {exc.strerror}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise DialFailed("dns", f"{host} has no addresses")
    return addresses


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.routes: RoutesConfig = config.routes()
        self.started = time.monotonic()
        self.metrics = Metrics("server")
        self.metrics.config_version.set(self.routes.version)
        self.outcomes: Counter[str] = Counter()
        self.config_watch: WatchStatus | None = None
        # Controller mode: this replica's certificate for the config stream (status only).
        self.identity: IdentityKeeper | None = None
        self.log = log.bind(server=config.server_id)
        # How names are resolved for egress and direct backends (tests inject theirs).
        self.resolve: Callable[[str, int], Awaitable[list[str]]] = resolve_tcp
        self._tokens = [(entry.node, entry.read().encode()) for entry in config.tokens]
        # The token each registered node authenticated with (standalone): a reload that
        # removes or rotates it closes that node's tunnel (reload_tokens).
        self._session_tokens: dict[str, bytes] = {}
        settings = EndpointSettings(ping_interval=config.keepalive.interval,
                                    ping_timeout=config.keepalive.timeout,
                                    on_rtt=self.metrics.tunnel_rtt.observe)
        # Controller mode: agents without a certificate yet may open a bootstrap
        # connection, whose streams reach the controller's signer and nothing else.
        self.tunnel = TunnelServer(
            authenticate=self.authenticate, server_id=config.server_id, settings=settings,
            stream_handler=self.handle_agent_stream,
            bootstrap_handler=self.handle_bootstrap_stream if config.controller else None,
            admission=HandshakeAdmission(config.tunnel.handshake_rate,
                                         config.tunnel.handshake_burst),
            replicas=self.routes.replicas,
            on_refusal=lambda reason: self.refusals.labels(f"handshake_{reason}").inc(),
            log=self.log)
        self._egress_refusals = RateLimitedLog(self.log, period=60.0)
        # When each stream opened and for what (debug streams); every stream this server
        # opens to a node goes through open_stream, which also times its setup.
        self.stream_notes = StreamNotes()
        self.open_stream = tracked_opener(self.tunnel.open_stream, self.stream_notes,
                                          self.metrics.stream_setup.labels(TO_NODE).observe)
        # Streams refused by policy, by why (a fixed set: see _refuse), and handshakes
        # refused before authentication (handshake_overloaded, handshake_shutting_down).
        self.refusals = MetricCounter(
            "nodeagent_server_refusals_total", "Agent streams and registrations the "
            "server refused by policy, by reason", ["reason"], registry=self.metrics.registry)
        self.tables: dict[int, RouteTable] = {
            i: build_route_table(h) for i, h in enumerate(self.routes.http)}
        self.ingress_table, refused = build_ingress_table(self.routes.ingress)
        certs, refused_certs = build_cert_store(self.routes.ingress)
        self.ingress_certs = CertStore(certs)
        # Agents reach the controller's config stream through their tunnel: always egress.
        self._controller = _host_port(config.controller) if config.controller else None
        for line in refused + refused_certs:
            self.log.warning("ingress rule refused", problem=line)
        self.bound: dict[str, list[str]] = {}  # listener name -> addresses, for status
        self.http_stats: dict[str, HttpStats] = {}  # listener name -> its front's counters
        # Credentials reloaded from their files (tunnel TLS, tokens): name -> reloader.
        self.reloaders: dict[str, FileReloader[Any]] = {}
        self.metrics.add_live(self._live_metrics)
        # The CONNECT front (kube-apiserver's egress selector, Prometheus), if configured.
        self.connect = ConnectFront(
            config.connect, routes=lambda: self.routes, open_stream=self.open_stream,
            dial_timeout=config.dial_timeout, registry=self.metrics.registry, log=self.log,
            server_tls=(config.tls.cert_file, config.tls.key_file) if config.tls else None,
        ) if config.connect.enabled else None
        # Cloud nodes' caught dials to other nodes' addresses (control_plane_sources).
        self.dnat = DnatPath(open_stream=self.open_stream,
                             dial_timeout=config.dial_timeout,
                             registry=self.metrics.registry, log=self.log)
        # /readyz: replaced by serve_server when the listeners are up (its grace from then).
        self.ready_gate = ReadinessGate(started=time.monotonic())

    # ---------------------------------------------------------------- config

    def apply_routes(self, routes: RoutesConfig) -> None:
        """Switch to new routes at once. HTTP and Ingress routes, certificates, egress and
        node CIDRs change in place: requests in flight keep the route they matched, open
        streams keep going. Listeners are fixed for the process's life (the controller
        never changes them): a change of TCP mappings or HTTP listen addresses raises
        ConfigError and nothing changes."""
        started = time.monotonic()
        try:
            self._apply_routes(routes)
        except BaseException:
            self.metrics.config_apply.labels("failed").observe(time.monotonic() - started)
            raise
        self.metrics.config_apply.labels("ok").observe(time.monotonic() - started)

    def _apply_routes(self, routes: RoutesConfig) -> None:
        old = self.routes
        if [m.model_dump() for m in routes.tcp] != [m.model_dump() for m in old.tcp] or \
                [h.listen for h in routes.http] != [h.listen for h in old.http]:
            raise ConfigError("TCP mappings and HTTP listen addresses cannot change while "
                              "running; restart the server for that")
        tables = {i: build_route_table(h) for i, h in enumerate(routes.http)}
        ingress_table, refused = build_ingress_table(routes.ingress)
        certs, refused_certs = build_cert_store(routes.ingress)
        self.tables, self.ingress_table, self.routes = tables, ingress_table, routes
        self.tunnel.replicas = routes.replicas  # announced from the next handshake on
        self.ingress_certs.replace(certs)
        for line in refused + refused_certs:
            self.log.warning("ingress rule refused", problem=line)
        self.metrics.config_version.set(routes.version)
        self.log.info("routes applied", version=routes.version,
                      ingress_rules=len(routes.ingress.rules), certificates=len(certs))

    # ---------------------------------------------------------------- readiness

    def not_ready(self) -> str | None:
        """None when this replica may take public traffic, else why not (readiness.py)."""
        gate = self.ready_gate
        was_ready = gate.ready
        reason = gate.check(
            time.monotonic(), draining=self.tunnel.draining,
            have_routes=self.config.controller is None or self.routes.version > 0,
            expected=[n for n in nodes_routed_to(self.routes) if self._may_register(n)],
            held=self.tunnel.sessions)
        if gate.ready and not was_ready:
            self.log.info("ready for public traffic", because=gate.became,
                          agents=len(self.tunnel.sessions),
                          missing=",".join(gate.missing[:20]) or "none")
        return reason

    def _may_register(self, node: str) -> bool:
        """Whether `node`'s agent could register here at all (a node no token or
        certificate admits is never waited for)."""
        if self.config.controller is not None:
            return self.routes.nodes is None or self.routes.admits(node)
        tls = self.config.tls
        if tls is not None and tls.client_ca_file is not None:
            return True
        return any(allowed in (node, "*") for allowed, _ in self._tokens)

    # ---------------------------------------------------------------- identity

    async def authenticate(self, hello: p.Hello, peer: PeerInfo) -> str | Bootstrap:
        """Decide which node a dialing agent is. Mutual TLS: the certificate names the
        node and the claim must match. Token: must match the node's entry (or "*").
        Controller mode: an agent with neither that asks for `bootstrap` may fetch its
        certificate (Bootstrap), nothing else."""
        node = hello.identity.get("node", "")
        if not node:
            self.metrics.bad_input.labels("auth").inc()
            raise AuthenticationFailed("HELLO names no node")
        if not isinstance(node, str) or not valid_node_name(node):
            # Before anything else: the name becomes a dict key, a metric label, log fields.
            self.metrics.bad_input.labels("auth").inc()
            raise AuthenticationFailed("HELLO names an invalid node name (a node name is a "
                                       "lower-case DNS name of at most 253 characters)")
        if peer.certificate_der is not None:
            # Only agents with certificates need cryptography to read them (~9 MiB):
            # a server of token-authenticated agents never loads it.
            from nodeagent.trust.pki import node_name_from_certificate

            cert_node = node_name_from_certificate(peer.certificate_der)
            if cert_node is not None:
                if cert_node != node:
                    self.metrics.bad_input.labels("auth").inc()
                    raise AuthenticationFailed(
                        f"certificate is for node {cert_node}, HELLO claims {node}")
                self._session_tokens.pop(node, None)
                return self._admitted(node)
        token = hello.identity.get("token") or _bearer(peer)
        if token is None and hello.identity.get("bootstrap") and self.config.controller:
            return Bootstrap(node)  # reaches only the controller, which checks the token
        if token is None:
            self.metrics.bad_input.labels("auth").inc()
            if peer.certificate_der is not None:
                raise AuthenticationFailed(
                    f"node {node} presented no token, and its certificate names no node "
                    f"(that takes a nodeagent://node/<name> URI SAN and clientAuth usage)")
            raise AuthenticationFailed(f"node {node} presented no token and no certificate")
        presented = token.encode()
        if self._token_valid(node, presented):
            admitted = self._admitted(node)
            self._session_tokens[node] = presented
            return admitted
        self.metrics.bad_input.labels("auth").inc()
        raise AuthenticationFailed(f"token not valid for node {node}")

    def _token_valid(self, node: str, presented: bytes) -> bool:
        return any(allowed in (node, "*") and hmac.compare_digest(presented, secret)
                   for allowed, secret in self._tokens)

    def load_tokens(self) -> list[tuple[str, bytes]]:
        """The tokens as their files say now (for FileReloader). A token file that is
        gone is a removed token: that entry accepts nothing. Any other problem (unreadable,
        too short: perhaps half-written) raises ConfigError and the loaded tokens stay."""
        tokens = []
        for index, entry in enumerate(self.config.tokens):
            if entry.token_file is not None and not entry.token_file.exists():
                continue
            try:
                tokens.append((entry.node, entry.read().encode()))
            except ConfigError as exc:
                raise ConfigError(f"tokens[{index}].token_file: {exc}") from None
        return tokens

    async def reload_tokens(self, tokens: list[tuple[str, bytes]]) -> list[str]:
        """Use `tokens` for new handshakes and close the tunnel of every node whose token
        they no longer hold (removed or rotated: an operator revoking a token expects its
        sessions to end). Returns the nodes closed."""
        self._tokens = tokens
        for node in [n for n in self._session_tokens if n not in self.tunnel.sessions]:
            del self._session_tokens[node]  # ended or never registered
        closed = []
        for node, presented in list(self._session_tokens.items()):
            if self._token_valid(node, presented):
                continue
            session = self.tunnel.sessions.get(node)
            del self._session_tokens[node]
            if session is None:
                continue
            closed.append(node)
            self.refusals.labels("token_revoked").inc()
            self._egress_refusals.warning(f"token_revoked:{node}",
                                          "agent disconnected: its token was removed",
                                          reason="token_revoked", node=node)
            await session.connection.aclose(p.ErrorCode.UNAUTHORIZED,
                                            f"the token of node {node} was revoked")
        return closed

    def _admitted(self, node: str) -> str:
        """Controller mode: an authenticated node must also exist and not be denied (the
        routes' `nodes`, `denied_nodes`); before the first routes, no node is known."""
        if self.config.controller is None or (
                self.routes.nodes is not None and self.routes.admits(node)):
            return node
        self.refusals.labels("node_not_admitted").inc()
        self._egress_refusals.warning(f"node_not_admitted:{node}", "agent refused",
                                      reason="node_not_admitted", node=node)
        raise AuthenticationFailed(f"node {node} is not a known Node or is denied")

    async def close_revoked(self) -> list[str]:
        """Close the tunnels of nodes the current routes no longer admit (a Node deleted,
        or in a ClusterTunnel's deniedNodes); returns their names."""
        if self.config.controller is None or self.routes.nodes is None:
            return []
        revoked = [n for n in self.tunnel.sessions if not self.routes.admits(n)]
        for node in revoked:
            session = self.tunnel.sessions.get(node)
            if session is None:
                continue
            self.refusals.labels("node_revoked").inc()
            self.log.warning("agent disconnected: node deleted or denied", node=node)
            await session.connection.aclose(p.ErrorCode.UNAUTHORIZED,
                                            f"node {node} is no longer admitted")
        return revoked

    # ---------------------------------------------------------------- streams in

    async def handle_agent_stream(self, node: str, incoming: IncomingStream) -> None:
        """A stream an agent opened (intercepted traffic). A cloud node's dial to a node's
        address takes the DNAT path (server/dnat.py). Otherwise: relay it to the node that owns
        the destination if a relay policy lets this node reach it, or dial it if this
        node's egress allows it (protected ranges only when a rule names them); otherwise
        refuse (FORBIDDEN, counted, logged). Nothing is an open proxy."""
        target = incoming.target
        self.stream_notes.note(
            incoming.stream, "agent to the controller" if (target.host, target.port) ==
            self._controller else opener_from_metadata(incoming.metadata))
        if self.dnat.catches(node, target.host, self.routes):
            # A cloud node's caught dial to a node's address: decided like a CONNECT.
            outcome = await self.dnat.relay(node, incoming, self.routes)
            self._count_in("control_plane" if outcome == "established" else outcome)
            if outcome in POLICY_REASONS:
                self.refusals.labels("control_plane_refused").inc()
            return
        origin = incoming.metadata.get("origin", "")
        owner = self.routes.node_for_address(target.host)
        via = "egress"

        async def open_upstream() -> trio.abc.HalfCloseableStream:
            nonlocal via
            if owner is not None and owner != node:
                via = "relay"
                if not self.routes.relay_allows(node, target.host, target.port,
                                                target.protocol):
                    raise self._refuse("relay_not_allowed", node, f"{target} belongs to "
                                       f"node {owner}; no relay policy lets node {node} "
                                       f"reach it", target=str(target), origin=origin)
                return await self.open_to(owner, target.host, target.port, f"{node}/{origin}")
            if (target.host, target.port) == self._controller:
                # The config and signing streams: always, whatever the egress rules.
                return await connect_tcp(target.host, target.port,
                                         connect_timeout=self.config.dial_timeout)
            why = self.routes.check_egress(node, target.host, target.port, target.protocol)
            if why is None:
                return await self.dial_checked(
                    target.host, target.port,
                    lambda address: self.routes.address_protected(
                        node, address, target.port, target.protocol),
                    lambda address: self._refuse(
                        "egress_protected", node, f"{target.host} resolves to {address}, "
                        f"which is protected (loopback, link-local, the API server or the "
                        f"Service range) and no CIDR egress rule of node {node} names its "
                        f"range", target=str(target), origin=origin))
            if why == "not_allowed":
                raise self._refuse("egress_not_allowed", node,
                                   f"{target} is not in node {node}'s egress allow list",
                                   target=str(target), origin=origin)
            raise self._refuse("egress_protected", node,
                               f"{target} is protected (loopback, link-local, the API server "
                               f"or the Service range) and no egress rule of node {node} "
                               f"names its range", target=str(target), origin=origin)

        relayed = await relay_incoming(incoming, open_upstream,
                                       on_accepted=lambda: self._count_in(via))
        if relayed.failure is not None:
            self._count_in(relayed.failure.outcome)

    async def handle_bootstrap_stream(self, claimed_node: str, incoming: IncomingStream) -> None:
        """A stream on a bootstrap connection: to the controller (whose signer checks the
        agent's token, inside TLS end to end) or nowhere."""
        target = incoming.target

        async def open_upstream() -> trio.abc.HalfCloseableStream:
            if (target.host, target.port) != self._controller:
                self._egress_refusals.warning(
                    "bootstrap", "bootstrap stream refused: only the controller is reachable",
                    claimed_node=claimed_node, target=str(target))
                raise StreamFailed(p.StreamReason.FORBIDDEN, "a connection without a "
                                   "certificate may only reach the controller")
            return await connect_tcp(target.host, target.port,
                                     connect_timeout=self.config.dial_timeout)

        relayed = await relay_incoming(incoming, open_upstream,
                                       on_accepted=lambda: self._count_in("bootstrap"))
        if relayed.failure is not None:
            self._count_in(f"bootstrap_{relayed.failure.outcome}")

    async def dial_checked(self, host: str, port: int, protected: Callable[[str], bool],
                           refuse: Callable[[str], Exception]) -> trio.SocketStream:
        """Dial host:port, a name resolved here once: every address it resolves to must
        pass `protected` (else `refuse(address)` is raised: a name with one protected
        address is refused whole), and the connection goes to exactly those checked
        addresses, in order — no second resolution, so no DNS-rebinding window between
        the check and the connect. An IP literal is checked and dialed as it is."""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            literal = False
        else:
            literal = True
        failure: StreamFailed | None = None
        with trio.move_on_after(self.config.dial_timeout):
            addresses = [host] if literal else await self.resolve(host, port)
            for address in addresses:
                if protected(address):
                    raise refuse(address)
            for address in addresses:
                try:
                    return await connect_tcp(address, port, connect_timeout=None)
                except DialFailed as exc:
                    failure = exc
        raise failure or DialFailed("timeout", f"connecting to {host}:{port} timed out "
                                               f"after {self.config.dial_timeout:g}s")

    def _refuse(self, reason: str, node: str, message: str, **fields: Any) -> StreamFailed:
        """Count a policy refusal (`reason` from a fixed set), log it at most once a minute
        per (reason, node) — keys the server bounds, never what the agent names — and
        return the FORBIDDEN failure to raise."""
        self.refusals.labels(reason).inc()
        self._egress_refusals.warning(f"{reason}:{node}", _REFUSAL_LOG[reason],
                                      reason=reason, node=node, problem=message, **fields)
        return StreamFailed(p.StreamReason.FORBIDDEN, message)

    def _count_in(self, outcome: str) -> None:
        self.outcomes[f"agent_opened:{outcome}"] += 1
        self.metrics.streams.labels("inbound", outcome).inc()

    # ---------------------------------------------------------------- streams out

    async def open_to(self, node: str | None, host: str, port: int,
                      origin: str) -> trio.abc.HalfCloseableStream:
        """A stream to host:port through `node` (or directly when node is None).
        Raises StreamFailed (StreamRefusedError or DialFailed) with the reason."""
        if node is None:
            return await connect_tcp(host, port, connect_timeout=self.config.dial_timeout)
        with trio.move_on_after(self.config.dial_timeout) as scope:
            return await self.open_stream(node, p.Target(host, port), {"origin": origin})
        assert scope.cancelled_caught
        raise StreamRefusedError(p.StreamReason.TIMEOUT,
                                 f"node {node} did not answer within {self.config.dial_timeout}s")

    async def open_upstream(self, backend: Backend, route: Route,
                            client: str = "") -> trio.abc.HalfCloseableStream:
        """For the HTTP front: tunnel failures become 502 / 504 with a readable reason."""
        try:
            if backend.node is None and self.config.controller is not None:
                # An Ingress's direct backend (opted in): names a namespace user controls.
                stream: trio.abc.HalfCloseableStream = await self.dial_checked(
                    backend.host, backend.port,
                    lambda address: self.routes.address_protected(
                        "*", address, backend.port),
                    lambda address: self._refuse(
                        "backend_protected", route.name, f"{backend.host} is or resolves to "
                        f"{address}, which is protected (loopback, link-local, the API "
                        f"server or the Service range)", backend=f"{backend.host}:"
                        f"{backend.port}"))
            else:
                stream = await self.open_to(backend.node, backend.host, backend.port, client)
                # One upstream stream serves a client connection's requests in turn.
                self.stream_notes.note(stream, f"http route {route.name}" + (
                    f" client {client}" if client else ""))
        except StreamFailed as exc:
            self._count(exc.outcome)
            status = 504 if exc.reason is p.StreamReason.TIMEOUT else 502
            where = f"node {backend.node}" if backend.node else "the server"
            raise UpstreamUnavailable(
                status, f"{backend.host}:{backend.port} via {where}: {exc.message}") from None
        self._count("accepted")
        return stream

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.metrics.streams.labels("outbound", outcome).inc()

    async def serve_tcp_mapping(self, mapping: TcpMapping, client: trio.SocketStream) -> None:
        peer = _address(client)  # the stream's origin, which the agent logs
        name = f"tcp mapping {mapping.name or f':{mapping.listen.port}'} client {peer}"

        async def open_upstream() -> trio.abc.HalfCloseableStream:
            stream = await self.open_to(mapping.node, mapping.target.host,
                                        mapping.target.port, peer)
            self.stream_notes.note(stream, name)
            return stream

        relayed = await relay_connection(client, open_upstream,
                                         on_accepted=lambda: self._count("accepted"))
        if relayed.failure is not None:
            self._count(relayed.failure.outcome)
            self._mapping_log(mapping, peer).info(
                "connection refused", reason=relayed.failure.outcome,
                error=relayed.failure.message)
            return
        result = relayed.spliced
        assert result is not None
        self.metrics.stream_bytes.labels("out").inc(result.a_to_b)
        self.metrics.stream_bytes.labels("in").inc(result.b_to_a)
        if self.log.isEnabledFor(logging.DEBUG):  # no logger bound per connection otherwise
            self._mapping_log(mapping, peer).debug(
                "connection finished", sent=result.a_to_b, received=result.b_to_a,
                error=result.error or "")

    def _mapping_log(self, mapping: TcpMapping, peer: str) -> StructuredLogger:
        return self.log.bind(listener=mapping.name or f":{mapping.listen.port}",
                             node=mapping.node, target=str(mapping.target), client=peer)

    # ---------------------------------------------------------------- status

    def _live_metrics(self) -> Iterable[Metric]:
        agents = gauge("nodeagent_agents_connected", "Agents with an open tunnel")
        agents.add_metric([], len(self.tunnel.sessions))
        yield agents
        rtt = gauge("nodeagent_agent_rtt_seconds", "Round-trip time to each agent", ["node"])
        streams = gauge("nodeagent_agent_streams_open", "Open streams per agent", ["node"])
        for node, session in self.tunnel.sessions.items():
            if session.connection.rtt is not None:
                rtt.add_metric([node], session.connection.rtt)
            streams.add_metric([node], session.connection.info().streams_open)
        yield rtt
        yield streams
        disconnects = counter(
            "nodeagent_agent_disconnects",
            "Agent tunnels that ended, by why (drained, keepalive_timeout, "
            "connection_lost, shutting_down, replaced, unauthorized, protocol_error, "
            "closed, cancelled)", labels=["reason"])
        for reason, count in sorted(self.tunnel.disconnects.items()):
            disconnects.add_metric([reason], count)
        yield disconnects
        http = gauge("nodeagent_http_front", "HTTP front counters by listener",
                     ["listener", "counter"])
        for name, stats in self.http_stats.items():
            for field_name, value in stats.as_dict().items():
                http.add_metric([name, field_name], value)
        yield http

    def tunnels(self, node: str | None = None) -> dict[str, Any]:
        """`nodeagent debug tunnels` on a server: a row per node tunnel (or `node`'s),
        then nodes whose tunnel ended lately (state disconnected, why, since when)."""
        rows = []
        now = time.time()
        sessions = self.tunnel.sessions
        for name in ([node] if node is not None else sorted(sessions)):
            session = sessions.get(name)
            if session is None:
                continue
            info = session.connection.info()
            ended = self.tunnel.recent_ends.get(name)
            rows.append({
                "node": name, "peer": info.peer,
                "state": "draining" if info.draining else "open",
                "rtt_ms": round(info.rtt_seconds * 1000, 2) if info.rtt_seconds is not None
                else None,
                "streams_open": info.streams_open, "bytes_in": info.bytes_in,
                "bytes_out": info.bytes_out,
                "since_seconds": round(max(0.0, now - session.since), 1),
                # A node connected again (the live tunnel has not ended): why its
                # previous tunnel ended, replaced by this one included.
                "last_error": f"previous tunnel: {ended.label}: {ended.reason}"
                if ended is not None else None,
            })
        for name, ended in reversed(self.tunnel.recent_ends.items()):
            if name in sessions or (node is not None and name != node):
                continue
            rows.append({"node": name, "peer": ended.peer, "state": "disconnected",
                         "rtt_ms": None, "streams_open": 0, "bytes_in": None,
                         "bytes_out": None,
                         "since_seconds": round(max(0.0, now - ended.since), 1),
                         "last_error": f"{ended.label}: {ended.reason}"})
        return {"role": "server", "server_id": self.config.server_id,
                "node_filter": node, "connected": len(sessions),
                "disconnects": dict(self.tunnel.disconnects), "tunnels": rows}

    def streams(self, node: str | None = None) -> dict[str, Any]:
        """`nodeagent debug streams` on a server: every stream of every node's tunnel."""
        sessions = self.tunnel.sessions
        rows = []
        for name in ([node] if node is not None else sorted(sessions)):
            session = sessions.get(name)
            if session is not None:
                rows.extend(stream_rows(session.connection, self.stream_notes,
                                        peer={"node": name}))
        return {"role": "server", "server_id": self.config.server_id,
                "node_filter": node, "streams": rows}

    def status(self) -> dict[str, Any]:
        agents = []
        for node, session in sorted(self.tunnel.sessions.items()):
            info = session.connection.info()
            agents.append({
                "node": node, "peer": info.peer,
                "connected_seconds": round(time.time() - session.since, 1),
                "rtt_ms": round(info.rtt_seconds * 1000, 2) if info.rtt_seconds is not None
                else None,
                "streams_open": info.streams_open, "bytes_in": info.bytes_in,
                "bytes_out": info.bytes_out, "draining": info.draining,
            })
        return {
            "role": "server",
            "server_id": self.config.server_id,
            "replicas": self.routes.replicas,
            "version": __version__,
            "uptime_seconds": round(time.monotonic() - self.started, 1),
            "config_version": self.routes.version,
            "listeners": self.bound,
            "agents": agents,
            "streams_by_outcome": dict(self.outcomes),
            "handshake_failures": self.tunnel.handshake_failures,
            "handshake_refusals": dict(self.tunnel.refusals),
            "draining": self.tunnel.draining,
            "http": {name: stats.as_dict() for name, stats in self.http_stats.items()},
            "config_watch": self.config_watch.as_dict() if self.config_watch else None,
            "identity": self.identity.status() if self.identity else None,
            "bootstrap": {"open": self.tunnel.bootstrap_sessions,
                          "served": self.tunnel.bootstrap_served},
            "reloads": {name: r.status() for name, r in self.reloaders.items()},
            "connect": self.connect.status() if self.connect else None,
            "dnat": self.dnat.status(),
        }


def _bearer(peer: PeerInfo) -> str | None:
    for name, value in peer.headers:
        if name == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
    return None


def _address(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

