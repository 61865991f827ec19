"""Request-target normalisation, pure: the one path that is both routed and forwarded.

A proxy that routes on one reading of a path and forwards another lets a client reach what
it was not routed to: `/api/../admin` matches a `/api` route byte for byte, and the backend
then serves `/admin`. So before routing, `normalize_target` puts the path in the one form
the backend will read it in (RFC 3986 §6.2.2), and that form is what goes upstream:

- percent-encoded unreserved characters (ALPHA, DIGIT, `-._~`) are decoded (§2.3), so
  `%2e%2e` is `..` and `%61pi` is `api`; every other escape is kept with uppercase hex
  (§6.2.2.1), so the backend decodes exactly what it would have;
- dot-segments are removed (§5.2.4), after decoding, so encoded dots cannot hide them;
- what cannot be normalised safely is refused (`BadTarget`, answered 400): an encoded `/`
  or `\\` or NUL (backends disagree on whether `%2F` separates segments), a raw backslash
  (some backends treat it as `/`), an invalid escape, `..` climbing above the root (RFC
  3986 would clamp it to `/`; no honest client sends one), and a target that is neither a
  path nor `*`.

The query is kept as sent: routing ignores it and backends own its encoding. The common
target (no `%`, no `/.`, no backslash) returns the same object after three substring
scans; no copy, no allocation.
"""

from __future__ import annotations

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEX = frozenset(b"0123456789ABCDEFabcdef")
_REFUSED_ESCAPES = {0x2F: "an encoded '/'", 0x5C: "an encoded '\\'", 0x00: "an encoded NUL"}


def clip(text: str, limit: int = 100) -> str:
    """Client-sent text (a path, a header value) cut for a response body or a log line."""
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


class BadTarget(ValueError):
    """A request target that cannot be normalised safely; the message is one short line."""


def normalize_target(target: bytes) -> bytes:
    """The target with its path normalised (see the module docstring); raises `BadTarget`.

    `target` is origin form (`/path?query`) or `*`, as `headers.read_request` leaves it.
    """
    if b"%" not in target and b"/." not in target and b"\\" not in target:
        if target[:1] == b"/" or target == b"*":
            return target
        raise BadTarget("the request target is not a path")
    if target[:1] != b"/":
        raise BadTarget("the request target is not a path")
    q = target.find(b"?")
    path, query = (target, b"") if q < 0 else (target[:q], target[q:])
    if b"\\" in path:
        raise BadTarget("a backslash in the path")
    if b"%" in path:
        path = _decode_unreserved(path)
    if b"/." in path:
        path = _remove_dot_segments(path)
    return path + query


def _decode_unreserved(path: bytes) -> bytes:
    parts = path.split(b"%")
    out = [parts[0]]
    for part in parts[1:]:
        if len(part) < 2 or part[0] not in _HEX or part[1] not in _HEX:
            raise BadTarget("an invalid percent-escape in the path")
        byte = int(part[:2], 16)
        if byte in _UNRESERVED:
            out.append(bytes((byte,)))
        elif byte in _REFUSED_ESCAPES:
            raise BadTarget(f"{_REFUSED_ESCAPES[byte]} in the path")
        else:
            out.append(b"%" + part[:2].upper())
        out.append(part[2:])
    return b"".join(out)


def _remove_dot_segments(path: bytes) -> bytes:
    """RFC 3986 §5.2.4 for an absolute path, refusing `..` above the root."""
    segments = path.split(b"/")[1:]
    last = len(segments) - 1
    out: list[bytes] = []
    for i, segment in enumerate(segments):
        if segment == b".":
            if i == last:
                out.append(b"")  # `/a/.` is `/a/`
        elif segment == b"..":
            if not out:
                raise BadTarget("the path climbs above the root")
            out.pop()
            if i == last:
                out.append(b"")  # `/a/b/..` is `/a/`
        else:
            out.append(segment)
    return b"/" + b"/".join(out)


__all__ = ["BadTarget", "clip", "normalize_target"]
