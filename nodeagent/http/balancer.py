"""Which backend of a route a new upstream connection goes to: round robin, failed ones
last, and those an active health check found unhealthy not at all while another is left
(docs/health-checks.md)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from nodeagent.http.routetable import Backend, Route
from nodeagent.ops.logs import get_logger
from tunnel.log import RateLimitedLog

_health_log = RateLimitedLog(get_logger("nodeagent.http"), period=60.0)


class Balancer:
    """Round robin over a route's backends, trying recently failed ones last.

    State is kept per route name (routes are rebuilt on every table swap) and per backend;
    both maps are cleared when they grow past `max_entries`, which only resets rotation.
    """

    def __init__(self, cooldown: float = 5.0, max_entries: int = 65536,
                 unhealthy: Callable[[Backend], bool] | None = None) -> None:
        self._cooldown = cooldown
        # Active health checks' verdicts (the server's BackendHealth): skipped while a
        # healthy or unknown backend remains; all unhealthy, all are tried as before.
        self._unhealthy = unhealthy
        self._max = max_entries
        self._next: dict[str, int] = {}
        self._failed: dict[Backend, float] = {}

    def candidates(self, route: Route) -> Sequence[Backend]:
        backends = route.backends
        if len(backends) <= 1:
            return backends
        i = self._next.get(route.name, 0)
        if len(self._next) >= self._max:
            self._next.clear()
        self._next[route.name] = i + 1
        i %= len(backends)
        order = backends[i:] + backends[:i]
        if self._unhealthy is not None:
            healthy = tuple(b for b in order if not self._unhealthy(b))
            if healthy:
                order = healthy
            else:
                _health_log.warning(route.name, "every backend of the route is unhealthy; "
                                    "trying them all", route=route.name, backends=len(order))
        if self._failed:
            now = time.monotonic()
            bad = [b for b in order if self._failed.get(b, 0.0) > now]
            if bad:
                order = tuple(b for b in order if b not in bad) + tuple(bad)
        return order

    def failed(self, backend: Backend) -> None:
        if len(self._failed) >= self._max:
            self._failed.clear()
        self._failed[backend] = time.monotonic() + self._cooldown

    def succeeded(self, backend: Backend) -> None:
        if self._failed:
            self._failed.pop(backend, None)


__all__ = ["Balancer"]
