"""Capped exponential backoff with jitter: the one retry policy of the code base (the
agent's reconnects, the Kubernetes informers, the config watch).

The n-th delay (from 0) is d·(1 - jitter·U) with d = min(maximum, initial·multiplierⁿ)
and U uniform in [0, 1): with the default jitter of 0.5 ("equal jitter") half of each
delay is fixed, so retries never bunch up at zero, and half is random, so a fleet of
agents cut off together does not come back in lockstep.
"""

from __future__ import annotations

import random


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
