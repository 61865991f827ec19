"""The server's side of active health checks (docs/health-checks.md): which backends the
routes want checked (`wanted_checks`, pure), one stream per node asking its agent to
check them (`HealthWatch`), and the states the agents report (`BackendHealth`), which the
HTTP balancer reads to skip unhealthy backends.

The agent checks beside the backend; the server only listens. A node's states go back
to unknown (not skipped) when its stream ends: with no agent there is no traffic to
steer, and a stale "healthy" or "unhealthy" would outlive what it described.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from nodeagent.config import RoutesConfig
from nodeagent.config.connect import PURPOSE_KEY
from nodeagent.config.health import (
    HEALTH_PURPOSE,
    HEALTH_TARGET_HOST,
    MAX_LINE,
    CheckedTarget,
    CheckRequest,
    HealthCheck,
    HealthReport,
    State,
)
from nodeagent.http.routetable import Backend
from nodeagent.ops.logs import StructuredLogger
from tunnel import protocol as p
from tunnel.errors import StreamFailed
from tunnel.log import RateLimitedLog
from tunnel.stream import TunnelStream

OpenStream = Callable[[str, p.Target, dict[str, str]], Awaitable[TunnelStream]]
WaitForNode = Callable[[str], Awaitable[object]]
RETRY_SECONDS = 5.0  # after a health stream failed or ended with the agent still there


def wanted_checks(routes: RoutesConfig) -> dict[str, tuple[CheckedTarget, ...]]:
    """Per node, the targets its agent should check: every backend behind a node of an
    HTTP route, TCP mapping or Ingress rule that has a health check (the first check
    named for a target wins)."""
    found: dict[str, dict[tuple[str, int], CheckedTarget]] = {}

    def want(node: str | None, host: str, port: int, check: HealthCheck | None) -> None:
        if node is not None and check is not None:
            found.setdefault(node, {}).setdefault(
                (host, port), CheckedTarget(host=host, port=port, check=check))

    for listener in routes.http:
        for route in listener.routes:
            want(route.node, route.target.host, route.target.port, route.health_check)
    for mapping in routes.tcp:
        want(mapping.node, mapping.target.host, mapping.target.port, mapping.health_check)
    rules = routes.ingress.rules + ((routes.ingress.default_backend,)
                                    if routes.ingress.default_backend else ())
    for rule in rules:
        for backend in rule.backends:
            want(backend.node, backend.target.host, backend.target.port, rule.health_check)
    for service in routes.load_balancers:
        for port in service.ports:
            for backend in port.backends:
                want(backend.node, backend.target.host, backend.target.port,
                     port.health_check)
    return {node: tuple(targets.values()) for node, targets in sorted(found.items())}


@dataclass(slots=True)
class Reported:
    state: State
    detail: str
    since: float  # wall clock


class BackendHealth:
    """The states agents report, by (node, host, port)."""

    def __init__(self) -> None:
        self.states: dict[tuple[str, str, int], Reported] = {}

    def unhealthy(self, backend: Backend) -> bool:
        if backend.node is None:
            return False
        reported = self.states.get((backend.node, backend.host, backend.port))
        return reported is not None and reported.state == "unhealthy"

    def forget(self, node: str) -> None:
        for key in [k for k in self.states if k[0] == node]:
            del self.states[key]

    def as_list(self) -> list[dict[str, Any]]:
        return [{"node": node, "target": f"{host}:{port}", "state": r.state,
                 "detail": r.detail, "since": round(r.since, 3)}
                for (node, host, port), r in sorted(self.states.items())]


class HealthWatch:
    """One task per node with checks: holds a health stream to its agent while it is
    connected, sends the node's checks, records the reports."""

    def __init__(self, *, open_stream: OpenStream, wait_for_node: WaitForNode,
                 health: BackendHealth, log: StructuredLogger) -> None:
        self._open_stream = open_stream
        self._wait_for_node = wait_for_node
        self.health = health
        self.log = log
        self._log = RateLimitedLog(log, period=60.0)
        self._nursery: trio.Nursery | None = None
        self._wanted: dict[str, tuple[CheckedTarget, ...]] = {}
        self._watches: dict[str, trio.CancelScope] = {}
        self._stopped = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._restart(self._wanted, {})
            task_status.started()
            await trio.sleep_forever()

    def stop(self) -> None:
        """The server drains: end every health stream (long-lived streams of its own,
        which a drain must not wait for) and open no more."""
        self._stopped = True
        for scope in self._watches.values():
            scope.cancel()
        self._watches.clear()

    def update(self, routes: RoutesConfig) -> None:
        """The routes changed: restart the watches of nodes whose checks changed."""
        wanted = wanted_checks(routes)
        old, self._wanted = self._wanted, wanted
        if self._nursery is not None and not self._stopped:
            self._restart(wanted, old)

    def _restart(self, wanted: dict[str, tuple[CheckedTarget, ...]],
                 old: dict[str, tuple[CheckedTarget, ...]]) -> None:
        assert self._nursery is not None
        for node in set(old) | set(self._watches):
            if node not in wanted or wanted[node] != old.get(node):
                scope = self._watches.pop(node, None)
                if scope is not None:
                    scope.cancel()
                self.health.forget(node)
        for node, checks in wanted.items():
            if node not in self._watches:
                scope = trio.CancelScope()
                self._watches[node] = scope
                self._nursery.start_soon(self._watch, node, checks, scope)

    async def _watch(self, node: str, checks: tuple[CheckedTarget, ...],
                     scope: trio.CancelScope) -> None:
        with scope:
            while True:
                await self._wait_for_node(node)
                try:
                    stream = await self._open_stream(
                        node, p.Target(HEALTH_TARGET_HOST, 1), {PURPOSE_KEY: HEALTH_PURPOSE})
                except StreamFailed as exc:
                    # An agent from before health checks refuses the stream (forbidden).
                    self._log.warning(f"open:{node}", "health stream refused; no active "
                                      "checks for this node", node=node, reason=exc.outcome,
                                      error=exc.message)
                    await trio.sleep(RETRY_SECONDS)
                    continue
                try:
                    await self._follow(node, stream, checks)
                finally:
                    self.health.forget(node)
                    with trio.CancelScope(shield=True):
                        await trio.aclose_forcefully(stream)
                await trio.sleep(RETRY_SECONDS)

    async def _follow(self, node: str, stream: TunnelStream,
                      checks: tuple[CheckedTarget, ...]) -> None:
        try:
            await stream.send_all(CheckRequest(checks=checks).line())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        self.log.info("health checks asked", node=node, targets=len(checks))
        wanted = {(c.host, c.port) for c in checks}
        buffer = b""
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not chunk:
                return
            buffer += chunk
            if len(buffer) > MAX_LINE:
                self._log.warning(f"bad:{node}", "health stream: report too long", node=node)
                return
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    report = HealthReport.parse(line)
                except ValueError as exc:
                    self._log.warning(f"bad:{node}", "health stream: bad report", node=node,
                                      error=str(exc))
                    return
                if (report.host, report.port) not in wanted:
                    continue  # only what was asked: an agent cannot grow the table
                self.health.states[(node, report.host, report.port)] = Reported(
                    report.state, report.detail, time.time())
                self.log.info("backend health changed", node=node,
                              target=f"{report.host}:{report.port}", state=report.state,
                              detail=report.detail)
