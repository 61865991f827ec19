"""Every kind of listener the server role runs, and the one list of them a server starts.

`server_listeners(server, ...)` turns a server's config into its listeners, in start
order: the tunnel (where agents dial in), each TCP mapping, each UDP mapping, the ports of
LoadBalancer Services (`loadbalancers`), each HTTP listener, the
Ingress listeners, the CONNECT front, the debug socket and the health listener. Each is a
`nodeagent.ops.listener.Listener`; `serve_server` starts, drains and stops them through
`Listeners` without knowing their kinds. The DNAT path has no socket of its own: its
streams arrive through the tunnel listener (openers.AgentStreams).
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from nodeagent.config import HostPort, TcpMapping, UdpMapping, redacted
from nodeagent.http import HttpFront, HttpStats
from nodeagent.http.limits import Limits
from nodeagent.http.tls import TlsConfig
from nodeagent.ops.debug import DebugServer
from nodeagent.ops.health import HealthServer
from nodeagent.ops.jsonhttp import QueryRoute
from nodeagent.ops.listener import Listener, socket_address
from nodeagent.server.server import Server
from nodeagent.server.tcpmappings import TcpMappingRelay, detached
from nodeagent.server.udpmappings import UdpMappingRelay
from tunnel.accept import serve
from tunnel.listeners import bind_udp, open_tcp_listeners
from tunnel.spliceloop import SpliceOwner
from tunnel.tcp import format_address
from tunnel.transports import Transport
from tunnel.urls import parse_endpoint


class TunnelListener(Listener):
    """Where agents dial in (TLS or WebSocket over TLS): each connection that completes
    its handshakes goes to `handler` (TunnelServer.handle_transport). On drain the
    listening sockets close, so new tunnels go to another replica, while the tunnels up
    carry on."""

    kind = "tunnel"

    def __init__(self, url: str, handler: Callable[[Transport], Awaitable[None]], *,
                 ssl_context: Callable[[], ssl.SSLContext] | None, reuse_port: bool) -> None:
        super().__init__("tunnel")
        self.url = url
        self._handler = handler
        self._ssl_context = ssl_context
        self._reuse_port = reuse_port
        self._stop_accepting = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[list[str]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(functools.partial(
                serve, parse_endpoint(self.url), self._handler, ssl_context=self._ssl_context,
                stop_accepting=self._stop_accepting, reuse_port=self._reuse_port))
            self.addresses = [str(b) for b in bound]
            task_status.started(self.addresses)

    def drain(self, *, close_idle: bool) -> None:
        self._stop_accepting.set()

    def details(self) -> dict[str, Any]:
        return {"url": self.url, "tls": self._ssl_context is not None,
                "accepting": not self._stop_accepting.is_set()}


class TcpMappingListener(Listener):
    """A TCP mapping's public port: every connection spliced into a stream to its node."""

    kind = "tcp"

    def __init__(self, name: str, mapping: TcpMapping, relay: TcpMappingRelay, *,
                 reuse_port: bool) -> None:
        super().__init__(name)
        self.mapping = mapping
        self._relay = relay
        self._reuse_port = reuse_port

    async def run(self, *, task_status: trio.TaskStatus[list[str]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        mapping = self.mapping
        listeners = await open_tcp_listeners(mapping.listen.port, host=mapping.listen.host,
                                             reuse_port=self._reuse_port)
        self.addresses = [socket_address(lst) for lst in listeners]
        # Connections carried by tunnel connections' splice loops, not by tasks here (one
        # accept loop per listening socket, no task per connection: tcpmappings.py):
        # stopping the mapping ends them all the same, those still opening too.
        owner = SpliceOwner()
        sockets = [detached(lst) for lst in listeners]
        try:
            async with trio.open_nursery() as nursery:
                take = functools.partial(self._relay.take, mapping, owner=owner,
                                         nursery=nursery)
                for sock in sockets:
                    nursery.start_soon(self._relay.accept_loop, self.name, sock, take)
                task_status.started(self.addresses)
        finally:
            owner.abort_all("tcp mapping stopped")
            for sock in sockets:
                sock.close()

    def details(self) -> dict[str, Any]:
        return {"node": self.mapping.node, "target": str(self.mapping.target),
                "proxy_protocol": self.mapping.proxy_protocol}


class UdpMappingListener(Listener):
    """A UDP mapping's public port: each client address a flow to its node's target."""

    kind = "udp"

    def __init__(self, name: str, mapping: UdpMapping, relay: UdpMappingRelay, *,
                 reuse_port: bool) -> None:
        super().__init__(name)
        self.mapping = mapping
        self._relay = relay
        self._reuse_port = reuse_port

    async def run(self, *, task_status: trio.TaskStatus[list[str]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        listen = self.mapping.listen
        sock = bind_udp(listen.host, listen.port, reuse_port=self._reuse_port)
        try:
            host, port = sock.getsockname()[:2]
            self.addresses = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
            task_status.started(self.addresses)
            await self._relay.serve(self.name, self.mapping, sock)
        finally:
            sock.close()

    def details(self) -> dict[str, Any]:
        return {"node": self.mapping.node, "target": str(self.mapping.target),
                "idle_timeout": self.mapping.idle_timeout}


class HttpFrontListener(Listener):
    """An HTTP (or HTTPS) front on one listen address: requests routed by Host and path
    into streams. On drain, keep-alive connections finish their current request."""

    kind = "http"

    def __init__(self, name: str, front: HttpFront, listen: HostPort, *,
                 reuse_port: bool) -> None:
        super().__init__(name)
        self.front = front
        self.listen = listen
        self._reuse_port = reuse_port

    async def run(self, *, task_status: trio.TaskStatus[list[str]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await open_tcp_listeners(self.listen.port, host=self.listen.host,
                                             reuse_port=self._reuse_port)
        self.addresses = [socket_address(lst) for lst in listeners]
        async with trio.open_nursery() as nursery:
            await nursery.start(self.front.serve, listeners)
            task_status.started(self.addresses)

    def drain(self, *, close_idle: bool) -> None:
        self.front.drain(close_idle=close_idle)

    def details(self) -> dict[str, Any]:
        return {"tls": self.front.tls is not None}


def _node_filter(query: Mapping[str, list[str]]) -> str | None:
    """`?node=NAME` of the debug routes (`nodeagent debug tunnels --node NAME`)."""
    values = query.get("node") or [""]
    return values[-1] or None


def server_listeners(server: Server, *, tunnel_context: Callable[[], ssl.SSLContext] | None,
                     reuse_port: bool, runs_connect_front: bool) -> list[Listener]:
    """A server's listeners, in the order they start. `reuse_port`: this process is one
    of several workers sharing the public ports; `runs_connect_front`: this process runs
    the CONNECT front (one worker only)."""
    config = server.config
    endpoint = parse_endpoint(config.tunnel.url)
    listeners: list[Listener] = [TunnelListener(
        config.tunnel.url, server.tunnel.handle_transport, ssl_context=tunnel_context,
        reuse_port=reuse_port).for_setting("tunnel", format_address((endpoint.host,
                                                                     endpoint.port)))]
    for index, mapping in enumerate(config.tcp):
        listeners.append(TcpMappingListener(
            f"tcp:{mapping.name or index}", mapping, server.tcp_mappings,
            reuse_port=reuse_port).for_setting(f"tcp[{index}].listen", mapping.listen))
    for index, udp in enumerate(config.udp):
        listeners.append(UdpMappingListener(
            f"udp:{udp.name or index}", udp, server.udp_mappings,
            reuse_port=reuse_port).for_setting(f"udp[{index}].listen", udp.listen))
    # LoadBalancer Services' ports: one listener whose sockets follow the routes.
    server.load_balancers.reuse_port = reuse_port
    listeners.append(server.load_balancers)
    wanted = config.http_limits
    limits = Limits(max_connections=wanted.max_connections,
                    max_connections_per_client=wanted.max_connections_per_client,
                    max_header_fields=wanted.max_header_fields,
                    min_body_rate=wanted.min_body_rate, body_grace=wanted.body_grace)
    tables = server.route_tables
    open_upstream = server.http_backends.open_http_backend
    for index, http in enumerate(config.http):
        name = f"http:{http.name or index}"
        front = HttpFront(table=functools.partial(tables.http_table, index),
                          open_upstream=open_upstream, limits=limits,
                          stats=server.http_stats.setdefault(name, HttpStats()),
                          describe_upstream=server.stream_notes.describe,
                          proxy=server.proxy_trust, name=name,
                          unhealthy=server.backend_health.unhealthy)
        listeners.append(HttpFrontListener(name, front, http.listen, reuse_port=reuse_port)
                         .for_setting(f"http[{index}].listen", http.listen))
    # The Ingress listeners: routes (and certificates) swap under them on every update.
    for name, listen, tls in (("ingress-http", config.ingress_http, None),
                              ("ingress-https", config.ingress_https,
                               TlsConfig(certs=tables.ingress_certs))):
        if listen is None:
            continue
        front = HttpFront(table=tables.current_ingress_table, open_upstream=open_upstream,
                          tls=tls, limits=limits,
                          stats=server.http_stats.setdefault(name, HttpStats()),
                          describe_upstream=server.stream_notes.describe,
                          holds=server.holds, proxy=server.proxy_trust, name=name,
                          unhealthy=server.backend_health.unhealthy)
        listeners.append(HttpFrontListener(name, front, listen, reuse_port=reuse_port)
                         .for_setting(name.replace("-", "_"), listen))
    # The CONNECT front (kube-apiserver's egress selector, Prometheus).
    if server.connect is not None and runs_connect_front:
        listeners.append(server.connect)
    listeners.append(DebugServer(str(config.debug_socket), {
        "/status": server.status,
        "/tunnels": QueryRoute(lambda query: server.tunnels(_node_filter(query))),
        "/streams": QueryRoute(lambda query: server.streams(_node_filter(query))),
        "/flows": QueryRoute(lambda query: server.udp_mappings.flows(_node_filter(query))),
        "/holds": server.holds.as_dict,
        "/loadbalancers": server.load_balancers.view,
        # The running routes (the controller's, in controller mode) over the file's,
        # secrets redacted.
        "/config": lambda: redacted({
            **server.config.model_dump(mode="json"),
            **server.routes.model_dump(mode="json")}),
    }, registry=server.metrics.registry).for_setting("debug_socket", config.debug_socket))
    if config.metrics_listen is not None:
        listeners.append(HealthServer(server.metrics.registry, server.not_ready,
                                      host=config.metrics_listen.host,
                                      port=config.metrics_listen.port)
                         .for_setting("metrics_listen", config.metrics_listen))
    return listeners
