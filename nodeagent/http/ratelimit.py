"""Request rate limits of a route, pure: token buckets read with a clock the caller passes.

`TokenBucket(rate, burst)` holds up to `burst` tokens and gains `rate` a second; a request
takes one, or learns how long until one is there (the Retry-After). `RateLimiter` keeps
one bucket for the route and one per client key (bounded: past `max_clients`, the buckets
of idle clients, which are full and so forget nothing, are dropped first, then the oldest
half). No clock and no I/O here, so every case is tested with made-up times.
"""

from __future__ import annotations

import math
from typing import Literal

LimitReason = Literal["rate_limited", "rate_limited_client"]


class TokenBucket:
    """`burst` tokens at most, `rate` more each second; starts full."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def refill(self, now: float) -> float:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        return self.tokens

    def take(self, now: float, amount: float = 1.0) -> float:
        """0.0 if `amount` tokens were taken, else the seconds until they would be there."""
        tokens = self.refill(now)
        if tokens >= amount:
            self.tokens = tokens - amount
            return 0.0
        return (amount - tokens) / self.rate


def retry_after(wait: float) -> int:
    """Whole seconds for a Retry-After header: at least 1."""
    return max(1, math.ceil(wait))


class RateLimiter:
    """A route's buckets: all clients together, and each client."""

    def __init__(self, *, rate: float | None, burst: int | None,
                 per_client_rate: float | None, per_client_burst: int | None,
                 max_clients: int = 100_000) -> None:
        self.rate, self.per_client_rate = rate, per_client_rate
        self.burst = float(burst if burst is not None else max(1, math.ceil(rate or 1)))
        self.per_client_burst = float(per_client_burst if per_client_burst is not None
                                      else max(1, math.ceil(per_client_rate or 1)))
        self.route: TokenBucket | None = None
        self.clients: dict[str, TokenBucket] = {}
        self.max_clients = max_clients
        self.limited: dict[LimitReason, int] = {"rate_limited": 0, "rate_limited_client": 0}

    def check(self, client: str, now: float) -> tuple[LimitReason, float] | None:
        """None: the request may go on (it took its tokens). Else why not and how long
        until it could. The client's bucket is checked first, so one client over its own
        limit does not spend the route's tokens."""
        rate = self.per_client_rate
        bucket: TokenBucket | None
        if rate is not None:
            bucket = self.clients.get(client)
            if bucket is None:
                if len(self.clients) >= self.max_clients:
                    self._evict(now)
                bucket = self.clients[client] = TokenBucket(rate, self.per_client_burst, now)
            wait = bucket.take(now)
            if wait:
                self.limited["rate_limited_client"] += 1
                return "rate_limited_client", wait
        if self.rate is not None:
            bucket = self.route
            if bucket is None:
                bucket = self.route = TokenBucket(self.rate, self.burst, now)
            wait = bucket.take(now)
            if wait:
                self.limited["rate_limited"] += 1
                return "rate_limited", wait
        return None

    def _evict(self, now: float) -> None:
        clients = self.clients
        for key in [k for k, b in clients.items() if b.refill(now) >= b.burst]:
            del clients[key]  # full again: dropping it changes nothing for that client
        if len(clients) >= self.max_clients:
            for key in list(clients)[: len(clients) // 2 + 1]:
                del clients[key]

    def as_dict(self) -> dict[str, object]:
        return {"rate": self.rate, "burst": self.burst if self.rate is not None else None,
                "per_client_rate": self.per_client_rate,
                "per_client_burst": self.per_client_burst
                if self.per_client_rate is not None else None,
                "clients_tracked": len(self.clients), "limited": dict(self.limited)}


__all__ = ["LimitReason", "RateLimiter", "TokenBucket", "retry_after"]
