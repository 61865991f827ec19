"""The HTTP front's sizes and deadlines, in one frozen value shared by its connections."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """Sizes and deadlines of the front, in bytes and seconds."""

    max_header_bytes: int = 64 * 1024
    """Largest request or response head (h11 max_incomplete_event_size); over → 431/502."""
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


__all__ = ["Limits"]
