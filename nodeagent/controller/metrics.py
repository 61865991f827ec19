"""The controller's Prometheus metrics: who asked for a certificate or a config watch, and
why a request was refused. Served by the metrics/health listener (`--metrics-listen`).

Every label value comes from a fixed set (kinds, outcomes, reason codes), never from
what a client sent, so the series stay bounded whatever clients do.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Info

from nodeagent import __version__


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

    def certificate(self, kind: str, reason: str) -> None:
        outcome = "issued" if reason == "issued" else "refused"
        self.certificate_requests.labels(kind, outcome, reason).inc()

    def config(self, reason: str) -> None:
        outcome = "watching" if reason == "watching" else "refused"
        self.config_requests.labels(outcome, reason).inc()
