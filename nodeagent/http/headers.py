"""The front's header policy, both ways, as pure functions: no I/O, no h11 state.

Requests (RFC 9110 §7.6.1, RFC 9112 §3.2.2): `read_request` takes a head as `request.RequestReader`
parsed it (lowercased names, validated values, one Host at most) and returns what the proxy needs to
route and forward it; `upstream_headers` then adds what the proxy itself says. Responses:
`frame_response` and `switch_response` build the head written to the client from what the
upstream codec (`h1`) parsed.

- Hop-by-hop fields (Connection and the fields it names, Keep-Alive, Proxy-Connection, TE,
  Trailer, Transfer-Encoding, Upgrade, and every Proxy-*) are dropped both ways, by the one
  `strip_hop_by_hop`; bodies are re-framed by the front.
- Connection cannot name the fields the proxy itself is responsible for: Host, Content-Length
  (dropping it would desynchronise body framing) and X-Forwarded-*.
- `Upgrade` and `Connection: upgrade` pass for upgrade requests (Connection names upgrade).
- `X-Forwarded-For` gets the client address appended; `X-Forwarded-Proto` and
  `X-Forwarded-Host` are replaced (incoming values are not trusted). `X-Real-IP` is replaced
  by the client address, and a client's `Forwarded` (RFC 7239) is dropped and not re-made:
  a backend reading either must see what this front knows, not what the client claims.
- The target goes upstream normalised (`paths.normalize_target`), the same bytes routing
  matched; one it cannot normalise is kept as sent with `bad_target` saying why (answered
  400 by `dispatch`, never forwarded).
- A request with both Content-Length and Transfer-Encoding is framed by the latter (h11
  does) and its connection closes after the response (RFC 9112 §6.1): whoever sent it may
  be smuggling a request past another hop that read the Content-Length.
- Exactly one Host goes upstream: the client's, else the absolute-form authority, else the
  backend's host name. Its port, if any, is 1-5 digits in 0-65535, and it has no userinfo
  (RFC 9110 §4.2.4), or the request is refused (`bad_host`, answered 400 by `dispatch`):
  `shop.test:abc` read as `shop.test` here and as something else by the backend, or by a
  proxy in front, is a request routed on one reading and served on another. An empty port
  (`shop.test:`) is valid (RFC 3986 §3.2.3) and means the default one: it is normalised to
  `shop.test` (§6.2.3), the form routed and forwarded, as paths are.
- Response framing to the client: the upstream's Content-Length is kept; an unknown length
  goes chunked to HTTP/1.1 clients and until close to HTTP/1.0 ones.

Header names are forwarded lowercased, as h11 parses them. Everything here runs once per
request on the server's hot path: one pass over the fields, and a copy of the list only
when something has to be removed from the middle of it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

from nodeagent.http.paths import BadTarget, normalize_target

Headers = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
"""Dropped by every hop; any other `proxy-*` field is dropped too."""

X_FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host"})
CLIENT_CLAIMS = X_FORWARDED | {b"forwarded", b"x-real-ip", b"x-nodeagent-identity",
                               b"x-forwarded-user"}
"""Fields about the client a client could forge: never forwarded as received (the
identity ones are set by a route's gate, `gate.py`, after it authenticated the client)."""
_CONNECTION_OPTIONS = frozenset({b"close", b"keep-alive", b"upgrade"})
_PROXY_OWNED = frozenset({b"host", b"content-length"}) | X_FORWARDED
"""Fields a Connection option cannot remove: the proxy decides about them itself."""


_NAME_VALUE = operator.itemgetter(1, 2)


def fields(headers: Iterable[tuple[bytes, bytes]]) -> Iterable[tuple[bytes, bytes]]:
    """The `(name, value)` pairs of a head, fast for h11's `Headers`.

    h11's `Headers` iterates through the Python-level `Sequence.__getitem__`: about 0.25 µs
    a field here, a few µs per request. Its list of (raw name, lowercased name, value)
    triples is read directly when it has one (tests/http/test_headers.py checks both give
    the same pairs).
    """
    full = getattr(headers, "_full_items", None)
    return headers if full is None else map(_NAME_VALUE, full)


class HopByHop:
    """What the hop-by-hop fields of one head said (filled by `strip_hop_by_hop`)."""

    __slots__ = ("chunked", "connection", "upgrade")

    def __init__(self) -> None:
        self.connection: Sequence[bytes] = ()
        """Connection options, lowercased, stripped, in order (may repeat or be empty)."""
        self.chunked = False
        """A Transfer-Encoding was present."""
        self.upgrade: bytes | None = None
        """The last Upgrade value."""


def strip_hop_by_hop(
    headers: Iterable[tuple[bytes, bytes]], hop: HopByHop | None = None
) -> Headers:
    """The end-to-end fields of `headers`, in order; what the others said goes into `hop`.

    Fields named by Connection options are removed too, except those in `_PROXY_OWNED`.
    """
    out: Headers = []
    connection: list[bytes] | None = None
    hop_by_hop = HOP_BY_HOP
    for name, value in headers:
        if name in hop_by_hop or name.startswith(b"proxy-"):
            if name == b"connection":
                if connection is None:
                    connection = []
                connection.extend(t.strip().lower() for t in value.split(b","))
            elif hop is None:
                pass
            elif name == b"transfer-encoding":
                hop.chunked = True
            elif name == b"upgrade":
                hop.upgrade = value
            continue
        out.append((name, value))
    if connection is not None:
        if hop is not None:
            hop.connection = connection
        named = [t for t in connection if t not in _CONNECTION_OPTIONS and t not in _PROXY_OWNED]
        if named:
            out = [(n, v) for n, v in out if n not in named]
    return out


class ClientRequest(HopByHop):
    """A client's request head as the proxy reads it; made by `read_request` only.

    The `HopByHop` fields are what the request's hop-by-hop fields said, except that
    `upgrade` is kept only when the request asks to switch protocols (Connection names
    upgrade). One object per request: it is its own `HopByHop` for `strip_hop_by_hop`.
    """

    __slots__ = (
        "bad_host",
        "bad_target",
        "content_length",
        "forwarded_for",
        "headers",
        "host",
        "keep_alive",
        "target",
    )

    target: bytes
    """Origin form (an absolute-form target is reduced to its path) normalised, or `*`."""
    bad_target: str | None
    """Why the target could not be normalised (it is then as sent), or None."""
    host: bytes
    """The Host, or the absolute-form authority; b"" when there is none."""
    bad_host: str | None
    """Why `host` is refused (a port that is not one, userinfo), or None."""
    headers: Headers
    """End-to-end fields to forward: no hop-by-hop, X-Forwarded-* or Host when empty."""
    content_length: int
    """-1 when absent."""
    keep_alive: bool
    """HTTP/1.1 without `Connection: close` nor ambiguous framing: another request may come."""
    forwarded_for: bytes | None
    """The incoming X-Forwarded-For values joined, or None."""


def read_request(
    http_version: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]]
) -> ClientRequest:
    """Read a request head (as `RequestReader` parsed it) for routing and forwarding."""
    req = ClientRequest()
    kept = strip_hop_by_hop(fields(headers), req)
    host = b""
    has_host = False
    content_length = -1
    forwarded_for: bytes | None = None
    has_claims = False
    client_claims = CLIENT_CLAIMS
    for name, value in kept:
        if name == b"host":
            host = value
            has_host = True
        elif name == b"content-length":
            content_length = int(value)
        elif name in client_claims:
            has_claims = True
            if name == b"x-forwarded-for":
                forwarded_for = value if forwarded_for is None else forwarded_for + b", " + value
    if target[:1] != b"/" and target != b"*" and (scheme_end := target.find(b"://")) > 0:
        # Absolute form (RFC 9112 §3.2.2): its authority replaces Host.
        rest = target[scheme_end + 3 :]
        slash = rest.find(b"/")
        host, target = (rest, b"/") if slash < 0 else (rest[:slash], rest[slash:])
        kept = [(n, v) for n, v in kept if n != b"host" and n not in client_claims]
        if host:
            kept.append((b"host", host))
    elif has_claims or (has_host and not host):
        # An empty Host goes too: the backend's name replaces it (one Host, never two).
        kept = [(n, v) for n, v in kept if n not in client_claims and (host or n != b"host")]
    bad_host = None
    if b":" in host or b"@" in host:
        checked, bad_host = check_authority(host)
        if checked is not host:  # an empty port dropped: the form routed and forwarded
            kept = [(n, checked if n == b"host" else v) for n, v in kept]
            host = checked
    req.bad_host = bad_host
    connection = req.connection
    if req.upgrade is not None and b"upgrade" not in connection:
        req.upgrade = None
    try:
        req.target = normalize_target(target)
        req.bad_target = None
    except BadTarget as exc:
        req.target = target
        req.bad_target = str(exc)
    req.host = host
    req.headers = kept
    req.content_length = content_length
    req.keep_alive = (
        http_version == b"1.1"
        and b"close" not in connection
        and not (req.chunked and content_length >= 0)
    )
    req.forwarded_for = forwarded_for
    return req


def check_authority(host: bytes) -> tuple[bytes, str | None]:
    """A Host or absolute-form authority as routed and forwarded, and why it is refused
    (None: it is not). `host:` becomes `host`; the answers name no client bytes."""
    if b"@" in host:
        return host, "userinfo (user@) in the authority"
    if host[:1] == b"[":
        end = host.find(b"]")
        if end < 0:
            return host, "an IPv6 literal without its ']'"
        name, rest = host[: end + 1], host[end + 1 :]
        if not rest:
            return host, None
        if rest[:1] != b":":
            return host, "bytes after the IPv6 literal that are not a port"
        port = rest[1:]
    else:
        name, _, port = host.partition(b":")
    if not port:
        return name, None
    if len(port) <= 5 and port.isdigit() and int(port) <= 65535:
        return host, None
    return host, "the port is not 1-5 digits in 0-65535"


def request_head_size(method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]]) -> int:
    """The bytes of a request head as sent, give or take optional whitespace."""
    size = len(method) + len(target) + 14  # " ", " HTTP/1.1\r\n", the final "\r\n"
    for name, value in fields(headers):
        size += len(name) + len(value) + 4
    return size


def upstream_headers(
    req: ClientRequest, *, default_host: str, client: bytes, proto: bytes
) -> Headers:
    """The header list sent upstream: `req.headers` (extended in place) plus the proxy's own.

    `default_host` is the Host when the client sent none (IDNA-encoded only then: it costs
    more than the rest of this function); `client` the address appended to X-Forwarded-For
    and sent as X-Real-IP; `proto` the X-Forwarded-Proto (the listener's scheme).

    X-Forwarded-For is appended to, not replaced: a chain another proxy in front of this
    one wrote stays readable to a backend configured to trust that proxy, and the last
    entry is always the address this front saw, so a backend that trusts one hop (reads the
    rightmost entry) cannot be fooled by what the client wrote. X-Real-IP holds a single
    address, so it is replaced by that same last entry.
    """
    headers = req.headers
    if req.upgrade is not None:
        headers.append((b"connection", b"upgrade"))
        headers.append((b"upgrade", req.upgrade))
    host = req.host
    if not host:
        headers.append((b"host", default_host.encode("idna")))
    xff = req.forwarded_for
    headers.append((b"x-forwarded-for", client if xff is None else xff + b", " + client))
    headers.append((b"x-real-ip", client))
    headers.append((b"x-forwarded-proto", proto))
    if host:
        headers.append((b"x-forwarded-host", host))
    if req.chunked:
        headers = [(n, v) for n, v in headers if n != b"content-length"]
        headers.append((b"transfer-encoding", b"chunked"))
    return headers


def response_head(status: int, reason: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A response head written directly: the upstream codec validated every name and value."""
    parts = [b"HTTP/1.1 %d %b\r\n" % (status, reason)]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def frame_response(
    status: int,
    reason: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    *,
    length: int,
    head_request: bool,
    http11: bool,
    keep_alive: bool,
) -> tuple[bytes, bool, bool]:
    """The client's head for an upstream response other than 101.

    `length` is the body length the upstream declared (-1: unknown). Returns the head bytes,
    whether the body must be chunked, and whether the client connection stays open.
    """
    out = strip_hop_by_hop(headers)
    chunked = False
    if status >= 200 and length < 0 and not head_request and status not in (204, 304):
        # Unknown length: chunked to HTTP/1.1 clients, else until close.
        if http11:
            chunked = True
            out = [(n, v) for n, v in out if n != b"content-length"]
            out.append((b"transfer-encoding", b"chunked"))
        else:
            keep_alive = False
    if status >= 200 and not keep_alive:
        out.append((b"connection", b"close"))
    return response_head(status, reason, out), chunked, keep_alive


def switch_response(reason: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The client's head for a 101: end-to-end fields, then Connection and Upgrade."""
    hop = HopByHop()
    out = strip_hop_by_hop(headers, hop)
    out.append((b"connection", b"upgrade"))
    if hop.upgrade is not None:
        out.append((b"upgrade", hop.upgrade))
    return response_head(101, reason, out)


__all__ = [
    "CLIENT_CLAIMS",
    "HOP_BY_HOP",
    "X_FORWARDED",
    "ClientRequest",
    "Headers",
    "HopByHop",
    "check_authority",
    "fields",
    "frame_response",
    "read_request",
    "request_head_size",
    "response_head",
    "strip_hop_by_hop",
    "switch_response",
    "upstream_headers",
]
