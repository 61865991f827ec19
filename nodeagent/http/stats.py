"""The HTTP front's counters: plain ints its connections bump and the server role exports."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class HttpStats:
    """Counters for metrics; plain ints the server role exports (see `as_dict`)."""

    connections_accepted: int = 0
    connections_open: int = 0
    requests: int = 0
    responses_1xx: int = 0
    responses_2xx: int = 0
    responses_3xx: int = 0
    responses_4xx: int = 0
    responses_5xx: int = 0
    upstream_opens: int = 0
    upstream_reuses: int = 0
    upstream_errors: int = 0
    """Failed dials, broken upstreams and malformed upstream responses."""
    bad_requests: int = 0
    """Malformed requests from clients (400/431), counted apart from other 4xx."""
    timeouts: int = 0
    """Header (408), dial and response (504) timeouts."""
    upgrades: int = 0
    tls_handshake_errors: int = 0

    def count_status(self, status: int) -> None:
        if status < 200:
            self.responses_1xx += 1
        elif status < 300:
            self.responses_2xx += 1
        elif status < 400:
            self.responses_3xx += 1
        elif status < 500:
            self.responses_4xx += 1
        else:
            self.responses_5xx += 1

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


__all__ = ["HttpStats"]
