"""The log of requests a FakeKube received, and the matcher tests and faults select them by."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    user: str | None
    at: float  # trio.current_time() when the request arrived
    status: int | None = None

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")

    @property
    def resource_version(self) -> str | None:
        return self.query.get("resourceVersion")

    def __str__(self) -> str:
        q = "&".join(f"{k}={v}" for k, v in self.query.items())
        return f"{self.method} {self.path}{'?' + q if q else ''} -> {self.status}"


Match = Callable[[RecordedRequest], bool]


def request_matcher(method: str | None = None, path: str | None = None,
                    watch: bool | None = None) -> Match:
    """Matches requests by method, path substring and watch-ness (None: any)."""
    def match(r: RecordedRequest) -> bool:
        return ((method is None or r.method == method.upper())
                and (path is None or path in r.path)
                and (watch is None or r.watch == watch))
    return match
