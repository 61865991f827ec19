"""Requests held for sleeping routes (scale to zero), and the activity of those routes.

A route whose Service sleeps has `wake` set and no backends. A request for it is held
here instead of answered 503: `HeldRequests.hold` counts it against the route's
`max_pending` (over it: 503 with Retry-After), marks the Service wanted (whoever wakes
Services, the server's controller link, reads `wanted()` after `wanted_changed`), and
waits, without polling, for the next route table swap (`routes_changed`, called by the
table's owner after every swap). After each swap it looks the request up again: a route
with backends is forwarded; a route whose workload fails to start answers 502 with the
controller's reason; a deadline of the route's `timeout` answers 504 naming the route.

Activity (`begin`/`end` around each request forwarded to a route with `wake`): the last
request and the requests in flight per Service, which the server reports to the
controller so that it never puts a busy Service to sleep. Routes without `wake` cost
nothing here.

`hold` does not care what it waits for: `recheck` returns anything that is not a
`Refusal` once there is somewhere to go (an HTTP `Route`, a TCP mapping), so the HTTP
fronts and held TCP connections (`server/heldconnections.py`) share it. `dial_woken`
is the step after: the first dial to a woken backend, retried while its node refuses
it (see there why). No I/O of its own: trio events and sleeps only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from nodeagent.http.dispatch import Refusal
from nodeagent.http.routetable import WakeSpec
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.http.holds")

# Buckets of the cold-start histogram (seconds from the first held request to forward).
COLD_START_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, math.inf)
# A woken backend's refused first dials are tried again after this long, growing by half
# each time up to the most (a refused dial is a stream opened and refused in the tunnel).
REDIAL_FIRST, REDIAL_MOST = 0.01, 0.1

T = TypeVar("T")
D = TypeVar("D")


@dataclass
class HoldStats:
    held: int = 0  # requests held, ever
    forwarded: int = 0  # held requests forwarded once the route woke
    timeouts: int = 0  # held until the wake timeout: 504
    overflowed: int = 0  # refused over max-pending: 503
    failed: int = 0  # the workload failed to start: 502
    cold_starts: list[int] = field(default_factory=lambda: [0] * len(COLD_START_BUCKETS))
    cold_start_sum: float = 0.0

    def observe_cold_start(self, seconds: float) -> None:
        for i, bound in enumerate(COLD_START_BUCKETS):
            if seconds <= bound:
                self.cold_starts[i] += 1
                break
        self.cold_start_sum += seconds


class HeldRequests:
    """See the module docstring. One per server process, shared by its HTTP fronts."""

    def __init__(self, clock: Callable[[], float] = trio.current_time) -> None:
        self._clock = clock
        self._changed = trio.Event()
        self.wanted_changed = trio.Event()
        self.pending: dict[str, int] = {}  # service → requests held now
        self.since: dict[str, float] = {}  # service → when its first held request came
        self.in_flight: dict[str, int] = {}  # service → forwarded requests not done
        self.last_request: dict[str, float] = {}  # service → clock of its last request
        # service → until when it is wanted without a held request (starting pages)
        self.poked: dict[str, float] = {}
        self.stats = HoldStats()

    # -- the route tables' owner --------------------------------------------------------

    def routes_changed(self) -> None:
        """A new route table is in force: every held request looks again."""
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    # -- whoever wakes Services ---------------------------------------------------------

    def wanted(self) -> dict[str, float]:
        """Services with requests held now, or a starting page shown lately → since when
        (clock)."""
        now = self._clock()
        for service in [s for s, until in self.poked.items() if until <= now]:
            del self.poked[service]
        wanted = {s: now for s in self.poked}
        wanted.update((s, self.since[s]) for s, n in self.pending.items() if n > 0)
        return wanted

    def poke(self, wake: WakeSpec) -> None:
        """A starting page went out for `wake`'s route: wanted (woken) without a held
        request, for as long as a held request would wait."""
        service = wake.service
        now = self._clock()
        self.last_request[service] = now
        fresh = service not in self.poked and not self.pending.get(service)
        self.poked[service] = now + wake.timeout
        if fresh:
            self.wanted_changed.set()
            self.wanted_changed = trio.Event()

    def activity(self) -> dict[str, tuple[float | None, int]]:
        """Service → (seconds since its last request or None, requests in flight), for
        every Service with `wake` that had a request or has one held or in flight."""
        now = self._clock()
        keys = set(self.last_request) | {s for s, n in self.in_flight.items() if n} | {
            s for s, n in self.pending.items() if n}
        return {s: (now - self.last_request[s] if s in self.last_request else None,
                    self.in_flight.get(s, 0) + self.pending.get(s, 0)) for s in keys}

    # -- per request --------------------------------------------------------------------

    def begin(self, wake: WakeSpec) -> None:
        service = wake.service
        self.in_flight[service] = self.in_flight.get(service, 0) + 1
        self.last_request[service] = self._clock()

    def end(self, wake: WakeSpec) -> None:
        service = wake.service
        left = self.in_flight.get(service, 1) - 1
        if left > 0:
            self.in_flight[service] = left
        else:
            self.in_flight.pop(service, None)
        self.last_request[service] = self._clock()

    async def hold(self, refusal: Refusal, recheck: Callable[[], T | Refusal]
                   ) -> T | Refusal:
        """Hold a request (or connection) that `refusal` (a sleeping route's 503, `wake`
        set) turned away until `recheck()` gives somewhere to go (anything but a
        Refusal: the route with backends); that, or the refusal to answer instead."""
        wake = refusal.wake
        assert wake is not None
        service = wake.service
        stats = self.stats
        held = self.pending.get(service, 0)
        self.last_request[service] = self._clock()
        if held >= wake.max_pending:
            stats.overflowed += 1
            return Refusal(503, f"route {refusal.route} is starting and {held} requests "
                           f"already wait for it; retry later", retry_after=max(
                               1, math.ceil(wake.timeout / 4)), route=refusal.route)
        started = self._clock()
        self.pending[service] = held + 1
        if held == 0:
            self.since[service] = started
            self.wanted_changed.set()
            self.wanted_changed = trio.Event()
        stats.held += 1
        deadline = started + wake.timeout
        try:
            while True:
                changed = self._changed
                result = recheck()
                if type(result) is not Refusal:
                    stats.forwarded += 1
                    stats.observe_cold_start(self._clock() - self.since.get(service, started))
                    if log.isEnabledFor(logging.DEBUG):  # the steps of a wake, timed in logs
                        log.debug("held request released", service=service,
                                  held=f"{(self._clock() - started) * 1e3:.1f}ms")
                    return result
                if result.wake is None or result.wake.service != service:
                    if result.status == 502:
                        stats.failed += 1
                    return result  # gone, failing, or no longer sleeping: its own answer
                with trio.move_on_at(deadline) as scope:
                    await changed.wait()
                if scope.cancelled_caught:
                    stats.timeouts += 1
                    return Refusal(504, f"route {refusal.route} (Service {service}) did "
                                   f"not wake within {wake.timeout:g}s", route=refusal.route)
        finally:
            left = self.pending[service] - 1
            if left:
                self.pending[service] = left
            else:
                del self.pending[service]
                self.since.pop(service, None)

    def as_dict(self) -> dict[str, Any]:
        """For the debug socket and metrics."""
        now = self._clock()
        stats = self.stats
        return {"held_now": {s: {"requests": n, "waiting_seconds": round(
            now - self.since.get(s, now), 3)} for s, n in sorted(self.pending.items())},
            "in_flight": dict(sorted(self.in_flight.items())),
            "held": stats.held, "forwarded": stats.forwarded, "timeouts": stats.timeouts,
            "overflowed": stats.overflowed, "failed": stats.failed}


async def dial_woken(target: T, recheck: Callable[[], T | Refusal],
                     dial: Callable[[T], Awaitable[D]], deadline: float,
                     refused: type[Exception] | tuple[type[Exception], ...]
                     ) -> tuple[T, D] | Refusal:
    """The first dial to a backend that just woke: (target, what `dial(target)` gave), or
    the refusal `recheck()` came to meanwhile (the route went away or fell asleep).

    The servers' routes and the node's allow list reach the two on streams of their own:
    a woken backend may be in this server's table a moment before its agent lets it be
    dialed (measured: 10-70 ms later on a busy 2-core machine). A dial that fails with
    `refused` is tried again, on `recheck()`'s fresh target, often at first and then at
    most every REDIAL_MOST, until `deadline` (the held request's wake deadline): then
    the last failure is raised."""
    delay = REDIAL_FIRST
    started, attempts = trio.current_time(), 1
    while True:
        try:
            dialed = await dial(target)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("woken backend dialed", attempts=attempts,
                          took=f"{(trio.current_time() - started) * 1e3:.1f}ms")
            return target, dialed
        except refused:
            if trio.current_time() + delay > deadline:
                raise
        await trio.sleep(delay)
        delay = min(delay * 1.5, REDIAL_MOST)
        again = recheck()
        if isinstance(again, Refusal):
            return again
        target = again
        attempts += 1
