"""Which backend of a route a new upstream connection goes to: round robin, failed ones last."""

from __future__ import annotations

import time
from collections.abc import Sequence

from nodeagent.http.routetable import Backend, Route


class Balancer:
    """Round robin over a route's backends, trying recently failed ones last.

    State is kept per route name (routes are rebuilt on every table swap) and per backend;
    both maps are cleared when they grow past `max_entries`, which only resets rotation.
    """

    def __init__(self, cooldown: float = 5.0, max_entries: int = 65536) -> None:
        self._cooldown = cooldown
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
