"""Prometheus metrics of one nodeagent process (any role).

Counters are incremented where things happen; gauges that mirror live state (agents
connected, RTT, open streams) are read from the objects at scrape time by a collector,
so they can never drift from the truth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from nodeagent import __version__


class _LiveCollector(Collector):
    def __init__(self, collect: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[GaugeMetricFamily]:
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
        self.tunnel_connects = Counter(
            "nodeagent_tunnel_connects_total", "Tunnel handshakes completed",
            registry=self.registry)
        self.tunnel_failures = Counter(
            "nodeagent_tunnel_failures_total",
            "Tunnel dials or handshakes that failed, by reason", ["reason"],
            registry=self.registry)
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

    def add_live(self, collect: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        """Register gauges computed from live state at scrape time."""
        self.registry.register(_LiveCollector(collect))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)
