"""The metrics and health listener every role can open on TCP (`metrics_listen`):
GET /metrics (Prometheus text), /healthz (200 while the process serves), /readyz (200 when
ready, else 503 saying why). The same JSON routes as the debug socket, on TCP."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import trio

from nodeagent.ops.jsonhttp import HttpStatus, JsonRoutes, serve_http
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.health")


class HealthServer:
    def __init__(self, registry: Any, ready: Callable[[], str | None]) -> None:
        """`ready()` returns None when ready, else the reason it is not."""
        self._ready = ready
        self._routes = JsonRoutes({"/healthz": lambda: {"ok": True}, "/readyz": self._readyz},
                                  registry=registry)

    def _readyz(self) -> Any:
        reason = self._ready()
        return {"ready": True} if reason is None else HttpStatus(503, {"ready": False,
                                                                       "reason": reason})

    async def run(self, host: str, port: int, *,
                  task_status: trio.TaskStatus[list[trio.SocketListener]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        log.info("metrics and health listening", address=f"{host}:{port}")
        task_status.started(listeners)
        await trio.serve_listeners(functools.partial(serve_http, handler=self._routes),
                                   listeners)
