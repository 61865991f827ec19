"""Fault injection: what a test can make the fake do wrong, by request.

Fail the next N matching requests with a status (500 by default; 429 and 503 carry
Retry-After), delay responses (all, or matching ones), hold matching requests until an
event is set, and deny verbs/resources/users with 403. Dropping open watches is
`watchstream.OpenWatches.drop`. `clear()` undoes all of it and releases held requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from nodeagent.testing.fakekube.errors import ApiError
from nodeagent.testing.fakekube.rbac import RequestAttributes
from nodeagent.testing.fakekube.requestlog import Match, RecordedRequest


@dataclass
class _Fault:
    remaining: float
    status: int
    match: Match


class Faults:
    def __init__(self) -> None:
        self.delay = 0.0  # seconds added to every response
        self._delays: list[tuple[Match, float]] = []
        self._faults: list[_Fault] = []
        self._gates: list[tuple[Match, trio.Event]] = []
        self._denied: list[tuple[str | None, str | None, str | None]] = []

    def fail(self, count: float, status: int, match: Match) -> None:
        self._faults.append(_Fault(count, status, match))

    def delay_matching(self, match: Match, seconds: float) -> None:
        self._delays.append((match, seconds))

    def hold(self, match: Match) -> trio.Event:
        gate = trio.Event()
        self._gates.append((match, gate))
        return gate

    def deny(self, verb: str | None, resource: str | None, user: str | None) -> None:
        self._denied.append((verb, resource, user))

    def clear(self) -> None:
        self._faults.clear()
        self._delays.clear()
        for _, gate in self._gates:
            gate.set()
        self._gates.clear()
        self._denied.clear()
        self.delay = 0.0

    async def hold_and_delay(self, record: RecordedRequest) -> None:
        """Wait at every gate the request matches, then sleep the delays it matches."""
        for match, gate in list(self._gates):
            if match(record):
                await gate.wait()
        delay = self.delay + sum(s for m, s in self._delays if m(record))
        if delay:
            await trio.sleep(delay)

    def inject(self, record: RecordedRequest) -> None:
        """Raise the first pending fault the request matches (using it up)."""
        for fault in self._faults:
            if fault.remaining > 0 and fault.match(record):
                fault.remaining -= 1
                reason = {429: "TooManyRequests", 503: "ServiceUnavailable",
                          504: "Timeout"}.get(fault.status, "InternalError")
                raise ApiError(fault.status, reason,
                               f"Internal error occurred: injected fault ({fault.status})")
        self._faults = [f for f in self._faults if f.remaining > 0]

    def denies(self, attrs: RequestAttributes) -> bool:
        return any((d_verb is None or d_verb == attrs.verb)
                   and (d_resource is None or d_resource == attrs.resource)
                   and (d_user is None or d_user == attrs.user.name)
                   for d_verb, d_resource, d_user in self._denied)
