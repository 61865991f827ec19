"""Prometheus metrics of one nodeagent process (any role).

Counters are incremented where things happen; gauges that mirror live state (agents
connected, RTT, open streams), and counts the tunnel code keeps anyway (tunnels ended by
reason), are read from the objects at scrape time by a collector, so they can never
drift from the truth. Histograms (PING round trips, stream setup, config apply) take one
sample per event, never per byte or frame.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from nodeagent import __version__
from tunnel.udp import FlowCounters

_LATENCY_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)


class Children:
    """A labelled metric's children, each looked up by `labels()` once: per connection a
    counter is bumped several times, and `labels()` costs ~3 µs (a lock, a key tuple
    checked and built, a dict) against a dict lookup's tenth of that. The label values
    must be a bounded set (outcomes, directions), as for any Prometheus label."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: Counter) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Counter] = {}

    def __call__(self, *values: str) -> Counter:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class _LiveCollector(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()


class Metrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        info = Info("nodeagent_build", "nodeagent version and role", registry=self.registry)
        info.info({"version": __version__, "role": role})
        self.streams = Counter(
            "nodeagent_streams_total",
            "Tunnel streams by who opened them and how they ended up",
            ["direction", "outcome"], registry=self.registry)
        self.stream_bytes = Counter(
            "nodeagent_stream_bytes_total", "Payload bytes carried by streams",
            ["direction"], registry=self.registry)
        # UDP flows (public UDP mappings, intercepted UDP): datagrams carried and dropped.
        self.datagrams = Counter(
            "nodeagent_udp_datagrams_total",
            "UDP datagrams carried by flows, by direction (in: toward the target, out: "
            "back to the client)", ["direction"], registry=self.registry)
        self.datagram_bytes = Counter(
            "nodeagent_udp_bytes_total", "UDP payload bytes carried by flows, by direction",
            ["direction"], registry=self.registry)
        self.datagram_drops = Counter(
            "nodeagent_udp_drops_total",
            "UDP datagrams dropped, by reason (queue_full, congested, too_large, "
            "socket_full, refused, forbidden, flow_limit, client_flow_limit, "
            "amplification, unreachable, closed, ...)", ["reason"], registry=self.registry)
        self.bad_input = Counter(
            "nodeagent_bad_input_total",
            "Malformed or refused input from peers (protocol errors, bad HTTP, bad config)",
            ["kind"], registry=self.registry)
        self.http_requests = Counter(
            "nodeagent_http_requests_total", "HTTP requests served by the front",
            ["code"], registry=self.registry)
        self.config_version = Gauge(
            "nodeagent_config_version", "Version of the config this process runs",
            registry=self.registry)
        self.config_apply = Histogram(
            "nodeagent_config_apply_seconds",
            "Time to apply a new config (agent: netfilter, listeners, allow list; server: "
            "route tables, certificates), by outcome (ok, failed)", ["outcome"],
            buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10),
            registry=self.registry)
        self.tunnel_rtt = Histogram(
            "nodeagent_tunnel_ping_rtt_seconds",
            "Keepalive PING round trips on the tunnels (one sample per ping interval per "
            "tunnel)", buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.stream_setup = Histogram(
            "nodeagent_stream_setup_seconds",
            "From sending a stream's OPEN to the peer's accept (which includes the peer's "
            "dial of the target), by direction: to-node (the server opens, Ingress/TCP/"
            "CONNECT) or from-node (the agent opens: intercepted traffic, the controller)",
            ["direction"], buckets=_LATENCY_BUCKETS, registry=self.registry)

    def count_flow(self, counters: FlowCounters) -> None:
        """A flow joined to a socket (tunnel.udp.FlowPoller) ended: what it carried and
        dropped, added once (its datagrams are not counted one by one)."""
        self.datagrams.labels("in").inc(counters.datagrams_in)
        self.datagrams.labels("out").inc(counters.datagrams_out)
        self.datagram_bytes.labels("in").inc(counters.bytes_in)
        self.datagram_bytes.labels("out").inc(counters.bytes_out)
        for reason, count in counters.drops.items():
            self.datagram_drops.labels(reason).inc(count)

    def add_live(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Register gauges computed from live state at scrape time."""
        self.registry.register(_LiveCollector(collect))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    """A counter read from live state at scrape time (`name` without `_total`)."""
    return CounterMetricFamily(name, doc, labels=labels)
