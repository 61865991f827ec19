"""The server's refusals by policy: one counter by reason, one rate-limited log.

Whatever the server refuses by its own decision (an agent stream its egress or relay
policy does not allow, a direct backend on the protected floor, a node not admitted or
whose token was revoked, a handshake it is too busy for) is counted in
`nodeagent_server_refusals_total{reason}` and logged. The reasons are a fixed set the
server names and the log keys are (reason, node) pairs the server bounds, never text an
agent sends: a misbehaving agent can neither grow the metric's label set nor flood the
log (one line a minute per key).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as MetricCounter

from tunnel import protocol as p
from tunnel.errors import StreamFailed
from tunnel.log import RateLimitedLog, StructuredLogger

# The log line of each data-path refusal (`PolicyRefusals.forbid`), by its metric reason.
REFUSAL_LOG = {
    "egress_not_allowed": "agent stream refused: destination not allowed",
    "egress_protected": "agent stream refused: protected destination",
    "relay_not_allowed": "agent stream refused: relay not allowed",
    "backend_protected": "direct backend refused: protected destination",
}


class PolicyRefusals:
    """Counts and logs the server's refusals; `forbid` also builds the stream failure."""

    def __init__(self, registry: CollectorRegistry, log: StructuredLogger) -> None:
        self.counter = MetricCounter(
            "nodeagent_server_refusals_total", "Agent streams and registrations the "
            "server refused by policy, by reason", ["reason"], registry=registry)
        self._log = RateLimitedLog(log, period=60.0)

    def count(self, reason: str) -> None:
        self.counter.labels(reason).inc()

    def warning(self, key: str, message: str, **fields: Any) -> None:
        """Log `message` at most once a minute per `key` (a key the server bounds)."""
        self._log.warning(key, message, **fields)

    def forbid(self, reason: str, node: str, message: str, **fields: Any) -> StreamFailed:
        """Count a data-path refusal (`reason`: a key of REFUSAL_LOG), log it at most once
        a minute per (reason, node), and return the FORBIDDEN failure to raise."""
        self.count(reason)
        self._log.warning(f"{reason}:{node}", REFUSAL_LOG[reason],
                          reason=reason, node=node, problem=message, **fields)
        return StreamFailed(p.StreamReason.FORBIDDEN, message)
