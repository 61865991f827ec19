"""Structured logging: one line per event, `key=value` (default) or JSON.

Every log call names what happened in a short message and carries the facts as fields:
`log.info("agent connected", node="edge-1", peer="10.0.0.7:51522")` prints
`2026-11-23T10:00:00.123Z info  server agent connected node=edge-1 peer=10.0.0.7:51522`.
It is a thin layer over the standard `logging` module so library logs show up too.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from tunnel.log import _FIELDS, StructuredLogger, get_logger

__all__ = ["StructuredLogger", "configure", "get_logger"]


def _quote(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' ="\n\t'):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        ts += f".{int(record.msecs):03d}Z"
        name = record.name.removeprefix("nodeagent.")
        parts = [ts, f"{record.levelname.lower():5}", name, record.getMessage()]
        fields: dict[str, Any] = getattr(record, _FIELDS, {})
        parts.extend(f"{k}={_quote(v)}" for k, v in fields.items())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in getattr(record, _FIELDS, {}).items():
            doc[k] = v if isinstance(v, int | float | bool | type(None)) else str(v)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure(level: str = "info", fmt: str = "text") -> None:
    """Set up the root handler once per process (called by the CLI)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Library chatter (httpx request lines, kubernetes client) stays at warning unless asked.
    for noisy in ("httpx", "httpcore", "kubernetes", "trio-websocket", "websockets", "hpack"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
