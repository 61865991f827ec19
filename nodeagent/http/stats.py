"""The HTTP front's counters: plain ints its connections bump and the server role exports.

Refusals (requests and connections turned away to protect the front or its nodes) are
counted by reason, `refused_<reason>`, and logged through one `RateLimitedLog` keyed by
reason: a flood of one kind is one line a minute, with how many were suppressed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Literal

from nodeagent.ops.logs import get_logger
from tunnel.log import RateLimitedLog

RefusalReason = Literal[
    "connections_total",
    "connections_per_client",
    "head_timeout",
    "head_too_large",
    "too_many_fields",
    "malformed",
    "bad_path",
    "bad_chunk_size",
    "bad_host",
    "body_too_large",
    "slow_body",
    "h2_protocol_error",
    "h2_rapid_reset",
    "h2_control_flood",
    "h2_too_many_streams",
    "h2_flow_control",
    "h2_header_list_too_large",
    "h2_frame_too_large",
    "h2_window_stalled",
    "auth_missing",
    "auth_invalid",
    "auth_expired",
    "auth_unknown_key",
    "auth_forbidden",
    "auth_unavailable",
    "rate_limited",
    "rate_limited_client",
]

_CLASSES = ("none", "1xx", "2xx", "3xx", "4xx", "5xx", "none")

_refusal_log = RateLimitedLog(get_logger("nodeagent.http"), period=60.0)


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
    """Header and body (408), dial and response (504) timeouts."""
    upgrades: int = 0
    tls_handshake_errors: int = 0
    ambiguous_framing: int = 0
    """Requests with both Content-Length and Transfer-Encoding (served, then closed)."""
    refused_connections_total: int = 0
    """Connections over `Limits.max_connections`."""
    refused_connections_per_client: int = 0
    """Connections over `Limits.max_connections_per_client`."""
    refused_head_timeout: int = 0
    """408: the request head did not arrive within `header_timeout`."""
    refused_head_too_large: int = 0
    """431: a head over `max_header_bytes` (complete or not)."""
    refused_too_many_fields: int = 0
    """431: a head with more than `max_header_fields` fields."""
    refused_malformed: int = 0
    """400 (or h11's other hints): a head or body h11 refused."""
    refused_bad_path: int = 0
    """400: a path that cannot be normalised safely (`paths`)."""
    refused_bad_host: int = 0
    """400: a Host or absolute-form authority whose port is not 0-65535, or with userinfo."""
    refused_bad_chunk_size: int = 0
    """400: a chunk-size line of a request body outside RFC 9112's grammar (`chunked`)."""
    refused_body_too_large: int = 0
    """413: a body over `max_body_bytes`."""
    refused_slow_body: int = 0
    """408: a body under `min_body_rate`, or stalled for `idle_timeout`."""

    h2_connections: int = 0
    """Client connections served as HTTP/2 (ALPN h2, or h2c with prior knowledge)."""
    h2_requests: int = 0
    """Requests on HTTP/2 client connections (also counted in `requests`)."""
    grpc_requests: int = 0
    """Requests with content-type application/grpc (also counted in `h2_requests`)."""
    h2_client_resets: int = 0
    """Streams a client reset while the front served them (gRPC cancellations)."""
    h2_direct_streams: int = 0
    """HTTP/2 requests to h2c backends relayed without a task of their own (the whole
    request came with its head and the backend's connection had room)."""
    refused_h2_protocol_error: int = 0
    """HTTP/2 connections ended with GOAWAY for a protocol error (`h2` refused a frame)."""
    refused_h2_rapid_reset: int = 0
    """HTTP/2 connections ended for resetting streams faster than they finish
    (CVE-2023-44487)."""
    refused_h2_control_flood: int = 0
    """HTTP/2 connections ended for a PING or SETTINGS flood."""
    refused_h2_too_many_streams: int = 0
    """HTTP/2 connections ended for opening streams over the announced limit."""
    refused_h2_flow_control: int = 0
    """HTTP/2 connections ended for sending beyond the window they were given."""
    refused_h2_header_list_too_large: int = 0
    """HTTP/2 connections ended for a header list (HPACK-decoded) over the limit."""
    refused_h2_frame_too_large: int = 0
    """HTTP/2 connections ended for a frame over the announced frame size."""
    refused_h2_window_stalled: int = 0
    """HTTP/2 streams reset because the client kept their window shut for `idle_timeout`."""

    refused_auth_missing: int = 0
    """401: a gated route's request without a token or credentials (`gate.py`)."""
    refused_auth_invalid: int = 0
    """401: a bad token (signature, issuer, audience, claims) or wrong password."""
    refused_auth_expired: int = 0
    """401: a token past its exp (and the leeway)."""
    refused_auth_unknown_key: int = 0
    """401: a token signed by a key the issuer's JWKS does not hold, even after a refetch."""
    refused_auth_forbidden: int = 0
    """403: a valid token whose claims do not allow the route."""
    refused_auth_unavailable: int = 0
    """503: the JWKS could never be fetched, or too many password checks wait."""
    refused_rate_limited: int = 0
    """429: over the route's request rate."""
    refused_rate_limited_client: int = 0
    """429: over the route's per-client request rate."""

    by_route: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    """Requests that reached a route, by (route, protocol, result): protocol `h1`, `h2`
    or `grpc`; result the status class (`2xx`...) or, for gRPC, the grpc-status name
    (`OK`, `UNAVAILABLE`...). Exported as `nodeagent_http_route_requests`; its size is
    bounded by the routes configured (protocols and results are fixed sets)."""

    def count_route(self, route: str, protocol: str, status: int, grpc: str = "") -> None:
        self.by_route[route, protocol, grpc or _CLASSES[min(status // 100, 6)]] += 1

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

    def refused(self, reason: RefusalReason, *, status: int, client: str, detail: str) -> None:
        """Count a refusal and log it, at most once a minute per reason.

        `detail` must already be clipped (`paths.clip`) where it holds client text.
        """
        name = "refused_" + reason
        setattr(self, name, getattr(self, name) + 1)
        _refusal_log.warning(
            reason, "http refused", reason=reason, status=status, client=client, detail=detail
        )

    def as_dict(self) -> dict[str, int]:
        """The plain counters (not `by_route`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "by_route"}


__all__ = ["HttpStats", "RefusalReason"]
