"""The metrics and health listener every role can open on TCP (`metrics_listen`):
GET /metrics (Prometheus text), /healthz (200 while the process serves), /readyz (200 when
ready, else 503 saying why). The same small h11 server as the debug socket, on TCP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from nodeagent.ops.debug import DebugServer, HttpStatus
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.health")


class HealthServer:
    def __init__(self, registry: Any, ready: Callable[[], str | None]) -> None:
        """`ready()` returns None when ready, else the reason it is not."""
        self._ready = ready
        # DebugServer's path is unused here: only its HTTP handling is.
        self._http = DebugServer("", {"/healthz": lambda: {"ok": True},
                                      "/readyz": self._readyz}, registry=registry)

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
        await trio.serve_listeners(self._http.serve_connection, listeners)
