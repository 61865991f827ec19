"""HTTP/2 heads to and from the front's HTTP/1.1 view, pure (RFC 9113 §8.2-8.3).

The front's routing and header policy (`headers.read_request`, `dispatch.route_request`)
read a request as an HTTP/1.1 head. An h2 request becomes one here (`h1_view`): `:method`,
`:path`, `:authority` (as Host; a Host field beside it is dropped, the authority wins), and
its fields, `cookie` fields joined with "; " (§8.2.3). `h2` has already refused what §8.2.2
forbids (connection-specific fields, `te` other than "trailers", uppercase names).

Towards an h2c backend (`h2_request`), the reverse: the policy's HTTP/1.1 fields (hop-by-hop
fields already dropped) with Host turned into `:authority`, and `te: trailers` when the
client sent it (gRPC servers require it). Responses: an HTTP/1.1 response head goes to an
h2 client without its hop-by-hop fields (`h2_response`); an h2 response goes to an HTTP/1.1
client with its status's reason phrase (`h1_response_fields`).
"""

from __future__ import annotations

from collections.abc import Iterable
from http import HTTPStatus

from nodeagent.http.headers import Headers, strip_hop_by_hop


class H2Request:
    """An h2 request head read for the front's HTTP/1.1 policy (made by `h1_view`)."""

    __slots__ = ("authority", "content_type", "fields", "grpc", "method", "target",
                 "te_trailers")

    def __init__(self, method: bytes, target: bytes, authority: bytes, fields: Headers,
                 te_trailers: bool, content_type: bytes) -> None:
        self.method = method
        self.target = target
        self.authority = authority
        self.fields = fields
        """Regular fields with Host first (from `:authority`), as `read_request` takes them."""
        self.te_trailers = te_trailers
        self.content_type = content_type
        self.grpc = is_grpc(content_type)
        """A gRPC call: worked out once, read several times per request."""


def is_grpc(content_type: bytes) -> bool:
    """`application/grpc` and its `+proto`, `+json`... variants (the gRPC HTTP/2 spec)."""
    return content_type[:16] == b"application/grpc" and content_type[16:17] in (b"", b"+", b";")


def h1_view(headers: Iterable[tuple[bytes, bytes]]) -> H2Request:
    """The request head of an h2 stream, as the HTTP/1.1 policy reads it."""
    method = target = authority = b""
    host = b""
    fields: Headers = []
    cookies: list[bytes] = []
    te_trailers = False
    content_type = b""
    for name, value in headers:
        if name[:1] == b":":
            if name == b":method":
                method = value
            elif name == b":path":
                target = value
            elif name == b":authority":
                authority = value
            continue  # :scheme is the listener's, not the client's say
        if name == b"cookie":
            cookies.append(value)
        elif name == b"host":
            host = value
        elif name == b"te":
            te_trailers = True  # h2 refused any other value
        else:
            if name == b"content-type":
                content_type = value
            fields.append((name, value))
    if cookies:
        fields.append((b"cookie", b"; ".join(cookies)))
    authority = authority or host
    if authority:
        fields.insert(0, (b"host", authority))
    return H2Request(method, target or b"/", authority, fields, te_trailers, content_type)


def h2_request(method: bytes, target: bytes, fields: Iterable[tuple[bytes, bytes]], *,
               te_trailers: bool) -> Headers:
    """The head sent to an h2c backend from the policy's upstream fields."""
    out: Headers = [(b":method", method), (b":scheme", b"http"), (b":path", target)]
    rest: Headers = []
    for name, value in fields:
        if name == b"host":
            out.append((b":authority", value))
        elif name in (b"transfer-encoding", b"connection", b"keep-alive", b"upgrade"):
            continue  # framing is HTTP/2's own
        else:
            rest.append((name, value))
    if te_trailers:
        rest.append((b"te", b"trailers"))
    out += rest
    return out


def h2_response(status: int, fields: Iterable[tuple[bytes, bytes]]) -> Headers:
    """An HTTP/1.1 upstream's response head for an h2 client."""
    return [(b":status", b"%d" % status), *strip_hop_by_hop(fields)]


def split_response(headers: Iterable[tuple[bytes, bytes]]) -> tuple[int, Headers]:
    """An h2 response head: its status and its regular fields."""
    status = 0
    out: Headers = []
    for name, value in headers:
        if name == b":status":
            status = int(value)
        elif name[:1] != b":":
            out.append((name, value))
    return status, out


def reason_phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


__all__ = [
    "H2Request",
    "h1_view",
    "h2_request",
    "h2_response",
    "is_grpc",
    "reason_phrase",
    "split_response",
]
