"""Scale to zero, the server's half toward the controller (controller mode): report the
activity of the sleepable routes every `activity_interval` (the controller never puts a
Service to sleep while a server reports requests in flight or recent ones), and ask the
controller to wake every Service that has requests held here (`http.holds`).

A wake request is idempotent on the controller's side (one scale patch however many
servers and requests ask), so asking again is always safe: a Service still wanted
`REASK` seconds after the controller answered is asked again (the controller may have
restarted mid-wake), and one the controller could not be reached for is asked again
after a short backoff, for as long as requests wait; they time out on their own
(`WakeRoute.timeout`) whatever happens here.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from nodeagent.configstream.client import PostError
from nodeagent.configstream.protocol import (
    ACTIVITY,
    MAX_REPORT_SERVICES,
    WAKE,
    activity_body,
    report_path,
    wake_body,
)
from nodeagent.http.holds import HeldRequests
from nodeagent.ops.logs import StructuredLogger
from tunnel.backoff import Backoff
from tunnel.log import RateLimitedLog

REASK = 5.0  # seconds before a still-wanted Service is asked for again
# A Service with no request for this long drops out of the reports (the controller keeps
# its own record of the last request).
FORGET_AFTER = 24 * 3600.0
REPORT_RECHECK = 0.5  # seconds: how soon a shorter activity interval takes effect

Post = Callable[[str, bytes], Awaitable[tuple[int, dict[str, Any]]]]


class WakeClient:
    def __init__(self, holds: HeldRequests, post: Post, server_id: str,
                 interval: Callable[[], float], log: StructuredLogger) -> None:
        self.holds = holds
        self.post = post
        self.server_id = server_id
        self.interval = interval
        self.log = log
        self._limited = RateLimitedLog(log)
        self.asked = 0  # wake requests the controller answered
        self.failed = 0  # wake requests without an answer (retried)
        self.reports = 0  # activity reports the controller took

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report_forever)
            nursery.start_soon(self._wake_forever)

    async def report(self) -> None:
        """Post the current activity, in chunks the controller accepts."""
        holds = self.holds
        activity = holds.activity()
        for service, (idle, _) in list(activity.items()):
            if idle is not None and idle > FORGET_AFTER and not holds.in_flight.get(service):
                holds.last_request.pop(service, None)
                del activity[service]
        items = sorted(activity.items())
        for start in range(0, len(items), MAX_REPORT_SERVICES):
            chunk = dict(items[start:start + MAX_REPORT_SERVICES])
            status, doc = await self.post(report_path(self.server_id, ACTIVITY),
                                          activity_body(chunk))
            if status != 200:
                raise PostError(f"controller answered {status}: {doc.get('error')}")
            self.reports += 1

    async def _report_forever(self) -> None:
        last = trio.current_time()
        while True:
            # The interval comes with the routes: a server starts on the default (10 s)
            # and learns the cluster's (often under a second) from its first config. Slept
            # whole, that first default held every report back ~10 s, long enough for the
            # leader to take a Service with a connection open for idle. So the wait is
            # looked at again every REPORT_RECHECK seconds (a poll: the routes that carry
            # the interval are replaced whole, with no event to wait for).
            while (wait := last + self.interval() - trio.current_time()) > 0:  # noqa: ASYNC110
                await trio.sleep(min(wait, REPORT_RECHECK))
            last = trio.current_time()
            try:
                await self.report()
            except PostError as exc:
                self._limited.warning("activity", "activity report not delivered; the "
                                      "next one follows", error=str(exc)[:200])

    async def _wake_forever(self) -> None:
        holds = self.holds
        answered: dict[str, float] = {}  # service → when the controller last answered
        backoff = Backoff(initial=0.2, maximum=2.0)
        while True:
            changed = holds.wanted_changed
            wanted = holds.wanted()
            for service in [s for s in answered if s not in wanted]:
                del answered[service]  # asleep again later: its first request asks at once
            now = trio.current_time()
            retry_at = math.inf
            for service in sorted(wanted):
                if now - answered.get(service, -math.inf) < REASK:
                    retry_at = min(retry_at, answered[service] + REASK)
                    continue
                try:
                    status, doc = await self.post(report_path(self.server_id, WAKE),
                                                  wake_body(service))
                except PostError as exc:
                    self.failed += 1
                    delay = backoff.next_delay()
                    retry_at = min(retry_at, trio.current_time() + delay)
                    self._limited.warning(f"wake:{service}", "cannot ask the controller to "
                                          "wake a Service; retrying", service=service,
                                          error=str(exc)[:200], retry_in=f"{delay:.2f}s")
                    continue
                backoff.reset()
                answered[service] = trio.current_time()
                retry_at = min(retry_at, answered[service] + REASK)
                if status in (200, 202):
                    self.asked += 1
                    self.log.info("wake asked", service=service, state=doc.get("state"))
                else:
                    self._limited.warning(f"wake-refused:{service}", "the controller "
                                          "refused to wake a Service", service=service,
                                          status=status, error=str(doc.get("error"))[:200])
            with trio.move_on_at(retry_at):
                await changed.wait()
