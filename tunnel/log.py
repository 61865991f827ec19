"""Structured log calls for the tunnel: a message plus fields, on the standard library.

`nodeagent.ops.logs` formats these records as key=value or JSON; any other program using the
tunnel package sees ordinary log records whose fields sit in `record.nodeagent_fields`.
"""

from __future__ import annotations

import logging
from typing import Any

_FIELDS = "nodeagent_fields"


class StructuredLogger:
    """A named logger whose calls take fields as keyword arguments."""

    def __init__(self, name: str, **bound: Any) -> None:
        self._logger = logging.getLogger(name)
        self._bound = bound

    def bind(self, **fields: Any) -> StructuredLogger:
        """A logger that adds these fields to every line (e.g. node=, stream=)."""
        return StructuredLogger(self._logger.name, **{**self._bound, **fields})

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
