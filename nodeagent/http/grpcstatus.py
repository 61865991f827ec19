"""gRPC over HTTP/2 as the front sees it, pure: deadlines, and the answers it makes itself.

A gRPC client reads a failed call from the `grpc-status` and `grpc-message` trailers, not
from an HTML page: an answer the front makes itself (no route, node not connected, dial
timeout...) to a request with `content-type: application/grpc` is a trailers-only response
(`trailers_only`): `:status 200`, the content type, the status and message, END_STREAM on
the one HEADERS frame. HTTP statuses map to gRPC codes as gRPC's own
doc/http-grpc-status-mapping.md says (`code_for_http`). `grpc-timeout` (`parse_timeout`)
bounds the call at the front.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable

from nodeagent.http.headers import Headers

OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
UNAUTHENTICATED = 16

_BY_HTTP = {400: INTERNAL, 401: UNAUTHENTICATED, 403: PERMISSION_DENIED, 404: UNIMPLEMENTED,
            429: UNAVAILABLE, 502: UNAVAILABLE, 503: UNAVAILABLE, 504: UNAVAILABLE}

_TIMEOUT = re.compile(rb"([0-9]{1,8})([HMSmun])")
_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
         "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
         "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
         "UNAUTHENTICATED")


def name_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The name of the `grpc-status` in trailers (or a trailers-only head): what the
    per-route metrics count; "none" when there is none, "invalid" when it is no code."""
    for name, value in headers:
        if name == b"grpc-status":
            code = int(value) if value.isdigit() and len(value) <= 2 else -1
            return NAMES[code] if 0 <= code < len(NAMES) else "invalid"
    return "none"


def code_for_http(status: int) -> int:
    """The gRPC code for an HTTP status the front answers with (gRPC's mapping)."""
    return _BY_HTTP.get(status, UNKNOWN)


def parse_timeout(value: bytes) -> float | None:
    """Seconds from a `grpc-timeout` value (1-8 digits and a unit), None if malformed."""
    m = _TIMEOUT.fullmatch(value.strip())
    if m is None:
        return None
    return int(m.group(1)) * _UNITS[m.group(2)]


def status_trailers(code: int, message: str) -> Headers:
    """`grpc-status` and, when there is one, the percent-encoded `grpc-message`."""
    out: Headers = [(b"grpc-status", b"%d" % code)]
    if message:
        out.append((b"grpc-message", urllib.parse.quote(message, safe=" !#$&'()*+,/:;=?@[]")
                    .encode("ascii")))
    return out


def trailers_only(code: int, message: str, content_type: bytes = b"application/grpc") -> Headers:
    """A complete gRPC response in one HEADERS frame (send it with END_STREAM)."""
    return [(b":status", b"200"), (b"content-type", content_type or b"application/grpc"),
            *status_trailers(code, message)]


__all__ = [
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "INTERNAL",
    "NAMES",
    "OK",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED",
    "UNAVAILABLE",
    "UNIMPLEMENTED",
    "UNKNOWN",
    "code_for_http",
    "name_of",
    "parse_timeout",
    "status_trailers",
    "trailers_only",
]
