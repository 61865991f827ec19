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


# A server process spends a few ms of CPU per TLS + tunnel handshake (a core flat out
# admits a few hundred a second, and then nothing else gets done), so it admits 200/s by
# default (`python -m scripts.bench.reconnect_storm` measures it). Raise it on bigger
# machines (config: tunnel.handshake_rate).
DEFAULT_HANDSHAKE_RATE = 200.0
DEFAULT_HANDSHAKE_BURST = 200
MAX_RETRY_AFTER = 60.0


class HandshakeAdmission:
    """A token bucket over handshakes, and the retry-after for the ones it refuses.

    `admit(now)` returns None (admitted: one token taken) or the seconds to tell the dialer
    to wait. Refused dialers are given successive slots 1/rate apart, starting when the
    bucket will next hold a token, so they come back at about the rate the bucket admits;
    no answer is further than `max_retry_after` (slots beyond it are reused)."""

    def __init__(self, rate: float = DEFAULT_HANDSHAKE_RATE,
                 burst: int = DEFAULT_HANDSHAKE_BURST, *,
                 max_retry_after: float = MAX_RETRY_AFTER) -> None:
        if rate <= 0 or burst < 1 or max_retry_after <= 0:
            raise ValueError("need rate > 0, burst >= 1, max_retry_after > 0")
        self.rate, self.burst, self.max_retry_after = rate, burst, max_retry_after
        self._tokens = float(burst)
        self._last: float | None = None
        self._next_slot = 0.0
        self.admitted = 0
        self.refused = 0

    def admit(self, now: float) -> float | None:
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1:
            self._tokens -= 1
            self.admitted += 1
            return None
        self.refused += 1
        first = now + (1 - self._tokens) / self.rate  # when the bucket holds a token again
        slot = max(self._next_slot, first)
        if slot - now > self.max_retry_after:
            slot = first  # the schedule is full: start over rather than wait longer
        self._next_slot = slot + 1 / self.rate
        return min(slot - now, self.max_retry_after)
