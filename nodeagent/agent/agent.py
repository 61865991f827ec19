"""The agent role: a tunnel to each server replica, streams served by dialing node-local targets.

The agent dials out (no inbound port on the node), keeps the tunnel alive through
`tunnel.client.TunnelClient`, and for every stream the server opens checks the target
against its NodeConfig allow list, dials it (its own sockets carry SO_MARK so its netfilter
rules never intercept them) and splices the two. Its debug socket shows what it is doing.
"""

from __future__ import annotations

import functools
import logging
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client.metrics_core import Metric

from netfilter.model import NetfilterError
from nodeagent import __version__
from nodeagent.agent.healthchecks import HealthChecks, serve_health_stream
from nodeagent.config import (
    CONTROL_PLANE_PURPOSE,
    PURPOSE_KEY,
    AgentConfig,
    InterceptConfig,
    NodeConfig,
)
from nodeagent.config.health import HEALTH_PURPOSE
from nodeagent.config.routes import WAKE_KEY
from nodeagent.configstream.client import WatchStatus
from nodeagent.ops.logs import get_logger
from nodeagent.ops.metrics import Children, Metrics, counter, gauge
from nodeagent.ops.streamviews import (
    FROM_NODE,
    LiveStreams,
    StreamNotes,
    opener_from_metadata,
    stream_rows,
    tracked_opener,
)
from tunnel import protocol as p
from tunnel.backoff import ReconnectPolicy
from tunnel.client import TunnelClient
from tunnel.endpoint import EndpointSettings, IncomingStream
from tunnel.errors import StreamFailed
from tunnel.log import RateLimitedLog
from tunnel.relay import relay_incoming, relay_incoming_now
from tunnel.splice import SpliceResult
from tunnel.tcp import connect_tcp
from tunnel.udp import FlowCounters, FlowPoller, connect_udp, flow_idle_timeout
from tunnel.urls import parse_endpoint

if TYPE_CHECKING:
    # Loaded on use: interception (netfilter's backends, dnslib) when a config turns it
    # on, enrollment (cryptography) in controller mode only.
    from nodeagent.agent.intercept.listener import Interceptor
    from nodeagent.trust.enrollment import IdentityKeeper

log = get_logger("nodeagent.agent")

# A stream to a backend of a Service that scales to zero (the server sets WAKE_KEY) whose
# target this node's config does not allow yet waits this long for a config that does,
# then is refused as any other. A woken workload's endpoints reach the servers' routes
# and this node's allow list on two streams, the allow list often a few to a few hundred
# milliseconds later: refused, the server's held request would dial again and again.
# Waiting never dials what the config in force does not allow; at most
# CONFIG_WAITERS streams wait at once (more are refused at once: a server cannot make an
# agent hold many).
CONFIG_WAIT = 2.0
CONFIG_WAITERS = 256
# Allow-list answers remembered per tcp target (see Agent._allows_tcp), at most this many
# (then forgotten all at once: a server asking for many targets costs bounded memory).
ALLOWED_CACHE = 4096



class Agent:
    def __init__(self, config: AgentConfig, *, ssl_context: ssl.SSLContext | None) -> None:
        self.config = config
        self.node_config: NodeConfig = config.node_config()
        self.started = time.monotonic()
        self.metrics = Metrics("agent")
        self.metrics.config_version.set(self.node_config.version)
        self.outcomes: Counter[str] = Counter()
        # Per stream: the counters' children looked up once, not by labels() each time.
        self._streams_counted = Children(self.metrics.streams)
        self._bytes_in = self.metrics.stream_bytes.labels("in")
        self._bytes_out = self.metrics.stream_bytes.labels("out")
        # _allows_tcp's answers, for the NodeConfig they came from.
        self._allowed_by: NodeConfig | None = None
        self._allowed: dict[tuple[str, int], bool] = {}
        self.config_watch: WatchStatus | None = None
        # Controller mode: the node certificate the controller signs (status only here).
        self.identity: IdentityKeeper | None = None
        self.log = log.bind(node=config.node)
        self._forbidden_log = RateLimitedLog(self.log, period=60.0)
        # Streams the server's CONNECT front opened (kube-apiserver, Prometheus), live.
        self.control_plane = LiveStreams()
        # Active health checks servers asked for (healthchecks.py), one set per server.
        self.health = HealthChecks()
        # Set when a drain begins: the agent's own long-lived streams (the config watch)
        # end then, so the drain waits only for the traffic it carries.
        self.draining = trio.Event()
        token = config.read_token()
        endpoint = parse_endpoint(config.server)

        def hello() -> p.Hello:
            identity = {"node": config.node, "agent_version": __version__}
            if token is not None:
                identity["token"] = token
            return p.Hello(identity=identity)

        settings = EndpointSettings(ping_interval=config.keepalive.interval,
                                    ping_timeout=config.keepalive.timeout,
                                    on_rtt=self.metrics.tunnel_rtt.observe)
        self.client = TunnelClient(
            endpoint, hello=hello, handler=self.handle_stream, take_stream=self.take_stream,
            ssl_context=ssl_context,
            server_hostname=config.tls.server_name, settings=settings,
            socket_mark=config.socket_mark,
            direct=[parse_endpoint(url) for url in config.direct_servers],
            headers=lambda: [("authorization", f"Bearer {token}")] if token else [],
            reconnect=ReconnectPolicy(
                config.reconnect.initial, config.reconnect.maximum,
                unreachable_maximum=config.reconnect.unreachable_maximum,
                retry_after_jitter=config.reconnect.retry_after_jitter),
            log=self.log.bind(server=config.server), proxy=config.proxy_rules())
        self.client.set_replicas(self.node_config.server_replicas)
        # When each stream opened and for what (debug streams); streams this agent opens
        # go through open_stream, which also times their setup.
        self.stream_notes = StreamNotes()
        self.open_stream = tracked_opener(self.client.open_stream, self.stream_notes,
                                          self.metrics.stream_setup.labels(FROM_NODE).observe)
        self.metrics.add_live(self._live_metrics)
        self.interceptor: Interceptor | None = None
        if self.node_config.intercept is not None:
            self.interceptor = self._interceptor(self.node_config.intercept)
        self._nursery: trio.Nursery | None = None  # run()'s, while it runs
        # Set (and replaced) when a NodeConfig is applied: streams waiting for their
        # target to be allowed look again (CONFIG_WAIT).
        self._config_applied = trio.Event()
        self._config_waiters = 0
        # The flows the server opens (UDP mappings), served by one task: an idle flow
        # costs its socket and a small record, no task.
        self.flow_poller = FlowPoller()

    def _interceptor(self, intercept: InterceptConfig) -> Interceptor:
        from nodeagent.agent.intercept.listener import Interceptor

        def datagram_drop(reason: str, count: int) -> None:
            self.metrics.datagram_drops.labels(reason).inc(count)

        # Per datagram: the counters' children looked up once, not by labels() each time.
        carried = {direction: (self.metrics.datagrams.labels(direction),
                               self.metrics.datagram_bytes.labels(direction))
                   for direction in ("in", "out")}

        def datagram(direction: str, size: int) -> None:
            datagrams, size_total = carried[direction]
            datagrams.inc()
            size_total.inc(size)

        interceptor = Interceptor(intercept, skip_mark=self.config.socket_mark,
                                  open_tunnel=self.open_stream, open_flow=self.open_stream,
                                  on_datagram_drop=datagram_drop, on_datagram=datagram,
                                  dial_timeout=self.config.dial_timeout, node=self.config.node,
                                  tunnel_now=self.client.connection_for_open,
                                  notes=self.stream_notes,
                                  observe_setup=self.metrics.stream_setup.labels(
                                      FROM_NODE).observe)
        interceptor.keep_rules_on_exit = self.config.keep_rules_on_exit
        return interceptor

    async def apply_node_config(self, node_config: NodeConfig) -> None:
        """Switch to a new NodeConfig atomically: interception rules first (if they fail,
        nothing changes and the error is raised), then the allow list. Streams and
        proxied connections already running keep going."""
        started = time.monotonic()
        try:
            await self._apply_node_config(node_config)
        except BaseException:
            self.metrics.config_apply.labels("failed").observe(time.monotonic() - started)
            raise
        self.metrics.config_apply.labels("ok").observe(time.monotonic() - started)

    async def _apply_node_config(self, node_config: NodeConfig) -> None:
        if node_config.intercept != self.node_config.intercept:
            if self.interceptor is None:
                if node_config.intercept is not None:
                    # Controller mode starts without config: the first intercept turns
                    # interception on (the proxy listener, then the rules).
                    if self._nursery is None:
                        raise NetfilterError("interception was off at start; restart the "
                                             "agent to turn it on")
                    interceptor = self._interceptor(node_config.intercept)
                    await self._nursery.start(interceptor.run)
                    self.interceptor = interceptor
            elif node_config.intercept is None:
                await self.interceptor.remove()
            else:
                await self.interceptor.apply(node_config.intercept)
        self.node_config = node_config
        applied, self._config_applied = self._config_applied, trio.Event()
        applied.set()
        self.client.set_replicas(node_config.server_replicas)
        self.metrics.config_version.set(node_config.version)
        self.log.info("config applied", version=node_config.version,
                      allow_rules=len(node_config.allow),
                      intercept_rules=len(node_config.intercept.rules)
                      if node_config.intercept else 0)

    def take_stream(self, incoming: IncomingStream) -> bool:
        """The common case without a task (the tunnel connection's reader calls this for
        every stream the server opens, before it makes a handler task): a plain tcp
        stream to an IP literal is checked against the allow list here, at once, and
        refused, or dialed and spliced by the connection's splice loop. Anything that
        may wait before its dial (a name to resolve, a wake stream waiting for a config
        that allows it) or is not a plain stream (udp, health, control plane) is left to
        `handle_stream`'s task (False)."""
        target = incoming.target
        metadata = incoming.metadata
        if target.protocol != "tcp" or PURPOSE_KEY in metadata:
            return False
        origin = metadata.get("origin", "")
        stream_id = incoming.stream.stream_id
        # Deny by default: nothing is dialed before the config in force allows it.
        if not self._allows_tcp(target.host, target.port):
            if metadata.get(WAKE_KEY) == "1":
                return False  # may wait for a newer config (_allowed_soon)
            failure = StreamFailed(p.StreamReason.FORBIDDEN,
                                   f"{target} is not allowed on node {self.config.node}")
            incoming.refuse_now(failure.reason, failure.message)
            self._refused(failure, stream_id, target, origin, control=False)
            return True
        if not relay_incoming_now(
                incoming, target.host, target.port, timeout=self.config.dial_timeout,
                mark=self.config.socket_mark, on_accepted=functools.partial(
                    self._count, "accepted"),
                on_refused=functools.partial(self._refused, stream_id=stream_id,
                                             target=target, origin=origin, control=False),
                on_finished=functools.partial(self._stream_finished, stream_id, target,
                                              origin)):
            return False
        # No stream note: `debug streams` shows a stream without one by its OPEN's
        # metadata and the time it arrived, which is what the note would say.
        return True

    def _allows_tcp(self, host: str, port: int) -> bool:
        """`node_config.allows(host, port, "tcp")`, remembered per target for the config
        in force: each rule parses the address again (~2 µs a rule, per stream)."""
        config = self.node_config
        allowed_by = self._allowed
        if self._allowed_by is not config:
            self._allowed_by = config
            allowed_by = self._allowed = {}
        key = (host, port)
        allowed = allowed_by.get(key)
        if allowed is None:
            if len(allowed_by) >= ALLOWED_CACHE:
                allowed_by.clear()
            allowed = allowed_by[key] = config.allows(host, port, "tcp")
        return allowed

    async def handle_stream(self, incoming: IncomingStream) -> None:
        target = incoming.target
        if target.protocol == "udp":
            await self.handle_flow(incoming)
            return
        if incoming.metadata.get(PURPOSE_KEY) == HEALTH_PURPOSE:
            # The server asks for checks of this node's backends: run here, beside them.
            stream = await incoming.accept()
            async with trio.open_nursery() as nursery:
                # A long-lived stream of the agent's own: it ends when a drain begins, so
                # the drain waits only for the traffic it carries.
                nursery.start_soon(_cancel_when, self.draining, nursery.cancel_scope)
                await serve_health_stream(
                    stream, incoming.stream.stream_id, self.health,
                    allows=lambda host, port: self.node_config.allows(host, port, "tcp"),
                    mark=self.config.socket_mark, log=self.log)
                nursery.cancel_scope.cancel()
            return
        origin = incoming.metadata.get("origin", "")
        # A control-plane stream (the server's CONNECT front) is checked against this
        # node's control_plane rules, not its allow list: a compromised server cannot
        # reach more of the node by labelling a stream one way or the other.
        control = incoming.metadata.get(PURPOSE_KEY) == CONTROL_PLANE_PURPOSE
        prefix = "control_plane_" if control else ""
        self.stream_notes.note(incoming.stream, opener_from_metadata(incoming.metadata))

        waits = not control and incoming.metadata.get(WAKE_KEY) == "1"

        def allowed() -> bool:
            node = self.node_config
            check = node.allows_control_plane if control else node.allows
            return target.protocol == "tcp" and check(target.host, target.port,
                                                      target.protocol)

        async def open_node_target() -> trio.abc.HalfCloseableStream:
            if not allowed() and not (waits and await self._allowed_soon(allowed)):
                raise StreamFailed(p.StreamReason.FORBIDDEN,
                                   f"{target} is not allowed on node {self.config.node}"
                                   + (" for control-plane streams" if control else ""))
            return await connect_tcp(target.host, target.port,
                                     connect_timeout=self.config.dial_timeout,
                                     mark=self.config.socket_mark)

        if control:
            with self.control_plane.track(origin, self.config.node, str(target),
                                          incoming.stream, sends_toward_target=False):
                relayed = await relay_incoming(
                    incoming, open_node_target,
                    on_accepted=lambda: self._count(f"{prefix}accepted"))
        else:
            # Handed over to the tunnel connection's splice loop: an idle stream keeps
            # no task here; the end is counted and logged by _stream_finished.
            relayed = await relay_incoming(
                incoming, open_node_target, on_accepted=lambda: self._count("accepted"),
                on_finished=functools.partial(self._stream_finished,
                                              incoming.stream.stream_id, target, origin))
        if relayed.failure is not None:
            self._refused(relayed.failure, incoming.stream.stream_id, target, origin,
                          control=control)
            return
        if relayed.spliced is not None:
            self._stream_finished(incoming.stream.stream_id, target, origin, relayed.spliced)

    def _refused(self, failure: StreamFailed, stream_id: int, target: p.Target, origin: str,
                 *, control: bool) -> None:
        """Count and log a stream refused (not allowed, or its dial failed)."""
        prefix = "control_plane_" if control else ""
        self._count(prefix + failure.outcome)
        if failure.reason is p.StreamReason.FORBIDDEN:
            # Keyed by the reason, not the target the server asked for: a bounded key
            # set, so a flood of odd targets is one line a minute with a count.
            self._forbidden_log.warning(
                prefix + "forbidden",
                "stream refused: target not allowed on this node" + (
                    " for control-plane streams" if control else ""),
                reason=prefix + "forbidden", stream=stream_id, target=str(target),
                origin=origin)
        else:
            self.log.info("stream refused: dial failed", stream=stream_id,
                          target=str(target), origin=origin, reason=failure.outcome,
                          error=failure.message)

    async def _allowed_soon(self, allowed: Callable[[], bool]) -> bool:
        """Whether a config applied within CONFIG_WAIT allows the target (see there)."""
        if self._config_waiters >= CONFIG_WAITERS:
            return False
        self._config_waiters += 1
        started = time.monotonic()
        try:
            with trio.move_on_after(CONFIG_WAIT):
                while True:
                    await self._config_applied.wait()
                    if allowed():
                        self._count("allowed_after_wait")
                        self.log.debug("stream allowed by a newer config", waited=(
                            f"{(time.monotonic() - started) * 1e3:.1f}ms"))
                        return True
            return False
        finally:
            self._config_waiters -= 1

    def _stream_finished(self, stream_id: int, target: p.Target, origin: str,
                         result: SpliceResult) -> None:
        self._bytes_in.inc(result.a_to_b)
        self._bytes_out.inc(result.b_to_a)
        if self.log.isEnabledFor(logging.DEBUG):  # no fields built per stream otherwise
            self.log.debug("stream finished", stream=stream_id, target=str(target),
                           origin=origin, sent=result.b_to_a, received=result.a_to_b,
                           error=result.error or "")

    async def handle_flow(self, incoming: IncomingStream) -> None:
        """A flow the server opened (a public UDP mapping): checked against the allow
        list (udp rules only), joined to a connected UDP socket to the target until the
        server resets it, it idles out or the target refuses."""
        target = incoming.target
        origin = incoming.metadata.get("origin", "")
        self.stream_notes.note(incoming.stream, opener_from_metadata(incoming.metadata))
        if incoming.metadata.get(PURPOSE_KEY) == CONTROL_PLANE_PURPOSE or \
                not self.node_config.allows(target.host, target.port, "udp"):
            self._count("forbidden")
            self._forbidden_log.warning(
                "forbidden", "stream refused: target not allowed on this node",
                reason="forbidden", stream=incoming.stream.stream_id, target=str(target),
                origin=origin)
            await incoming.refuse(p.StreamReason.FORBIDDEN,
                                  f"{target} is not allowed on node {self.config.node}")
            return
        try:
            sock = connect_udp(target.host, target.port, mark=self.config.socket_mark)
        except StreamFailed as exc:
            self._count(exc.outcome)
            self.log.info("flow refused", stream=incoming.stream.stream_id,
                          target=str(target), origin=origin, reason=exc.outcome,
                          error=exc.message)
            await incoming.refuse(exc.reason, exc.message)
            return
        try:
            stream = await incoming.accept()
        except BaseException:
            sock.close()
            raise
        self._count("accepted")
        # A bound method, not a closure per flow: the counters name the flow's stream.
        self.flow_poller.add(stream, sock, idle_timeout=flow_idle_timeout(incoming.metadata),
                             on_end=self._flow_ended)
        incoming.hand_over()

    def _flow_ended(self, counters: FlowCounters) -> None:
        self.metrics.count_flow(counters)
        stream = counters.stream
        if self.log.isEnabledFor(logging.DEBUG) and stream is not None:
            self.log.debug("flow finished", stream=stream.stream_id, target=str(stream.target),
                           origin=stream.metadata.get("origin", ""),
                           datagrams_in=counters.datagrams_in,
                           datagrams_out=counters.datagrams_out, ended_by=counters.ended_by)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self._streams_counted("inbound", outcome).inc()

    def _live_metrics(self) -> Iterable[Metric]:
        live = self.client.live()
        up = gauge("nodeagent_tunnel_up", "1 while a tunnel to a server is connected")
        up.add_metric([], 1 if live else 0)
        yield up
        tunnels = gauge("nodeagent_tunnels", "Live tunnels by server (replica) id",
                        labels=["server"])
        for tunnel in live:
            tunnels.add_metric([tunnel.server_id], 1)
        yield tunnels
        replicas = gauge("nodeagent_tunnel_replicas",
                         "Server replicas announced (tunnels the agent aims to hold)")
        replicas.add_metric([], self.client.replicas)
        yield replicas
        reconnects = counter(
            "nodeagent_tunnel_reconnects",
            "Tunnels to a server that ended and were redialed, by why (drained, "
            "keepalive_timeout, connection_lost, shutting_down, replaced, unauthorized, "
            "protocol_error, closed, cancelled)", labels=["reason"])
        for reason, count in sorted(self.client.status.lost.items()):
            reconnects.add_metric([reason], count)
        yield reconnects
        connects = counter("nodeagent_tunnel_connects", "Tunnel handshakes completed")
        connects.add_metric([], self.client.status.connects)
        yield connects
        rtt = gauge("nodeagent_tunnel_rtt_seconds", "Round-trip time to each server",
                    labels=["server"])
        for tunnel in live:
            if tunnel.connection.rtt is not None:
                rtt.add_metric([tunnel.server_id], tunnel.connection.rtt)
        yield rtt
        checks = counter("nodeagent_agent_health_checks", "Active health checks this agent "
                         "ran for its servers, by result (ok, failed)", labels=["result"])
        for result, count in sorted(self.health.results.items()):
            checks.add_metric([result], count)
        yield checks

    def status(self) -> dict[str, Any]:
        conn = self.client.connection
        info = conn.info() if conn is not None else None
        return {
            "role": "agent",
            "node": self.config.node,
            "version": __version__,
            "uptime_seconds": round(time.monotonic() - self.started, 1),
            "config_version": self.node_config.version,
            "tunnel": {
                "state": self.client.status.state,
                "server": self.config.server,
                # "direct", or the proxy the tunnel is dialed through (password redacted)
                "proxy": self.client.proxy.describe(),
                "peer": info.peer if info else None,
                "rtt_ms": round(info.rtt_seconds * 1000, 2) if info and info.rtt_seconds
                is not None else None,
                "connects": self.client.status.connects,
                "failures": self.client.status.failures,
                "last_error": self.client.status.last_error,
                # unreachable | overloaded | rejected: which reconnect schedule applies
                "last_failure": self.client.status.last_failure,
                "streams_open": info.streams_open if info else 0,
                "bytes_in": info.bytes_in if info else 0,
                "bytes_out": info.bytes_out if info else 0,
                # Several replicas: how many the servers announce, and every tunnel held.
                "replicas": self.client.replicas,
                "already_connected": self.client.status.already_connected,
                "direct_servers": list(self.config.direct_servers),
            },
            "tunnels": [t.as_dict() for t in self.client.tunnels],
            "streams_by_outcome": dict(self.outcomes),
            "control_plane_streams": self.control_plane.as_list(),
            "health_checks": self.health.as_list(),
            "intercepted_by_outcome": dict(self.interceptor.outcomes)
            if self.interceptor is not None else {},
            "intercepted_udp_by_outcome": dict(self.interceptor.udp.outcomes)
            if self.interceptor is not None and self.interceptor.udp is not None else {},
            # Controller mode: the config watch (controller URL, version applied, errors).
            "config_watch": self.config_watch.as_dict() if self.config_watch else None,
            "identity": self.identity.status() if self.identity else None,
        }

    async def drain(self) -> None:
        """Graceful stop (SIGTERM), until what is in flight has finished; the caller
        bounds it with `drain_seconds`. Intercepted connections: the proxy listener
        closes, those accepted carry on. Tunnels: GOAWAY, so the servers open no new
        streams to this node (they answer 502 meanwhile), and the running ones finish."""
        self.draining.set()
        interceptor = self.interceptor
        if interceptor is not None:
            await interceptor.stop_accepting()
        self.client.drain("agent shutting down")

        def in_flight() -> tuple[int, int]:
            return (interceptor.active_connections if interceptor else 0,
                    self.client.streams_open())

        intercepted, streams = in_flight()
        self.log.info("draining", intercepted=intercepted, streams=streams)
        try:
            if interceptor is not None:
                await interceptor.wait_idle()
            await self.client.wait_idle()
            self.log.info("drained: nothing left in flight")
        finally:
            intercepted, streams = in_flight()
            if intercepted or streams:
                self.log.warning("drain time over; resetting what is left",
                                 intercepted=intercepted, streams=streams)

    def tunnels(self) -> dict[str, Any]:
        """`nodeagent debug tunnels`: a row per server connection, held or being dialed."""
        rows = []
        for tunnel in self.client.tunnels:
            d = tunnel.as_dict()
            rows.append({"server_id": d["server_id"], "address": d["address"],
                         "peer": d["peer"], "state": d["state"], "rtt_ms": d["rtt_ms"],
                         "streams_open": d["streams_open"], "bytes_in": d["bytes_in"],
                         "bytes_out": d["bytes_out"], "since_seconds": d["connected_seconds"],
                         "last_error": None})
        rows.extend(self.client.dialing())
        status = self.client.status
        return {"role": "agent", "node": self.config.node, "state": status.state,
                "replicas": self.client.replicas, "connects": status.connects,
                "reconnects": dict(status.lost), "last_error": status.last_error,
                "tunnels": rows}

    def streams(self) -> dict[str, Any]:
        """`nodeagent debug streams`: every stream on every tunnel, both directions."""
        rows = []
        for tunnel in self.client.tunnels:
            rows.extend(stream_rows(tunnel.connection, self.stream_notes,
                                    peer={"server_id": tunnel.server_id}))
        return {"role": "agent", "node": self.config.node, "streams": rows}

    def flows(self) -> dict[str, Any]:
        """`nodeagent debug flows`: pods' intercepted UDP flows (the flows the server
        opens for its UDP mappings are streams to udp:// targets: `debug streams`)."""
        udp = self.interceptor.udp if self.interceptor is not None else None
        return {"role": "agent", "node": self.config.node,
                "flows": udp.view() if udp is not None else [],
                "drops": dict(udp.drops) if udp is not None else {}}

    def rules(self) -> dict[str, Any]:
        if self.interceptor is None:
            return {"intercept": "off"}
        return self.interceptor.rules_view()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.flow_poller.run)
                await nursery.start(self.client.run)
                if self.interceptor is not None:
                    await nursery.start(self.interceptor.run)
                self._nursery = nursery  # an interceptor turned on later runs here
                task_status.started()
        finally:
            self._nursery = None


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
