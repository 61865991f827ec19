"""The HTTP front's sizes and deadlines, in one frozen value shared by its connections."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """Sizes and deadlines of the front, in bytes and seconds."""

    max_header_bytes: int = 64 * 1024
    """Largest request or response head; over → 431/502. h11 enforces it only on a head
    still incomplete (max_incomplete_event_size), so the front also measures a complete
    head whenever more than this many bytes arrived for it."""
    max_header_fields: int = 100
    """Most fields in a request head; over → 431. Real browsers send 10-30; 100 is what
    Go's and nginx's defaults allow in practice, and bounds the per-request policy work."""
    max_body_bytes: int | None = None
    """Largest request body; None for no limit. Over → 413 (or close once streaming)."""
    header_timeout: float = 10.0
    """Accept (or first byte of a request) → complete request head; over → 408 and close."""
    idle_timeout: float = 60.0
    """Keep-alive wait for the next request, and longest stall inside a body."""
    dial_timeout: float = 10.0
    """One `open_upstream` call; over → 504 (after trying other backends)."""
    response_timeout: float = 60.0
    """Request sent → upstream response head; over → 504."""
    max_dial_attempts: int = 3
    """Backends tried for one request before answering with the last failure."""
    failed_backend_cooldown: float = 5.0
    """A backend whose dial failed is tried last for this long."""
    read_size: int = 64 * 1024
    """Bytes per receive: with one buffer per direction, the memory bound per connection."""
    min_body_rate: float | None = 1024.0
    """Bytes per second a request body must average once `body_grace` is spent; slower →
    408, close, and the upstream stream reset. None: only `idle_timeout` applies. The
    client earns 1/rate seconds of waiting per byte it sends, on top of `body_grace`, and
    only time spent waiting for the client counts (not a slow upstream's backpressure);
    the credit never exceeds `idle_timeout`. 1 KiB/s is below any real uplink (a poor
    mobile link does 10+ KiB/s) and makes each stream a slow client holds cost it a real
    1 KiB/s: holding 10,000 of a node's streams takes 10 MiB/s, not 10,000 idle sockets."""
    body_grace: float = 5.0
    """Seconds of waiting a request body gets before the rate applies: TCP slow start, an
    `Expect: 100-continue` round trip through the tunnel, a client preparing the body."""
    max_connections: int | None = 10_000
    """Open client connections per front; over → the new one gets a 503 (plain HTTP, no
    request read) or is closed (TLS, before the handshake). About 1/3 of a typical 65,536
    file-descriptor limit once each proxied connection's upstream socket is counted."""
    max_connections_per_client: int | None = 256
    """Open connections per client address (an IPv6 client per /64); over → as above.
    A browser opens ~6 per host, so 256 is ~40 users behind one NAT. Set None behind a load
    balancer that does not keep client addresses: every client then shares a few."""


__all__ = ["Limits"]
