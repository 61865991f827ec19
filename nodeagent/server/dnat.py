"""The DNAT path on the server: streams a cloud node's agent opens for dials it caught to
another node's address (metrics-server, a Prometheus without proxy settings, kube-apiserver
without an egress selector dialing <node IP>:10250; the controller gives cloud nodes that
intercept rule, see controller/compute.py `dnat_paths`).

A stream from a node in `control_plane_sources` to an address the CONNECT front knows is
decided exactly like a CONNECT (`connect.decide`: allowedNodePorts, denied nodes), opened
as a control-plane stream to the owning node's agent (which checks its own `control_plane`
rules), and carried like a CONNECT stream: listed live in the server's debug status
(`dnat.streams`: client = the cloud node and the caught connection's source, node,
target, bytes each way, age), counted by outcome in `nodeagent_dnat_streams_total`
(`established` or a `connect.REASONS` code) and its bytes in `nodeagent_dnat_bytes_total`;
refusals log once a minute per reason.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as MetricCounter

from nodeagent.config import RoutesConfig
from nodeagent.ops.streamviews import LiveStreams
from nodeagent.server.connect import ConnectRoute, ProxyTarget, Refusal, decide
from nodeagent.server.connectfront import StreamOpener, failure_refusal, open_control_plane
from tunnel import protocol as p
from tunnel.endpoint import IncomingStream
from tunnel.log import RateLimitedLog, StructuredLogger
from tunnel.relay import relay_incoming

# Refusals by the server's own policy (the rest are the node's or the dial's failures).
POLICY_REASONS = frozenset({"node_denied", "port_not_allowed", "pod_not_allowed", "not_tcp"})


class DnatPath:
    """Carries the streams cloud nodes' agents open to other nodes' addresses."""

    def __init__(self, *, open_stream: StreamOpener, dial_timeout: float,
                 registry: CollectorRegistry, log: StructuredLogger) -> None:
        self._open_stream = open_stream
        self.dial_timeout = dial_timeout
        self.log = log.bind(path="dnat")
        self._refusal_log = RateLimitedLog(self.log, period=60.0)
        self.streams = LiveStreams()
        self.outcomes: Counter[str] = Counter()
        self.requests = MetricCounter(
            "nodeagent_dnat_streams_total", "Streams cloud nodes' agents opened for dials "
            "they caught to other nodes' addresses (the DNAT path), by outcome: "
            "established or the refusal reason", ["outcome"], registry=registry)
        self.bytes = MetricCounter(
            "nodeagent_dnat_bytes_total", "Bytes carried by DNAT path streams: in (cloud "
            "node to node), out (node to cloud node)", ["direction"], registry=registry)

    @staticmethod
    def catches(node: str, host: str, routes: RoutesConfig) -> bool:
        """Whether a stream `node`'s agent opened to `host` takes this path: `node` is a
        cloud node and `host` names a node the CONNECT front reaches."""
        return node in routes.control_plane_sources and \
            routes.connect_node_for(host) is not None

    async def relay(self, node: str, incoming: IncomingStream, routes: RoutesConfig) -> str:
        """Decide, open and carry one stream; returns its outcome (`established` or a
        reason code). Never raises for anything the peers do."""
        target = incoming.target
        client = f"{node}/{incoming.metadata.get('origin', '')}"
        wanted = ProxyTarget(target.host.lower(), target.port)
        decision: ConnectRoute | Refusal = (
            decide(wanted, routes) if target.protocol == "tcp"
            else Refusal("not_tcp", "the DNAT path carries tcp only"))
        if isinstance(decision, Refusal):
            await incoming.refuse(p.StreamReason.FORBIDDEN, decision.message)
            return self._refused(decision, client, wanted)
        route = decision
        with self.streams.track(client, route.node, wanted.authority, incoming.stream,
                                sends_toward_target=False):
            started = time.monotonic()
            relayed = await relay_incoming(
                incoming,
                lambda: open_control_plane(self._open_stream, route, client, self.dial_timeout),
                on_accepted=lambda: self._count("established"))
        if relayed.failure is not None:
            return self._refused(failure_refusal(route, relayed.failure), client, wanted)
        result = relayed.spliced
        assert result is not None
        self.bytes.labels("in").inc(result.a_to_b)
        self.bytes.labels("out").inc(result.b_to_a)
        self.log.info("DNAT stream closed", client=client, node=route.node,
                      target=wanted.authority, bytes_in=result.a_to_b,
                      bytes_out=result.b_to_a, seconds=round(time.monotonic() - started, 1),
                      error=result.error or "")
        return "established"

    def _refused(self, refusal: Refusal, client: str, wanted: ProxyTarget) -> str:
        self._count(refusal.reason)
        # Keyed by the reason (a fixed set): a flood of odd targets is one line a minute.
        self._refusal_log.warning(refusal.reason, "DNAT stream refused",
                                  reason=refusal.reason, client=client,
                                  target=wanted.authority, problem=refusal.message)
        return refusal.reason

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.requests.labels(outcome).inc()

    def status(self) -> dict[str, Any]:
        return {"by_outcome": dict(self.outcomes), "streams": self.streams.as_list()}
