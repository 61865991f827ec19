"""Rate limits that need a clock: kept out of the sans-IO core, pure given `now`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OpenRateLimiter:
    """A token bucket: `rate` opens per second on average, bursts up to `burst`."""

    rate: float
    burst: float
    _tokens: float = field(default=-1.0, init=False)
    _last: float = field(default=0.0, init=False)

    def allow(self, now: float) -> bool:
        if self._tokens < 0:
            self._tokens, self._last = self.burst, now
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
