"""The metrics and health listener every role can open on TCP (`metrics_listen`):
GET /metrics (Prometheus text), /healthz (200 while the process serves), /readyz (200 when
ready, else 503 saying why). The same JSON routes as the debug socket, on TCP."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import trio

from nodeagent.ops.jsonhttp import HttpStatus, JsonRoutes, serve_http
from nodeagent.ops.listener import Listener, socket_address
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.health")


class HealthServer(Listener):
    kind = "health"

    def __init__(self, registry: Any, ready: Callable[[], str | None], *,
                 host: str | None = None, port: int = 0) -> None:
        """`ready()` returns None when ready, else the reason it is not. `host`, `port`:
        where `run()` listens unless given there."""
        super().__init__("health")
        self._ready = ready
        self._routes = JsonRoutes({"/healthz": lambda: {"ok": True}, "/readyz": self._readyz},
                                  registry=registry)
        self.host = host
        self.port = port

    def _readyz(self) -> Any:
        reason = self._ready()
        return {"ready": True} if reason is None else HttpStatus(503, {"ready": False,
                                                                       "reason": reason})

    async def run(self, host: str | None = None, port: int | None = None, *,
                  task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        host = self.host if host is None else host
        port = self.port if port is None else port
        listeners = await trio.open_tcp_listeners(port, host=host)
        log.info("metrics and health listening", address=f"{host}:{port}")
        self.addresses = [socket_address(listener) for listener in listeners]
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, functools.partial(
                    serve_http, handler=self._routes), listeners)
                task_status.started(self.addresses)
        finally:
            self.addresses = []

    def details(self) -> dict[str, Any]:
        return {"routes": ["/metrics", "/healthz", "/readyz"]}
