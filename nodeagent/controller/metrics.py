"""The controller's Prometheus metrics: who asked for a certificate or a config watch, and
why a request was refused; how long a recompute takes; how often the Kubernetes watches
had to be opened again. Served by the metrics/health listener (`--metrics-listen`).

Every label value comes from a fixed set (kinds, outcomes, reason codes), never from
what a client sent, so the series stay bounded whatever clients do.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from nodeagent import __version__
from nodeagent.kube import Informer

# Buckets spanning a recompute for one changed Ingress up to a first recompute of a
# large cluster (`python -m scripts.bench.config_propagation` measures them).
RECOMPUTE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WatchRestarts(Collector):
    """nodeagent_controller_watch_restarts_total{resource, reason}: read at scrape time
    from the informers' own counts (`Informer.restarts`), so the kube package needs no
    metrics of its own."""

    def __init__(self, informers: Callable[[], Iterable[Informer]]) -> None:
        self._informers = informers

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "nodeagent_controller_watch_restarts",
            "Kubernetes watches opened again, by resource and reason (closed: the API "
            "server ended it; expired: 410 Gone, relisted; error: backed off)",
            labels=["resource", "reason"])
        totals: dict[tuple[str, str], int] = {}
        for informer in self._informers():
            for reason, count in informer.restarts.items():
                key = (informer.resource.plural, reason)
                totals[key] = totals.get(key, 0) + count
        for (resource, reason), count in sorted(totals.items()):
            family.add_metric([resource, reason], count)
        yield family


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        Info("nodeagent_build", "nodeagent version and role", registry=self.registry).info(
            {"version": __version__, "role": "controller"})
        self.certificate_requests = Counter(
            "nodeagent_controller_certificate_requests_total",
            "Certificate signing requests by kind (node, server, invalid), outcome "
            "(issued, refused) and reason code", ["kind", "outcome", "reason"],
            registry=self.registry)
        self.config_requests = Counter(
            "nodeagent_controller_config_requests_total",
            "Requests to the config stream listener by outcome (watching, refused) and "
            "reason code", ["outcome", "reason"], registry=self.registry)
        self.recompute_seconds = Histogram(
            "nodeagent_controller_recompute_seconds",
            "Duration of one config recompute (every node's config and the servers' "
            "routes from the caches; CPU only, no I/O)", buckets=RECOMPUTE_BUCKETS,
            registry=self.registry)
        self.refused_backends = Gauge(
            "nodeagent_controller_refused_backends",
            "Ingress backends left out of the latest config, by reason code: endpoint "
            "addresses not tied to a Pod of the Service's namespace on their node "
            "(no_target_ref, target_not_pod, other_namespace, pod_not_found, "
            "pod_uid_mismatch, pod_on_other_node, not_pod_address, host_port_undeclared), "
            "outside their node (off_node), without a node (nodeless), ExternalName "
            "Services (external_name), and Ingresses whose direct-backends annotation the "
            "admin did not allow (direct_not_allowed)", ["reason"], registry=self.registry)
        self._refused_reasons: set[str] = set()
        self.load_balancer_ports = Gauge(
            "nodeagent_controller_loadbalancer_ports",
            "Ports of LoadBalancer Services in the latest config, by state: served, or the "
            "port's error (PortConflict, PortReserved, UnsupportedProtocol, "
            "SourceRangesUnsupported)", ["state"], registry=self.registry)
        self._lb_states: set[str] = set()
        self.scale_to_zero = Counter(
            "nodeagent_controller_scale_to_zero_total",
            "Scale writes of sleepable workloads by this replica: sleep (the leader, to 0) "
            "and wake (asked by a server, back to the remembered count)", ["action"],
            registry=self.registry)

    def refused(self, counts: dict[str, int]) -> None:
        """The latest recompute's refused backends (reasons now absent read 0)."""
        self._refused_reasons.update(counts)
        for reason in self._refused_reasons:
            self.refused_backends.labels(reason).set(counts.get(reason, 0))

    def load_balancers(self, states: Iterable[str]) -> None:
        """The latest recompute's LoadBalancer Service ports, one state each."""
        counts = collections.Counter(states)
        self._lb_states.update(counts)
        for state in self._lb_states:
            self.load_balancer_ports.labels(state).set(counts.get(state, 0))

    def watch_informers(self, informers: Callable[[], Iterable[Informer]]) -> None:
        """Export the watch restarts of these informers (once per registry)."""
        self.registry.register(WatchRestarts(informers))

    def certificate(self, kind: str, reason: str) -> None:
        outcome = "issued" if reason == "issued" else "refused"
        self.certificate_requests.labels(kind, outcome, reason).inc()

    def config(self, reason: str) -> None:
        outcome = "watching" if reason == "watching" else (
            "report" if reason.startswith("report_") else "refused")
        self.config_requests.labels(outcome, reason).inc()
