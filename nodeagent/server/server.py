"""The server role's composition: one `Server` wires the pieces that each own one job, and
answers for the whole (readiness, route updates, status).

- `routetables.RouteTables`: the routes in force and the tables the HTTP fronts read;
- `agentauth.AgentAuthenticator`: who a dialing agent is, and revoking it;
- `tunnel.server.TunnelServer`: the agents' tunnels, registered by node name;
- `datapath.DataPath`: what a stream may reach and the DNS-safe dialing;
- `openers`: the streams agents open and the HTTP fronts' upstreams, counted by outcome;
- `tcpmappings.TcpMappingRelay`: public TCP ports spliced into streams;
- `udpmappings.UdpMappingRelay`: public UDP ports, each client address a flow;
- `loadbalancers.LoadBalancerPorts`: LoadBalancer Services' ports, opened and closed as
  routes change, balanced across their endpoints through those relays;
- `connectfront.ConnectFront` and `dnat.DnatPath`: the control plane's ways to nodes;
- `debugviews`: the debug socket's views and the live metrics.

Each piece gets what it needs passed in; none of them holds the Server. The listeners
that expose these (tunnel, fronts, mappings, CONNECT front, debug socket, health) are
listed by `listeners.server_listeners` and started together by `main.serve_server`.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from nodeagent import __version__
from nodeagent.config import RoutesConfig, ServerConfig
from nodeagent.configstream.client import WatchStatus
from nodeagent.http.holds import HeldRequests
from nodeagent.http.routetable import Backend
from nodeagent.http.stats import HttpStats
from nodeagent.ops.listener import Listeners
from nodeagent.ops.logs import get_logger
from nodeagent.ops.metrics import Metrics
from nodeagent.ops.streamviews import TO_NODE, StreamNotes, tracked_opener
from nodeagent.proxyprotocol.receive import ProxyTrust
from nodeagent.server.agentauth import AgentAuthenticator
from nodeagent.server.connectfront import ConnectFront
from nodeagent.server.datapath import DataPath
from nodeagent.server.debugviews import agent_rows, live_metrics, streams_view, tunnels_view
from nodeagent.server.dnat import DnatPath
from nodeagent.server.healthwatch import BackendHealth, HealthWatch
from nodeagent.server.heldconnections import HeldConnections
from nodeagent.server.loadbalancers import LoadBalancerPorts
from nodeagent.server.openers import AgentStreams, HttpBackends, StreamOutcomes
from nodeagent.server.readiness import ReadinessGate, nodes_routed_to
from nodeagent.server.refusals import PolicyRefusals
from nodeagent.server.routetables import RouteTables
from nodeagent.server.tcpmappings import TcpMappingRelay
from nodeagent.server.udpmappings import UdpMappingRelay
from nodeagent.trust.filewatch import FileReloader
from tunnel.endpoint import EndpointSettings, IncomingStream
from tunnel.server import HandshakeAdmission, TunnelServer

if TYPE_CHECKING:
    from nodeagent.trust.enrollment import IdentityKeeper  # controller mode: cryptography

log = get_logger("nodeagent.server")


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


class Server:
    """One server process: its pieces, wired."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.started = time.monotonic()
        self.metrics = Metrics("server")
        self.log = log.bind(server=config.server_id)
        self.route_tables = RouteTables(config.routes(), self.log)
        # Requests held for sleeping routes (scale to zero), shared by the Ingress fronts.
        self.holds = HeldRequests()
        routes = self.route_tables.current
        self.metrics.config_version.set(self.routes.version)
        self.config_watch: WatchStatus | None = None
        # Controller mode: this replica's certificate for the config stream (status only).
        self.identity: IdentityKeeper | None = None
        # Streams refused by policy, by why, and handshakes refused before
        # authentication (handshake_overloaded, handshake_shutting_down).
        self.refusals = refusals = PolicyRefusals(self.metrics.registry, self.log)
        self.auth = AgentAuthenticator(
            tokens=config.tokens, controller_mode=config.controller is not None,
            client_certificates=config.tls is not None and config.tls.client_ca_file
            is not None, routes=routes, refusals=self.refusals,
            on_bad_input=self.metrics.bad_input.labels("auth").inc, log=self.log)
        settings = EndpointSettings(ping_interval=config.keepalive.interval,
                                    ping_timeout=config.keepalive.timeout,
                                    on_rtt=self.metrics.tunnel_rtt.observe)
        # Controller mode: agents without a certificate yet may open a bootstrap
        # connection, whose streams reach the controller's signer and nothing else.
        self.tunnel = TunnelServer(
            authenticate=self.auth.authenticate, server_id=config.server_id,
            settings=settings, stream_handler=self._handle_agent_stream,
            stream_taker=self._take_agent_stream,
            bootstrap_handler=self._handle_bootstrap_stream if config.controller else None,
            admission=HandshakeAdmission(config.tunnel.handshake_rate,
                                         config.tunnel.handshake_burst),
            replicas=self.routes.replicas,
            on_refusal=lambda reason: refusals.count(f"handshake_{reason}"),
            bandwidth=lambda node: self.routes.bandwidth_of(node), log=self.log)
        # When each stream opened and for what (debug streams); every stream this server
        # opens to a node goes through open_stream, which also times its setup.
        self.stream_notes = StreamNotes()
        self.open_stream = tracked_opener(self.tunnel.open_stream, self.stream_notes,
                                          self.metrics.stream_setup.labels(TO_NODE).observe)
        self.outcomes = StreamOutcomes(self.metrics.streams)
        # Agents reach the controller's config stream through their tunnel: always egress.
        self.datapath = DataPath(
            routes=routes, open_stream=self.open_stream, refusals=self.refusals,
            dial_timeout=config.dial_timeout,
            controller=_host_port(config.controller) if config.controller else None,
            live_connection=self.tunnel.live_connection)
        # Cloud nodes' caught dials to other nodes' addresses (control_plane_sources).
        self.dnat = DnatPath(open_stream=self.open_stream, dial_timeout=config.dial_timeout,
                             registry=self.metrics.registry, log=self.log)
        self.agent_streams = AgentStreams(
            datapath=self.datapath, dnat=self.dnat, routes=routes,
            notes=self.stream_notes, outcomes=self.outcomes, refusals=self.refusals,
            on_flow_done=self.metrics.count_flow)
        self.http_backends = HttpBackends(
            datapath=self.datapath, notes=self.stream_notes, outcomes=self.outcomes,
            direct_backends=config.controller is not None)
        # Active health checks: agents check their backends and report here.
        self.backend_health = BackendHealth()
        self.health_watch = HealthWatch(open_stream=self.tunnel.open_stream,
                                        wait_for_node=self.tunnel.wait_for_node,
                                        health=self.backend_health, log=self.log)
        self.health_watch.update(self.routes)
        # PROXY v2 from the load balancers in front of the public listeners.
        self.proxy_trust = ProxyTrust(config.proxy_protocol_from)
        self.tcp_mappings = TcpMappingRelay(
            datapath=self.datapath, notes=self.stream_notes, outcomes=self.outcomes,
            stream_bytes=self.metrics.stream_bytes, log=self.log, proxy=self.proxy_trust,
            unhealthy=self.backend_health.unhealthy,
            observe_setup=self.metrics.stream_setup.labels(TO_NODE).observe)
        # TCP connections for a Service that sleeps (LoadBalancer ports): held with the
        # HTTP fronts' requests while it wakes (heldconnections.py).
        self.held_connections = HeldConnections(self.holds, self.tcp_mappings, self.log)
        self.udp_mappings = UdpMappingRelay(
            datapath=self.datapath, notes=self.stream_notes, metrics=self.metrics,
            log=self.log)
        self.load_balancers = LoadBalancerPorts(
            host=config.load_balancer_host, tcp=self.tcp_mappings, udp=self.udp_mappings,
            has_tunnel=lambda node: node in self.tunnel.sessions, metrics=self.metrics,
            log=self.log, unhealthy=lambda mapping: self.backend_health.unhealthy(
                Backend(mapping.node, mapping.target.host, mapping.target.port)),
            held=self.held_connections)
        self.load_balancers.update(routes().load_balancers)
        # Its listeners (listeners.server_listeners), set by serve_server, for status.
        self.listeners = Listeners()
        self.http_stats: dict[str, HttpStats] = {}  # listener name -> its front's counters
        # Credentials reloaded from their files (tunnel TLS, tokens): name -> reloader.
        self.reloaders: dict[str, FileReloader[Any]] = {}
        # SIGHUP's last outcome (reload.ReloadOutcome.as_dict(); standalone only).
        self.last_reload: dict[str, Any] | None = None
        self.metrics.add_live(functools.partial(live_metrics, self.tunnel, self.http_stats,
                                                self.holds, self.proxy_trust.stats,
                                                self.backend_health))
        # The CONNECT front (kube-apiserver's egress selector, Prometheus), if configured.
        self.connect = ConnectFront(
            config.connect, routes=routes, open_stream=self.open_stream,
            dial_timeout=config.dial_timeout, registry=self.metrics.registry, log=self.log,
            server_tls=(config.tls.cert_file, config.tls.key_file) if config.tls else None,
        ) if config.connect.enabled else None
        # /readyz: replaced by serve_server when the listeners are up (its grace from then).
        self.ready_gate = ReadinessGate(started=time.monotonic())

    @property
    def routes(self) -> RoutesConfig:
        """The routes in force."""
        return self.route_tables.routes

    def _take_agent_stream(self, node: str, incoming: IncomingStream) -> bool:
        return self.agent_streams.take_agent_stream(node, incoming)

    async def _handle_agent_stream(self, node: str, incoming: IncomingStream) -> None:
        await self.agent_streams.handle_agent_stream(node, incoming)

    async def _handle_bootstrap_stream(self, node: str, incoming: IncomingStream) -> None:
        await self.agent_streams.handle_bootstrap_stream(node, incoming)

    # ---------------------------------------------------------------- config

    def apply_routes(self, routes: RoutesConfig) -> None:
        """Switch to new routes at once. HTTP and Ingress routes, certificates, egress and
        node CIDRs change in place: requests in flight keep the route they matched, open
        streams keep going. Listeners are fixed for the process's life (the controller
        never changes them): a change of TCP mappings or HTTP listen addresses raises
        ConfigError and nothing changes."""
        started = time.monotonic()
        try:
            certificates = self.route_tables.replace(routes)
        except BaseException:
            self.metrics.config_apply.labels("failed").observe(time.monotonic() - started)
            raise
        self.tunnel.replicas = routes.replicas  # announced from the next handshake on
        self.health_watch.update(routes)
        self.tunnel.reshape()  # nodes' bandwidth (limits.md)
        self.load_balancers.update(routes.load_balancers)
        self.holds.routes_changed()  # held requests look again: their route may be awake
        self.metrics.config_version.set(routes.version)
        self.log.info("routes applied", version=routes.version,
                      ingress_rules=len(routes.ingress.rules), certificates=certificates)
        self.metrics.config_apply.labels("ok").observe(time.monotonic() - started)

    async def reload_tokens(self, tokens: list[tuple[str, bytes]]) -> list[str]:
        """New tokens from their files; the tunnels of nodes whose token is gone close."""
        return await self.auth.reload_tokens(tokens, self.tunnel.sessions)

    async def close_revoked(self) -> list[str]:
        """Close the tunnels of nodes the current routes no longer admit."""
        return await self.auth.close_revoked(self.tunnel.sessions)

    # ---------------------------------------------------------------- readiness

    def not_ready(self) -> str | None:
        """None when this replica may take public traffic, else why not (readiness.py)."""
        gate = self.ready_gate
        was_ready = gate.ready
        reason = gate.check(
            time.monotonic(), draining=self.tunnel.draining,
            have_routes=self.config.controller is None or self.routes.version > 0,
            expected=[n for n in nodes_routed_to(self.routes) if self.auth.may_register(n)],
            held=self.tunnel.sessions)
        if gate.ready and not was_ready:
            self.log.info("ready for public traffic", because=gate.became,
                          agents=len(self.tunnel.sessions),
                          missing=",".join(gate.missing[:20]) or "none")
        return reason

    # ---------------------------------------------------------------- status

    def tunnels(self, node: str | None = None) -> dict[str, Any]:
        return tunnels_view(self.tunnel, self.config.server_id, node)

    def streams(self, node: str | None = None) -> dict[str, Any]:
        return streams_view(self.tunnel, self.stream_notes, self.config.server_id, node)

    def status(self) -> dict[str, Any]:
        return {
            "role": "server",
            "server_id": self.config.server_id,
            "replicas": self.routes.replicas,
            "version": __version__,
            "uptime_seconds": round(time.monotonic() - self.started, 1),
            "config_version": self.routes.version,
            "listeners": self.listeners.addresses(),
            "listener_details": self.listeners.describe(),
            "agents": agent_rows(self.tunnel),
            "streams_by_outcome": dict(self.outcomes.counts),
            "handshake_failures": self.tunnel.handshake_failures,
            "handshake_refusals": dict(self.tunnel.refusals),
            "draining": self.tunnel.draining,
            "http": {name: stats.as_dict() for name, stats in self.http_stats.items()},
            "config_watch": self.config_watch.as_dict() if self.config_watch else None,
            "identity": self.identity.status() if self.identity else None,
            "bootstrap": {"open": self.tunnel.bootstrap_sessions,
                          "served": self.tunnel.bootstrap_served},
            "reloads": {name: r.status() for name, r in self.reloaders.items()},
            "last_reload": self.last_reload,
            "connect": self.connect.status() if self.connect else None,
            "dnat": self.dnat.status(),
            "held_requests": self.holds.as_dict(),
            "backend_health": self.backend_health.as_list(),
            "proxy_protocol": {"from": [str(n) for n in self.proxy_trust.networks],
                               "headers": dict(self.proxy_trust.stats.results)},
            # Routes with rate limits or authentication: keys, buckets, refusals by why.
            "route_gates": self.route_tables.gates.as_dict(),
        }
