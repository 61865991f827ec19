"""Retry delays: capped exponential backoff with jitter (`Backoff`, the one retry schedule
of the code base: the agent's reconnects, the Kubernetes informers, the config watch) and
the agent's reconnect policy (`ReconnectPolicy`), which picks a schedule by what failed.

`Backoff`: the n-th delay (from 0) is d·(1 - jitter·U) with d = min(maximum,
initial·multiplierⁿ) and U uniform in [0, 1): with the default jitter of 0.5 ("equal
jitter") half of each delay is fixed, so retries never bunch up at zero, and half is
random, so a fleet of agents cut off together does not come back in lockstep.

`ReconnectPolicy`, and why. A node must be back within ~2 s of its server being reachable
again however long the outage was, and 5,000 nodes coming back at once must not overload
the server. One growing backoff cannot do both: after a 20 s outage it had grown toward
its 15 s cap, so a node needed 4.5-10.7 s more once the server was back (measured). So the
delay depends on what the last attempt cost the server:

- unreachable (TCP connect refused or timed out, no route, DNS, the connection cut before
  the server answered our HELLO, a proxy answering 502-504): the server spent nothing on
  us, so retry soon: backoff from `initial` capped at `unreachable_maximum` (default 1 s,
  equal jitter: every 0.5-1 s). A TCP connect gets 2 s (tunnel.client), so a path that
  drops packets is retried too, not waited on through the kernel's SYN retries at 1, 3,
  7 s. A fleet of 5,000
  polling a dead address costs ~5,000 SYNs/s for the kernel: nothing. When the server
  returns they all arrive within one cap, and its admission control sorts them out:
- overloaded (the server refused the handshake with a retry-after): it told us when it
  has room; wait that long, spread by `retry_after_jitter` (a delay in [t, t·(1+j)]) so
  agents given the same time do not return in lockstep. The server spaces its answers
  out at the rate it admits, so 5,000 agents come back as fast as it can take them;
- rejected (TLS failed, credentials refused, version mismatch, no answer to HELLO, an
  error we do not know): retrying soon would not help and costs the server a TLS
  handshake each time, so back off from `initial` to `maximum` (default 15 s);
- a connection that was up and ended: the first retry is at `initial` (the server may
  just have restarted), then as above; a drain (GOAWAY) dials at once, the old
  connection finishing its streams meanwhile; a REPLACED connection waits `maximum`.

Every successful handshake resets both schedules.
"""

from __future__ import annotations

import random
from enum import Enum


class Backoff:
    def __init__(self, initial: float = 0.2, maximum: float = 15.0, *,
                 multiplier: float = 2.0, jitter: float = 0.5,
                 rng: random.Random | None = None) -> None:
        if not (0 < initial <= maximum and multiplier >= 1 and 0 <= jitter <= 1):
            raise ValueError("need 0 < initial <= maximum, multiplier >= 1, 0 <= jitter <= 1")
        self.initial, self.maximum = initial, maximum
        self.multiplier, self.jitter = multiplier, jitter
        self._rng = rng or random.Random()
        self.attempts = 0

    def next_delay(self) -> float:
        base = min(self.maximum, self.initial * self.multiplier ** min(self.attempts, 64))
        self.attempts += 1
        return base * (1.0 - self.jitter * self._rng.random())

    def reset(self) -> None:
        self.attempts = 0

    def to_maximum(self) -> None:
        """The next delays are the longest (until reset)."""
        self.attempts = 64


class Failure(Enum):
    """What the last attempt ran into; it picks the next delay (see the module doc)."""

    UNREACHABLE = "unreachable"
    OVERLOADED = "overloaded"
    REJECTED = "rejected"


# The defaults of the agent's `reconnect` config section.
DEFAULT_INITIAL = 0.2
DEFAULT_MAXIMUM = 15.0
DEFAULT_UNREACHABLE_MAXIMUM = 1.0
DEFAULT_RETRY_AFTER_JITTER = 0.5


class ReconnectPolicy:
    """The delay before the next dial, by what the last one ran into."""

    def __init__(self, initial: float = DEFAULT_INITIAL, maximum: float = DEFAULT_MAXIMUM,
                 *, unreachable_maximum: float = DEFAULT_UNREACHABLE_MAXIMUM,
                 retry_after_jitter: float = DEFAULT_RETRY_AFTER_JITTER,
                 rng: random.Random | None = None) -> None:
        if not 0 <= retry_after_jitter <= 10:
            raise ValueError("retry_after_jitter must be in [0, 10]")
        self._rng = rng or random.Random()
        # Never slower than the rejected schedule, never faster than its first step.
        cap = max(initial, min(unreachable_maximum, maximum))
        self.unreachable = Backoff(initial, cap, rng=self._rng)
        self.rejected = Backoff(initial, maximum, rng=self._rng)
        self.retry_after_jitter = retry_after_jitter

    @property
    def maximum(self) -> float:
        return self.rejected.maximum

    def delay(self, failure: Failure, retry_after: float | None = None) -> float:
        if failure is Failure.OVERLOADED and retry_after is not None:
            return retry_after * (1.0 + self.retry_after_jitter * self._rng.random())
        if failure is Failure.UNREACHABLE:
            return self.unreachable.next_delay()
        return self.rejected.next_delay()

    def reset(self) -> None:
        self.unreachable.reset()
        self.rejected.reset()

    def to_maximum(self) -> None:
        """The next delay after a rejection is the longest (until reset)."""
        self.rejected.to_maximum()
