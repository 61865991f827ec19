"""Log a recurring event once per key per period, with how many were suppressed.

A client hammering a forbidden destination must not turn into a log line per attempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nodeagent.ops.logs import StructuredLogger


class RateLimitedLog:
    def __init__(self, logger: StructuredLogger, period: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 10_000) -> None:
        self._logger = logger
        self._period = period
        self._clock = clock
        self._max_keys = max_keys
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, **fields: Any) -> bool:
        """Log unless `key` was logged within the period; True if it was logged."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._period:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        if len(self._last) >= self._max_keys:
            # Bounded memory whatever the key space: forget the oldest half.
            for old in sorted(self._last, key=self._last.__getitem__)[: self._max_keys // 2]:
                self._last.pop(old, None)
                self._suppressed.pop(old, None)
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            fields["suppressed_since_last"] = suppressed
        self._logger.warning(msg, **fields)
        return True
