"""UDP mappings: a public UDP port on the server whose every client address (host and
port) becomes a flow to `node` → `target`; replies go back to that address.

One socket per mapping and one task reading it; a flow holds no task of its own (the
tunnel's reader hands its replies to `ServerFlow.on_datagram`, which sends them at once
or drops them), so an idle flow costs a few hundred bytes. What a client may cost:

- flows: at most `max_flows` at once through a node (all its mappings on this server)
  and `max_flows_per_client` from one IP; beyond, a new client's datagrams are dropped
  (`flow_limit`, `client_flow_limit`). A spoofed-source flood fills these and no more.
- amplification: until a client has sent a second datagram on its flow, the replies
  toward it stop at `amplification_factor` times the bytes it sent (QUIC's rule, RFC
  9000 8.1): a single forged datagram cannot make this port send more than a few times
  its size at a victim (`amplification`).
- queues: while its flow opens a client's datagrams wait in a small queue
  (`PENDING_DATAGRAMS`); after, the tunnel core's per-flow queue bounds them. Full
  queues drop (`queue_full`, `congested`), never block.
- idle: a flow with no datagram either way for `idle_timeout` ends (RST to the agent).
- failures: a flow the node refused (`forbidden`, `refused`, `unreachable`, ...) keeps
  dropping its client's datagrams, counted under that reason, for `FAILED_HOLD`
  seconds, then the next datagram tries again (an agent restart recovers so).

Every drop is counted by reason (`nodeagent_udp_drops_total`), and `nodeagent debug
flows` lists the flows.
"""

from __future__ import annotations

import functools
import socket
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.lowlevel
from prometheus_client.metrics_core import Metric

from nodeagent.config import UdpMapping
from nodeagent.ops.logs import StructuredLogger
from nodeagent.ops.metrics import Metrics, gauge
from nodeagent.ops.streamviews import StreamNotes
from nodeagent.server.datapath import DataPath
from tunnel import protocol as p
from tunnel.errors import StreamFailed, StreamResetError
from tunnel.log import RateLimitedLog
from tunnel.stream import StreamCarrier, TunnelStream
from tunnel.tcp import format_address
from tunnel.udp import expire_flows

PENDING_DATAGRAMS = 16  # a client's datagrams waiting while its flow opens
FAILED_HOLD = 1.0  # seconds a failed flow drops before the next datagram retries
RECV_BATCH = 64  # datagrams read per wake-up of the mapping's socket
RECV_SIZE = 65_535
# A balanced port's choice of node and target for a new flow from a client address.
FlowPick = Callable[[tuple[Any, ...]], UdpMapping | None]


@dataclass(eq=False, slots=True)
class ServerFlow:
    """One client address's flow through a mapping (a tunnel.stream.DatagramSink)."""

    mapping: MappingFlows
    client: tuple[Any, ...]  # the client's socket address
    client_ip: str
    opened_at: float
    last_active: float
    config: UdpMapping  # its node and target: the mapping's, or its pick's (balanced)
    stream: TunnelStream | None = None
    pending: list[bytes] | None = field(default_factory=list)  # while opening
    failure: str | None = None  # why it failed (a drop reason), until retried
    failed_at: float = 0.0
    datagrams_in: int = 0  # from the client
    datagrams_out: int = 0  # to the client
    bytes_in: int = 0
    bytes_out: int = 0
    received_from_client: int = 0  # every byte it sent, dropped or not (amplification)
    datagrams_seen: int = 0  # datagrams it sent before its flow opened
    validated: bool = False  # it sent a second datagram: no more reply cap
    closed: bool = False

    @property
    def state(self) -> str:
        if self.failure is not None:
            return "failed"
        return "open" if self.stream is not None else "opening"

    def on_datagram(self, data: bytes) -> None:
        """A reply from the target: to the client now, or dropped with a reason."""
        mapping = self.mapping
        size = len(data)
        if not self.validated and (self.bytes_out + size
                                   > mapping.config.amplification_factor
                                   * self.received_from_client):
            mapping.drop("amplification")
            return
        try:
            mapping.sock.sendto(data, self.client)
        except BlockingIOError:
            mapping.drop("socket_full")
            return
        except OSError:
            mapping.drop("send_error")
            return
        self.datagrams_out += 1
        self.bytes_out += size
        self.last_active = trio.current_time()
        relay = mapping.relay
        relay.datagrams_out.inc()
        relay.bytes_out.inc(size)

    def on_datagrams_end(self) -> None:
        pass  # each reply left at once

    def on_reset(self, error: StreamResetError) -> None:
        """The node ended the flow (the target refused, its idle timer, the tunnel
        went down): drop for FAILED_HOLD, then the client's next datagram reopens."""
        if self.closed:
            return
        self.stream = None
        self.failure = ("refused" if error.reason is p.StreamReason.REFUSED
                        else "closed")
        self.failed_at = trio.current_time()

    def row(self, now: float) -> dict[str, Any]:
        config = self.config
        return {
            "mapping": self.mapping.name, "client": format_address(self.client),
            "node": config.node, "target": f"udp://{config.target.host}:{config.target.port}",
            "state": self.state, "failure": self.failure,
            "stream": self.stream.stream_id if self.stream is not None else None,
            "age_seconds": round(now - self.opened_at, 1),
            "idle_seconds": round(now - self.last_active, 1),
            "datagrams_in": self.datagrams_in, "datagrams_out": self.datagrams_out,
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "validated": self.validated,
        }


class MappingFlows:
    """The flows of one mapping, keyed by client address, and its counters."""

    def __init__(self, name: str, config: UdpMapping, sock: socket.socket,
                 relay: UdpMappingRelay, pick: FlowPick | None = None) -> None:
        self.name = name
        self.config = config
        self.pick = pick
        self.sock = sock
        self.relay = relay
        self.flows: dict[tuple[Any, ...], ServerFlow] = {}
        self.per_client: Counter[str] = Counter()
        self.drops: Counter[str] = Counter()
        # The tunnel connections this wake-up queued datagrams on: the reader flushes
        # them itself after its batch (the writers' wake-ups saved, on a query's way).
        self.touched: set[StreamCarrier] = set()

    def drop(self, reason: str, count: int = 1) -> None:
        self.drops[reason] += count
        self.relay.metrics.datagram_drops.labels(reason).inc(count)

    def carried_in(self, datagrams: int, size: int) -> None:
        relay = self.relay
        relay.datagrams_in.inc(datagrams)
        relay.bytes_in.inc(size)


class UdpMappingRelay:
    """Carries the datagrams of every UDP mapping into their nodes' tunnels."""

    def __init__(self, *, datapath: DataPath, notes: StreamNotes, metrics: Metrics,
                 log: StructuredLogger) -> None:
        self._datapath = datapath
        self._notes = notes
        self.metrics = metrics
        self.log = log
        self._failure_log = RateLimitedLog(log, period=60.0)
        self.mappings: list[MappingFlows] = []
        self.node_flows: Counter[str] = Counter()
        # The carried counters' children, looked up once: labels() per datagram cost
        # the mapping's reader a third of its Python time (cProfile, iperf3 -u).
        self.datagrams_in = metrics.datagrams.labels("in")
        self.datagrams_out = metrics.datagrams.labels("out")
        self.bytes_in = metrics.datagram_bytes.labels("in")
        self.bytes_out = metrics.datagram_bytes.labels("out")
        metrics.add_live(self._live_metrics)

    async def serve(self, name: str, config: UdpMapping, sock: socket.socket, *,
                    pick: FlowPick | None = None) -> None:
        """Serve one mapping's socket until cancelled; its flows end with it. `pick`:
        each new flow's node and target (a balanced port's backend; None: drop)."""
        mapping = MappingFlows(name, config, sock, self, pick)
        self.mappings.append(mapping)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(
                    expire_flows, mapping.flows.values, self._forget,
                    idle_timeout=config.idle_timeout, failed_hold=FAILED_HOLD))
                recvfrom = sock.recvfrom
                touched = mapping.touched
                while True:
                    await trio.lowlevel.wait_readable(sock)
                    # One clock reading and one metrics update per wake-up, not per datagram.
                    now = trio.current_time()
                    carried = size = 0
                    for _ in range(RECV_BATCH):
                        try:
                            data, client = recvfrom(RECV_SIZE)
                        except BlockingIOError:
                            break
                        except OSError:
                            continue  # an ICMP error for an earlier reply: not a datagram
                        if self._from_client(mapping, data, client, now, nursery):
                            carried += 1
                            size += len(data)
                    if touched:
                        for connection in touched:
                            connection.flush()
                        touched.clear()
                    if carried:
                        mapping.carried_in(carried, size)
        finally:
            self.mappings.remove(mapping)
            for flow in list(mapping.flows.values()):
                self._forget(flow)
            with trio.CancelScope(shield=True):
                for flow in list(mapping.flows.values()):
                    if flow.stream is not None:
                        await flow.stream.aclose()

    def _from_client(self, mapping: MappingFlows, data: bytes, client: tuple[Any, ...],
                     now: float, nursery: trio.Nursery) -> bool:
        """One datagram from a client; True if it went into the tunnel now (the caller
        counts those), False if it was dropped or waits for its flow to open."""
        flow = mapping.flows.get(client)
        size = len(data)
        if flow is not None and flow.stream is not None:  # the hot path: an open flow
            flow.received_from_client += size
            flow.validated = True  # its second datagram at least (the first opened it)
            flow.last_active = now
            stream = flow.stream
            dropped = stream.send_datagram(data, wake=False)  # flushed after the batch
            if dropped is not None:
                mapping.drop(dropped)
                return False
            mapping.touched.add(stream.connection)
            flow.datagrams_in += 1
            flow.bytes_in += size
            return True
        if flow is not None and flow.failure is not None and \
                now - flow.failed_at >= FAILED_HOLD:
            self._forget(flow)  # held long enough: this datagram tries again
            flow = None
        if flow is None:
            picked = mapping.config if mapping.pick is None else mapping.pick(client)
            if picked is None:
                mapping.drop("no_backends")
                return False
            config = picked
            if self.node_flows[config.node] >= config.max_flows:
                mapping.drop("flow_limit")
                return False
            ip = str(client[0])
            if mapping.per_client[ip] >= config.max_flows_per_client:
                mapping.drop("client_flow_limit")
                return False
            flow = ServerFlow(mapping, client, ip, opened_at=now, last_active=now,
                              config=config)
            mapping.flows[client] = flow
            mapping.per_client[ip] += 1
            self.node_flows[config.node] += 1
            nursery.start_soon(self._open, flow)
        flow.received_from_client += size
        flow.datagrams_seen += 1
        if flow.datagrams_seen >= 2:
            flow.validated = True
        flow.last_active = now
        if flow.failure is not None:
            mapping.drop(flow.failure)
            return False
        assert flow.pending is not None
        if len(flow.pending) >= PENDING_DATAGRAMS:
            mapping.drop("queue_full")
            return False
        flow.pending.append(data)
        return False

    async def _open(self, flow: ServerFlow) -> None:
        mapping = flow.mapping
        config = flow.config
        target = p.Target(config.target.host, config.target.port, "udp")
        origin = format_address(flow.client)
        try:
            stream = await self._datapath.open_flow(config.node, target, origin,
                                                    config.idle_timeout)
        except StreamFailed as exc:
            if flow.closed:
                return
            flow.failure = exc.outcome
            flow.failed_at = trio.current_time()
            if flow.pending:
                mapping.drop(exc.outcome, len(flow.pending))
            flow.pending = None
            self._failure_log.warning(
                f"{mapping.name}:{exc.outcome}", "UDP flow refused",
                listener=mapping.name, node=config.node, target=str(target), client=origin,
                reason=exc.outcome, error=exc.message)
            return
        if flow.closed:  # expired or the mapping stopped while it opened
            await stream.aclose()
            return
        self._notes.note(stream, f"udp mapping {mapping.name} client {origin}")
        flow.stream = stream
        pending, flow.pending = flow.pending or [], None
        stream.attach_datagram_sink(flow)
        for data in pending:
            dropped = stream.send_datagram(data)
            if dropped is not None:
                mapping.drop(dropped)
                continue
            flow.datagrams_in += 1
            flow.bytes_in += len(data)
            mapping.carried_in(1, len(data))

    def _forget(self, flow: ServerFlow) -> None:
        mapping = flow.mapping
        if flow.closed:
            return
        flow.closed = True
        del mapping.flows[flow.client]
        mapping.per_client[flow.client_ip] -= 1
        if mapping.per_client[flow.client_ip] <= 0:
            del mapping.per_client[flow.client_ip]
        node = flow.config.node
        self.node_flows[node] -= 1
        if self.node_flows[node] <= 0:
            del self.node_flows[node]

    # ---------------------------------------------------------------- views

    def flows(self, node: str | None = None) -> dict[str, Any]:
        """`nodeagent debug flows`: every flow of every UDP mapping, and their counters."""
        now = trio.current_time()
        rows = [flow.row(now) for mapping in self.mappings for flow in mapping.flows.values()
                if node is None or flow.config.node == node]
        mappings = [{"mapping": m.name, "node": m.config.node, "flows": len(m.flows),
                     "drops": dict(m.drops)} for m in self.mappings
                    if node is None or m.config.node == node]
        return {"role": "server", "mappings": mappings, "flows": rows}

    def _live_metrics(self) -> Iterable[Metric]:
        flows = gauge("nodeagent_udp_flows", "Live UDP flows by mapping", labels=["mapping"])
        for mapping in self.mappings:
            flows.add_metric([mapping.name], len(mapping.flows))
        yield flows
