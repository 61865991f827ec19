"""Active health checks on the agent, beside the backends (docs/health-checks.md).

A server opens a stream with purpose `health` (config/health.py has the contract) and
sends the targets it wants checked; this module checks each one (a TCP connect, or an
HTTP GET through h11) every interval within its timeout, runs the result through
`Thresholds` and writes a report line whenever a target's state changes. A new request
line replaces the checks; the checks end with the stream. Targets outside the node's
allow list are not probed: they are reported unhealthy ("not allowed"), as traffic to
them would be refused.

One task per target inside the stream's nursery, and one writer task fed by a bounded
channel (a trio stream takes one sender at a time).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

from nodeagent.config.health import (
    MAX_LINE,
    CheckedTarget,
    CheckRequest,
    HealthReport,
    State,
    Thresholds,
)
from nodeagent.ops.logs import StructuredLogger
from tunnel.tcp import DialFailed, connect_tcp

Allows = Callable[[str, int], bool]


@dataclass(slots=True)
class TargetHealth:
    """One target's checks as the debug view shows them."""

    check: CheckedTarget
    thresholds: Thresholds
    detail: str = ""
    checks: int = 0
    last_check: float = 0.0  # monotonic

    def as_dict(self) -> dict[str, Any]:
        return {"target": f"{self.check.host}:{self.check.port}",
                "kind": self.check.check.kind, "state": self.thresholds.state,
                "detail": self.detail, "checks": self.checks,
                "seconds_since_check": round(time.monotonic() - self.last_check, 1)
                if self.last_check else None}


@dataclass
class HealthChecks:
    """Every health stream this agent serves (one per server replica), for status and
    metrics."""

    streams: dict[int, dict[tuple[str, int], TargetHealth]] = field(default_factory=dict)
    results: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})

    def as_list(self) -> list[dict[str, Any]]:
        return [{"stream": stream_id, **t.as_dict()}
                for stream_id, targets in sorted(self.streams.items())
                for t in targets.values()]


async def probe(target: CheckedTarget, *, mark: int | None) -> str | None:
    """One check: None when it passed, else why not. Bounded by the caller's scope."""
    check = target.check
    try:
        stream = await connect_tcp(target.host, target.port, connect_timeout=None, mark=mark)
    except DialFailed as exc:
        return exc.message
    async with stream:
        if check.kind == "tcp":
            return None
        conn = h11.Connection(h11.CLIENT)
        host = f"[{target.host}]" if ":" in target.host else target.host
        request = h11.Request(method="GET", target=check.path, headers=[
            ("host", f"{host}:{target.port}"), ("user-agent", "nodeagent-health-check"),
            ("connection", "close")])
        try:
            await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(16384))
                    continue
                if isinstance(event, h11.Response):
                    if 200 <= event.status_code < 400:
                        return None
                    return f"GET {check.path} answered {event.status_code}"
                if isinstance(event, h11.ConnectionClosed):
                    return f"GET {check.path}: closed before a response"
        except (h11.RemoteProtocolError, trio.BrokenResourceError, OSError) as exc:
            return f"GET {check.path}: {exc}"


async def serve_health_stream(stream: trio.abc.Stream, stream_id: int, registry: HealthChecks,
                              *, allows: Allows, mark: int | None,
                              log: StructuredLogger) -> None:
    """Serve one server's health stream until it ends."""
    send, receive = trio.open_memory_channel[HealthReport](1024)
    targets: dict[tuple[str, int], TargetHealth] = {}
    registry.streams[stream_id] = targets
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write_reports, stream, receive)
            checks_scope: trio.CancelScope | None = None
            buffer = b""
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    chunk = b""
                if not chunk:
                    break
                buffer += chunk
                if len(buffer) > MAX_LINE:
                    log.warning("health stream: request line too long; closing",
                                stream=stream_id)
                    break
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    try:
                        request = CheckRequest.parse(line)
                    except ValueError as exc:
                        log.warning("health stream: bad request; closing", stream=stream_id,
                                    error=str(exc))
                        nursery.cancel_scope.cancel()
                        return
                    if checks_scope is not None:
                        checks_scope.cancel()
                    targets.clear()
                    checks_scope = trio.CancelScope()
                    nursery.start_soon(_run_checks, checks_scope, request, targets, send,
                                       registry, allows, mark)
                    log.info("health checks set", stream=stream_id,
                             targets=len(request.checks))
            nursery.cancel_scope.cancel()
    finally:
        registry.streams.pop(stream_id, None)
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(stream)


async def _write_reports(stream: trio.abc.Stream,
                         receive: trio.MemoryReceiveChannel[HealthReport]) -> None:
    async for report in receive:
        try:
            await stream.send_all(report.line())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return


async def _run_checks(scope: trio.CancelScope, request: CheckRequest,
                      targets: dict[tuple[str, int], TargetHealth],
                      send: trio.MemorySendChannel[HealthReport], registry: HealthChecks,
                      allows: Allows, mark: int | None) -> None:
    with scope:
        async with trio.open_nursery() as nursery:
            for checked in request.checks:
                key = (checked.host, checked.port)
                if key in targets:
                    continue  # one check per target: the first one asked wins
                health = TargetHealth(checked, Thresholds(
                    checked.check.healthy_threshold, checked.check.unhealthy_threshold))
                targets[key] = health
                if not allows(checked.host, checked.port):
                    health.thresholds.state = "unhealthy"
                    health.detail = "not allowed on this node"
                    send.send_nowait(_report(health))
                    continue
                nursery.start_soon(_check_forever, health, send, registry, mark)


async def _check_forever(health: TargetHealth, send: trio.MemorySendChannel[HealthReport],
                         registry: HealthChecks, mark: int | None) -> None:
    check = health.check.check
    while True:
        started = trio.current_time()
        failure: str | None = f"no answer within {check.timeout:g}s"
        with trio.move_on_after(check.timeout):
            failure = await probe(health.check, mark=mark)
        health.checks += 1
        health.last_check = time.monotonic()
        registry.results["ok" if failure is None else "failed"] += 1
        previous: State = health.thresholds.state
        changed = health.thresholds.observe(failure is None)
        if failure is not None or changed:
            health.detail = failure or ""
        if changed and previous != health.thresholds.state:
            await send.send(_report(health))
        await trio.sleep(max(0.0, check.interval - (trio.current_time() - started)))


def _report(health: TargetHealth) -> HealthReport:
    return HealthReport(host=health.check.host, port=health.check.port,
                        state=health.thresholds.state, detail=health.detail[:300])
