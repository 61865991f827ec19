"""The server's stream openers: for each kind of stream it carries, the function that opens
the other end, and the accounting of how each attempt ended.

- `AgentStreams`: streams an agent opens (intercepted traffic, its config and signing
  streams). `open_agent_destination` goes where the data-path policy allows (a relay to
  another node, the controller, egress); a cloud node's caught dial to a node's address
  takes the DNAT path instead. On a bootstrap connection, `open_controller_for_bootstrap`
  reaches the controller and nothing else.
- `HttpBackends.open_http_backend`: the HTTP and Ingress fronts' upstream, through the
  backend's node (or dialed directly for an opted-in Ingress backend); a failure becomes
  the 502/504 the front answers with.
- The TCP mappings' opener lives with them (`tcpmappings.py`).

Every attempt is counted by outcome (`StreamOutcomes`: the debug status's
`streams_by_outcome` and `nodeagent_streams_total`), and every stream is noted with who
opened it (the debug socket's `streams` view).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable

import trio
from prometheus_client import Counter as MetricCounter

from nodeagent.config import RoutesConfig
from nodeagent.http.errors import UpstreamUnavailable
from nodeagent.http.routetable import Backend, Route
from nodeagent.ops.metrics import Children
from nodeagent.ops.streamviews import StreamNotes, opener_from_metadata
from nodeagent.server.datapath import DataPath
from nodeagent.server.dnat import POLICY_REASONS, DnatPath
from nodeagent.server.refusals import PolicyRefusals
from nodeagent.server.tunnelupstream import TunnelUpstream
from tunnel import protocol as p
from tunnel.endpoint import IncomingStream
from tunnel.errors import StreamFailed
from tunnel.relay import relay_incoming, relay_incoming_now
from tunnel.splice import SpliceResult
from tunnel.stream import TunnelStream
from tunnel.tcp import literal_family
from tunnel.udp import FlowCounters, FlowPoller, flow_idle_timeout


class StreamOutcomes:
    """How each stream the server carried ended, by direction: outbound (the server opened
    it toward a node or backend) and inbound (an agent opened it)."""

    def __init__(self, streams_metric: MetricCounter) -> None:
        self.counts: Counter[str] = Counter()
        self._metric = Children(streams_metric)  # a stream or two per connection

    def outbound(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self._metric("outbound", outcome).inc()

    def inbound(self, outcome: str) -> None:
        self.counts[f"agent_opened:{outcome}"] += 1
        self._metric("inbound", outcome).inc()


class AgentStreams:
    """Serves the streams agents open: TunnelServer's stream and bootstrap handlers."""

    def __init__(self, *, datapath: DataPath, dnat: DnatPath,
                 routes: Callable[[], RoutesConfig], notes: StreamNotes,
                 outcomes: StreamOutcomes, refusals: PolicyRefusals,
                 on_flow_done: Callable[[FlowCounters], None] | None = None) -> None:
        self._on_flow_done = on_flow_done
        # Agents' flows (intercepted UDP sent from here), served by one task
        # (serve_server runs it): an idle flow costs its socket and a record, no task.
        self.flow_poller = FlowPoller()
        self._datapath = datapath
        self._dnat = dnat
        self._routes = routes
        self._notes = notes
        self._outcomes = outcomes
        self._refusals = refusals

    def take_agent_stream(self, node: str, incoming: IncomingStream) -> bool:
        """The common case without a task (TunnelServer's stream taker: the tunnel
        connection's reader calls this for every stream an agent opens, before it makes
        a handler task): a tcp stream to an IP literal is decided by the data-path policy
        here, at once, and refused (FORBIDDEN, counted and logged), or, if it is egress,
        dialed and spliced by the connection's splice loop. Anything that may wait before
        its dial (a name to resolve, a relay through another node's tunnel, the
        controller, the DNAT path) or is not tcp is left to `handle_agent_stream`'s task
        (False)."""
        target = incoming.target
        if target.protocol != "tcp" or literal_family(target.host) is None:
            return False
        routes = self._routes()
        if self._dnat.catches(node, target.host, routes):
            return False
        origin = incoming.metadata.get("origin", "")
        owner = routes.node_for_address(target.host)
        try:
            # Deny by default: the policy has said yes before any connect() is made.
            where = self._datapath.agent_destination(node, owner, target, origin, routes)
        except StreamFailed as exc:
            self._notes.note(incoming.stream, opener_from_metadata(incoming.metadata))
            incoming.refuse_now(exc.reason, exc.message)
            self._outcomes.inbound(exc.outcome)
            return True
        if where != "egress" or not relay_incoming_now(
                incoming, target.host, target.port, timeout=self._datapath.dial_timeout,
                mark=None, on_accepted=self._accepted_egress,
                on_refused=self._dial_refused, on_finished=_ignore):
            return False
        self._notes.note(incoming.stream, opener_from_metadata(incoming.metadata))
        return True

    def _accepted_egress(self) -> None:
        self._outcomes.inbound("egress")

    def _dial_refused(self, failure: StreamFailed) -> None:
        self._outcomes.inbound(failure.outcome)

    async def handle_agent_stream(self, node: str, incoming: IncomingStream) -> None:
        """A stream an agent opened (intercepted traffic). A cloud node's dial to a node's
        address takes the DNAT path (dnat.py). Otherwise: relayed, dialed or refused as
        the data-path policy says (datapath.py). Nothing is an open proxy."""
        target = incoming.target
        self._notes.note(incoming.stream, "agent to the controller"
                         if self._datapath.is_controller(target)
                         else opener_from_metadata(incoming.metadata))
        routes = self._routes()
        if self._dnat.catches(node, target.host, routes):
            # A cloud node's caught dial to a node's address: decided like a CONNECT.
            outcome = await self._dnat.relay(node, incoming, routes)
            self._outcomes.inbound("control_plane" if outcome == "established" else outcome)
            if outcome in POLICY_REASONS:
                self._refusals.count("control_plane_refused")
            return
        origin = incoming.metadata.get("origin", "")
        owner = routes.node_for_address(target.host)
        if target.protocol == "udp":
            await self._handle_agent_flow(node, owner, incoming, origin)
            return
        via = "relay" if owner is not None and owner != node else "egress"
        open_agent_destination = functools.partial(
            self._datapath.open_for_agent, node, owner, target, origin)
        # Handed over (on_finished): an idle stream keeps no task on the server either.
        relayed = await relay_incoming(incoming, open_agent_destination,
                                       on_accepted=lambda: self._outcomes.inbound(via),
                                       on_finished=_ignore)
        if relayed.failure is not None:
            self._outcomes.inbound(relayed.failure.outcome)

    async def _handle_agent_flow(self, node: str, owner: str | None,
                                 incoming: IncomingStream, origin: str) -> None:
        """A flow (UDP) an agent opened for intercepted pod traffic: sent from the cloud
        side where the egress policy allows, joined to a connected UDP socket (handed to
        the flow poller) until idle or reset."""
        try:
            sock = self._datapath.flow_for_agent(node, owner, incoming.target, origin)
        except StreamFailed as exc:
            await incoming.refuse(exc.reason, exc.message)
            self._outcomes.inbound(exc.outcome)
            return
        try:
            stream = await incoming.accept()
        except BaseException:
            sock.close()
            raise
        self._outcomes.inbound("egress")
        self.flow_poller.add(stream, sock, idle_timeout=flow_idle_timeout(incoming.metadata),
                             on_end=self._on_flow_done)
        incoming.hand_over()

    async def handle_bootstrap_stream(self, claimed_node: str,
                                      incoming: IncomingStream) -> None:
        """A stream on a bootstrap connection: to the controller or nowhere."""
        open_controller_for_bootstrap = functools.partial(
            self._datapath.open_for_bootstrap, claimed_node, incoming.target)
        relayed = await relay_incoming(incoming, open_controller_for_bootstrap,
                                       on_accepted=lambda: self._outcomes.inbound("bootstrap"),
                                       on_finished=_ignore)
        if relayed.failure is not None:
            self._outcomes.inbound(f"bootstrap_{relayed.failure.outcome}")


def _ignore(result: SpliceResult) -> None:
    """Relays whose bytes nobody counts here (the tunnel connection counts them)."""


class HttpBackends:
    """The HTTP fronts' upstream opener."""

    def __init__(self, *, datapath: DataPath, notes: StreamNotes, outcomes: StreamOutcomes,
                 direct_backends: bool) -> None:
        """`direct_backends`: a backend without a node is an Ingress's direct backend
        (controller mode), dialed only outside the protected floor."""
        self._datapath = datapath
        self._notes = notes
        self._outcomes = outcomes
        self._direct_backends = direct_backends

    async def open_http_backend(self, backend: Backend, route: Route,
                                client: str = "") -> trio.abc.HalfCloseableStream:
        """A stream to `backend` for `route`; tunnel failures become 502 / 504 with a
        readable reason (UpstreamUnavailable)."""
        try:
            if backend.node is None and self._direct_backends:
                stream: trio.abc.HalfCloseableStream = (
                    await self._datapath.dial_direct_backend(backend, route.name))
            else:
                stream = await self._datapath.open_to(backend.node, backend.host,
                                                      backend.port, client,
                                                      wakes=route.wake is not None)
                # One upstream stream serves a client connection's requests in turn.
                self._notes.note(stream, f"http route {route.name}" + (
                    f" client {client}" if client else ""))
                if route.backend_protocol == "h1" and isinstance(stream, TunnelStream):
                    # Fewer task switches per request (tunnelupstream.py); h2c's shared
                    # connections keep the bare stream their debug view describes.
                    stream = TunnelUpstream(stream)
        except StreamFailed as exc:
            self._outcomes.outbound(exc.outcome)
            status = 504 if exc.reason is p.StreamReason.TIMEOUT else 502
            where = f"node {backend.node}" if backend.node else "the server"
            raise UpstreamUnavailable(
                status, f"{backend.host}:{backend.port} via {where}: {exc.message}") from None
        self._outcomes.outbound("accepted")
        return stream
