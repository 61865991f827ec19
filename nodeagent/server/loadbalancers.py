"""The public ports of LoadBalancer Services (`RoutesConfig.load_balancers`): opened,
changed and closed while the server runs, as the routes change.

Each Service port is a TCP or UDP mapping balanced across the Service's endpoints on
their nodes: one `TcpMapping`/`UdpMapping` per backend (node, pod address, target port),
carried by the same relays as the mappings of a file (`tcpmappings`, `udpmappings`).
A new connection (TCP) or client flow (UDP) takes the next backend in turn whose node's
agent holds a tunnel to this server (all of them when none does: the failure is then
counted by the relay as for any mapping). With no backends a port stays open and
refuses: TCP connections are closed at once, UDP datagrams dropped (`no_backends`).

Scale to zero: a port with `wake` (its Service's `nodeagent.io/idle-after`) hands every
TCP connection to `HeldConnections` (heldconnections.py): held while the Service has
no backends and woken like an HTTP request, counted as the Service's activity while
open. Its UDP datagrams are dropped while it has no backends, each new client flow
asking for the wake (`HeldRequests.poke`) and counted as a request.

A new set of backends applies at once to the next connection or flow; those running keep
theirs. A port that cannot bind (another process holds it) is retried every
`BIND_RETRY` seconds, shown as `failed` with the reason in `nodeagent debug
loadbalancers`, counted (`nodeagent_loadbalancer_refusals_total{reason="bind_failed"}`)
and logged once per minute per port. Which Service gets a port contested by several is
the controller's decision (the oldest; controller/loadbalancers.py): routes never carry
two claims on one port.
"""

from __future__ import annotations

import functools
import itertools
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from prometheus_client import Counter as MetricCounter
from prometheus_client.metrics_core import Metric

from nodeagent.config import (
    HostPort,
    ListenAddress,
    LoadBalancerPort,
    LoadBalancerService,
    TcpMapping,
    UdpMapping,
)
from nodeagent.http.dispatch import Refusal
from nodeagent.http.routetable import WakeSpec
from nodeagent.ops.listener import Listener, bind_advice
from nodeagent.ops.logs import StructuredLogger
from nodeagent.ops.metrics import Metrics, gauge
from nodeagent.server.heldconnections import HeldConnections, asleep
from nodeagent.server.tcpmappings import TcpMappingRelay, detached
from nodeagent.server.udpmappings import UdpMappingRelay
from tunnel.listeners import bind_udp, open_tcp_listeners
from tunnel.log import RateLimitedLog
from tunnel.spliceloop import SpliceOwner
from tunnel.stream import TunnelStream

BIND_RETRY = 5.0  # seconds between attempts to bind a port another process holds


@dataclass(eq=False)
class BalancedPort:
    """One Service port: its backends as mappings, its state and its counters."""

    service: str  # "namespace/name"
    config: LoadBalancerPort
    mappings: tuple[TcpMapping | UdpMapping, ...] = ()
    state: str = "starting"  # listening, failed (cannot bind), starting
    error: str = ""
    addresses: list[str] = field(default_factory=list)
    accepted: int = 0  # TCP connections / UDP flows handed to a backend
    refused: int = 0  # with no backend to take them
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    closed: trio.Event = field(default_factory=trio.Event)  # its socket is closed
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def key(self) -> tuple[str, int]:
        return self.config.protocol, self.config.port

    @property
    def name(self) -> str:
        return f"{self.service}:{self.config.protocol}/{self.config.port}"

    def set_backends(self, config: LoadBalancerPort, listen_host: str) -> None:
        self.config = config
        listen = ListenAddress(host=listen_host, port=config.port)
        if config.protocol == "tcp":
            self.mappings = tuple(TcpMapping(name=self.name, listen=listen, node=b.node or "",
                                             target=b.target,
                                             proxy_protocol=config.proxy_protocol,
                                             health_check=config.health_check)
                                  for b in config.backends)
        else:
            self.mappings = tuple(UdpMapping(name=self.name, listen=listen,
                                             node=b.node or "", target=b.target,
                                             idle_timeout=config.idle_timeout)
                                  for b in config.backends)

    @property
    def wake(self) -> WakeSpec | None:
        wake = self.config.wake
        return None if wake is None else WakeSpec(wake.service, wake.timeout,
                                                  wake.max_pending, wake.failure)

    def pick(self, has_tunnel: Callable[[str], bool],
             unhealthy: Callable[[TcpMapping | UdpMapping], bool] | None = None
             ) -> TcpMapping | UdpMapping | None:
        """The next backend in turn whose node holds a tunnel here (any, if none does),
        leaving out those an active health check found unhealthy while another is left."""
        mappings = self.mappings
        if not mappings:
            self.refused += 1
            return None
        up = [m for m in mappings if has_tunnel(m.node)] or list(mappings)
        if unhealthy is not None:
            up = [m for m in up if not unhealthy(m)] or up
        self.accepted += 1
        return up[next(self._turn) % len(up)]

    def row(self) -> dict[str, Any]:
        return {"service": self.service, "protocol": self.config.protocol,
                "port": self.config.port, "state": self.state, "error": self.error,
                "addresses": list(self.addresses), "accepted": self.accepted,
                "refused": self.refused,
                "backends": [f"{m.node}/{m.target}" for m in self.mappings]}


class LoadBalancerPorts(Listener):
    """Every LoadBalancer Service port of this server, as one listener whose sockets come
    and go with the routes (`update`)."""

    kind = "loadbalancer"

    def __init__(self, *, host: str, tcp: TcpMappingRelay, udp: UdpMappingRelay,
                 has_tunnel: Callable[[str], bool], metrics: Metrics,
                 log: StructuredLogger,
                 unhealthy: Callable[[TcpMapping | UdpMapping], bool] | None = None,
                 held: HeldConnections | None = None) -> None:
        super().__init__("loadbalancers")
        self._held = held  # scale to zero: connections for a sleeping Service
        self.host = host
        self._tcp = tcp
        self._udp = udp
        self._has_tunnel = has_tunnel
        self._unhealthy = unhealthy  # active health checks' verdicts (healthwatch.py)
        # Set by listeners.server_listeners: one of several worker processes.
        self.reuse_port = False
        self.log = log
        self._failures = RateLimitedLog(log, period=60.0)
        self.ports: dict[tuple[str, int], BalancedPort] = {}
        self._wanted: tuple[LoadBalancerService, ...] = ()
        self._nursery: trio.Nursery | None = None
        self.refusals: MetricCounter = MetricCounter(
            "nodeagent_loadbalancer_refusals_total",
            "Connections (TCP) and flows (UDP) of LoadBalancer Service ports refused, by "
            "reason (no_backends), and failed attempts to bind a port (bind_failed)",
            ["reason"], registry=metrics.registry)
        metrics.add_live(self._live_metrics)

    def update(self, services: tuple[LoadBalancerService, ...]) -> None:
        """Open, change and close ports to match `services` (at once if running, else
        when `run` starts)."""
        self._wanted = services
        if self._nursery is not None:
            self._reconcile(self._nursery)

    def _reconcile(self, nursery: trio.Nursery) -> None:
        wanted = {(p.protocol, p.port): (s.name, p) for s in self._wanted for p in s.ports}
        previous: dict[tuple[str, int], BalancedPort] = {}
        for key, port in list(self.ports.items()):
            if key not in wanted or wanted[key][0] != port.service:
                port.scope.cancel()  # closes its socket: the port is gone or changed hands
                previous[key] = self.ports.pop(key)
                self.log.info("load balancer port closed", service=port.service,
                              protocol=key[0], port=key[1])
        for key, (service, config) in wanted.items():
            known = self.ports.get(key)
            if known is None:
                known = self.ports[key] = BalancedPort(service, config)
                known.set_backends(config, self.host)
                nursery.start_soon(self._serve, known, previous.get(key))
            else:
                known.set_backends(config, self.host)

    async def run(self, *, task_status: trio.TaskStatus[list[str]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._reconcile(nursery)
                task_status.started([])
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self.ports.clear()

    async def _serve(self, port: BalancedPort, previous: BalancedPort | None) -> None:
        """Serve `port` until cancelled; a port taken over from `previous` (another
        Service's) binds once that one's socket is closed."""
        try:
            with port.scope:
                if previous is not None:
                    await previous.closed.wait()
                while True:
                    try:
                        if port.config.protocol == "tcp":
                            await self._serve_tcp(port)
                        else:
                            await self._serve_udp(port)
                    except OSError as exc:
                        self._bind_failed(port, exc)
                    await trio.sleep(BIND_RETRY)
        finally:
            port.closed.set()

    def _bind_failed(self, port: BalancedPort, exc: OSError) -> None:
        address = f"{self.host}:{port.config.port}"
        port.state, port.error = "failed", bind_advice(exc, address)
        port.addresses = []
        self.refusals.labels("bind_failed").inc()
        self._failures.warning(port.name, "load balancer port cannot listen",
                               service=port.service, protocol=port.config.protocol,
                               port=port.config.port, error=port.error)

    async def _serve_tcp(self, port: BalancedPort) -> None:
        listeners = await open_tcp_listeners(port.config.port, host=self.host,
                                             reuse_port=self.reuse_port)
        port.addresses = [_address(lst.socket.getsockname()) for lst in listeners]
        port.state, port.error = "listening", ""
        self.log.info("load balancer port open", service=port.service, protocol="tcp",
                      port=port.config.port, backends=len(port.mappings))
        # No task per connection (tcpmappings.accept_loop); the port's connections,
        # carried by tunnel connections' splice loops, end with it all the same.
        owner = SpliceOwner()
        sockets = [detached(lst) for lst in listeners]
        try:
            async with trio.open_nursery() as nursery:
                take = functools.partial(self._take, port, owner, nursery)
                for sock in sockets:
                    nursery.start_soon(self._tcp.accept_loop, port.name, sock, take)
        finally:
            owner.abort_all("load balancer port closed")
            for sock in sockets:
                sock.close()

    def _take(self, port: BalancedPort, owner: SpliceOwner, nursery: trio.Nursery,
              sock: socket.socket, address: tuple[str, int]) -> TunnelStream | None:
        """A connection: its backend chosen and its OPEN sent, without a task; a port
        that wakes its Service holds the connection in a task (`_connection`)."""
        if port.wake is not None and self._held is not None:
            nursery.start_soon(self._connection, port,
                               trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
            return None
        mapping = port.pick(self._has_tunnel, self._unhealthy)
        if not isinstance(mapping, TcpMapping):
            self._no_backends(port)
            sock.close()
            return None
        return self._tcp.take(mapping, sock, address, owner=owner, nursery=nursery)

    def _no_backends(self, port: BalancedPort) -> None:
        self.refusals.labels("no_backends").inc()
        self._failures.warning(f"{port.name}:no_backends",
                               "load balancer connection refused: no ready endpoints",
                               service=port.service, port=port.config.port)

    async def _connection(self, port: BalancedPort, client: trio.SocketStream) -> None:
        if port.wake is not None and self._held is not None:
            await self._held.serve(port.name, port.wake, functools.partial(
                self._pick_awake, port), client)
            return
        mapping = port.pick(self._has_tunnel, self._unhealthy)
        if not isinstance(mapping, TcpMapping):
            self._no_backends(port)
            await client.aclose()
            return
        await self._tcp.serve(mapping, client)

    def _pick_awake(self, port: BalancedPort) -> TcpMapping | Refusal:
        """A held connection's target now: a backend, or (none) the Service's sleep (a
        port's config, and so its `wake`, is read afresh at every route change)."""
        wake = port.wake
        if port.mappings:
            mapping = port.pick(self._has_tunnel, self._unhealthy)
            assert isinstance(mapping, TcpMapping)
            return mapping
        if wake is None:  # no longer sleeps, and no endpoints: ends as `gone`
            return Refusal(404, f"{port.name}: no ready endpoints", route=port.name)
        return asleep(port.name, wake)

    async def _serve_udp(self, port: BalancedPort) -> None:
        sock = bind_udp(self.host, port.config.port, reuse_port=self.reuse_port)
        try:
            port.addresses = [_address(sock.getsockname())]
            port.state, port.error = "listening", ""
            self.log.info("load balancer port open", service=port.service, protocol="udp",
                          port=port.config.port, backends=len(port.mappings))
            # The mapping's own settings (caps, idle timeout) for the socket; each flow's
            # node and target come from `pick`.
            where = ListenAddress(host=self.host, port=port.config.port)
            base = UdpMapping(name=port.name, listen=where, node="",
                              target=HostPort(host=self.host, port=port.config.port),
                              idle_timeout=port.config.idle_timeout)

            def pick(client: tuple[Any, ...]) -> UdpMapping | None:
                mapping = port.pick(self._has_tunnel)
                wake = port.wake
                if wake is not None and self._held is not None:
                    holds = self._held.holds
                    if not isinstance(mapping, UdpMapping):
                        holds.poke(wake)  # dropped, but the wake is asked
                    else:
                        holds.begin(wake)  # a new flow counts as a request
                        holds.end(wake)
                if not isinstance(mapping, UdpMapping):
                    self.refusals.labels("no_backends").inc()
                    return None
                return mapping

            await self._udp.serve(port.name, base, sock, pick=pick)
        finally:
            sock.close()

    # ---------------------------------------------------------------- views

    def view(self) -> dict[str, Any]:
        """`nodeagent debug loadbalancers`: every Service port, its state and backends."""
        return {"role": "server", "host": self.host,
                "ports": [self.ports[k].row() for k in sorted(self.ports)]}

    def details(self) -> dict[str, Any]:
        return {"ports": len(self.ports),
                "failed": sum(1 for p in self.ports.values() if p.state == "failed")}

    def _live_metrics(self) -> list[Metric]:
        ports = gauge("nodeagent_loadbalancer_ports",
                      "LoadBalancer Service ports by protocol and state (listening, failed, "
                      "starting)", labels=["protocol", "state"])
        counts: dict[tuple[str, str], int] = {}
        for port in self.ports.values():
            key = (port.config.protocol, port.state)
            counts[key] = counts.get(key, 0) + 1
        for (protocol, state), count in sorted(counts.items()):
            ports.add_metric([protocol, state], count)
        return [ports]


def _address(sockname: tuple[Any, ...]) -> str:
    host, port = sockname[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
