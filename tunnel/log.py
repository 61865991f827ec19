"""Structured log calls for the tunnel: a message plus fields, on the standard library.

`nodeagent.ops.logs` formats these records as key=value or JSON; any other program using the
tunnel package sees ordinary log records whose fields sit in `record.nodeagent_fields`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

_FIELDS = "nodeagent_fields"


class StructuredLogger:
    """A named logger whose calls take fields as keyword arguments."""

    def __init__(self, name: str, **bound: Any) -> None:
        self._logger = logging.getLogger(name)
        self._bound = bound

    def bind(self, **fields: Any) -> StructuredLogger:
        """A logger that adds these fields to every line (e.g. node=, stream=). Cheap (no
        logging.getLogger lookup and its lock): relays bind one per connection."""
        bound = StructuredLogger.__new__(StructuredLogger)
        bound._logger = self._logger
        bound._bound = {**self._bound, **fields}
        return bound

    def _log(self, level: int, msg: str, fields: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(level):
            exc_info = fields.pop("exc_info", None)
            self._logger.log(level, msg, extra={_FIELDS: {**self._bound, **fields}},
                             exc_info=exc_info)

    def debug(self, msg: str, **fields: Any) -> None:
        self._log(logging.DEBUG, msg, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._log(logging.INFO, msg, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._log(logging.WARNING, msg, fields)

    def error(self, msg: str, **fields: Any) -> None:
        self._log(logging.ERROR, msg, fields)

    def isEnabledFor(self, level: int) -> bool:
        return self._logger.isEnabledFor(level)


def get_logger(name: str, **bound: Any) -> StructuredLogger:
    return StructuredLogger(name, **bound)


class RateLimitedLog:
    """Log a recurring event once per key per period, with how many were suppressed.

    A client hammering a forbidden destination, or a scanner making bad handshakes, must
    not turn into a log line per attempt. Keys should come from a small set (a reason
    code, a configured name), not from what a peer sends: memory is bounded either way
    (the oldest half is forgotten at `max_keys`), but every new key is a new line.
    """

    def __init__(self, logger: StructuredLogger, period: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 10_000,
                 burst: int = 1) -> None:
        """At most `burst` lines per key per `period`."""
        self._logger = logger
        self._period = period
        self._clock = clock
        self._max_keys = max_keys
        self._burst = burst
        self._last: dict[str, float] = {}  # when the key's current period started
        self._count: dict[str, int] = {}  # lines logged in it
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, **fields: Any) -> bool:
        """Log unless `key` was logged within the period; True if it was logged."""
        return self._log(self._logger.warning, key, msg, fields)

    def error(self, key: str, msg: str, **fields: Any) -> bool:
        """As warning(), at error level."""
        return self._log(self._logger.error, key, msg, fields)

    def _log(self, emit: Callable[..., None], key: str, msg: str,
             fields: dict[str, Any]) -> bool:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._period:
            if self._count.get(key, 0) >= self._burst:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._count[key] = self._count.get(key, 0) + 1
        else:
            if len(self._last) >= self._max_keys:
                # Bounded memory whatever the key space: forget the oldest half.
                for old in sorted(self._last, key=self._last.__getitem__)[: self._max_keys // 2]:
                    self._last.pop(old, None)
                    self._count.pop(old, None)
                    self._suppressed.pop(old, None)
            self._last[key] = now
            self._count[key] = 1
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            fields["suppressed_since_last"] = suppressed
        emit(msg, **fields)
        return True
