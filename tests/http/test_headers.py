"""The front's header policy, without sockets: request heads parsed by h11 as the front
parses them, then rewritten; upstream response heads framed for the client."""

from __future__ import annotations

from dataclasses import dataclass, field

import h11
import pytest

from nodeagent.http.headers import (
    ClientRequest,
    Headers,
    fields,
    frame_response,
    read_request,
    request_head_size,
    response_head,
    switch_response,
    upstream_headers,
)

CLIENT = b"198.51.100.7"


def parse(raw: bytes, max_head: int = 64 * 1024) -> h11.Request:
    """The request as the front's h11 parser gives it (so hostile heads h11 refuses, fail)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head)
    conn.receive_data(raw)
    event = conn.next_event()
    assert type(event) is h11.Request, event
    return event


def rewrite(raw: bytes, proto: bytes = b"http") -> tuple[ClientRequest, Headers]:
    req = parse(raw)
    creq = read_request(req.http_version, req.target, req.headers)
    headers = upstream_headers(creq, default_host="backend.svc", client=CLIENT, proto=proto)
    return creq, headers


def names(headers: Headers) -> list[bytes]:
    return [n for n, _ in headers]


def values(headers: Headers, name: bytes) -> list[bytes]:
    return [v for n, v in headers if n == name]


@dataclass
class Case:
    id: str
    head: bytes
    want: Headers | None = None
    """The exact upstream header list, when given."""
    present: Headers = field(default_factory=list)
    absent: list[bytes] = field(default_factory=list)
    target: bytes = b"/"
    host: bytes = b"shop.example"
    keep_alive: bool = True
    upgrade: bytes | None = None
    chunked: bool = False
    bad_target: str | None = None


XF = [
    (b"x-forwarded-for", CLIENT),
    (b"x-real-ip", CLIENT),
    (b"x-forwarded-proto", b"http"),
    (b"x-forwarded-host", b"shop.example"),
]

CASES = [
    Case(
        "plain",
        b"GET / HTTP/1.1\r\nHost: shop.example\r\nAccept: */*\r\n",
        want=[(b"host", b"shop.example"), (b"accept", b"*/*"), *XF],
    ),
    Case(
        "end-to-end fields keep their order and repeats",
        b"GET / HTTP/1.1\r\nX-B: 1\r\nHost: shop.example\r\nX-A: 2\r\nX-B: 3\r\n",
        want=[(b"x-b", b"1"), (b"host", b"shop.example"), (b"x-a", b"2"), (b"x-b", b"3"), *XF],
    ),
    Case(
        "hop-by-hop fields never pass",
        b"GET / HTTP/1.1\r\nHost: shop.example\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n"
        b"Trailer: x-sum\r\nProxy-Connection: keep-alive\r\nProxy-Authorization: Basic eA==\r\n"
        b"Proxy-Authenticate: Basic\r\nProxy-Anything: 1\r\nUpgrade: h2c\r\nX-Kept: yes\r\n",
        want=[(b"host", b"shop.example"), (b"x-kept", b"yes"), *XF],
    ),
    Case(
        "Connection options name fields to drop, across repeated headers and any case",
        b"GET / HTTP/1.1\r\nHost: shop.example\r\nConnection: X-A,,  x-b \r\n"
        b"X-A: 1\r\nX-B: 2\r\nconnection: X-C\r\nX-C: 3\r\nX-D: 4\r\n",
        want=[(b"host", b"shop.example"), (b"x-d", b"4"), *XF],
    ),
    Case(
        "Connection cannot drop Host, Content-Length or X-Forwarded-*",
        b"POST / HTTP/1.1\r\nHost: shop.example\r\nContent-Length: 3\r\n"
        b"X-Forwarded-For: 203.0.113.1\r\n"
        b"Connection: host, content-length, x-forwarded-for, x-forwarded-host\r\n",
        want=[
            (b"host", b"shop.example"),
            (b"content-length", b"3"),
            (b"x-forwarded-for", b"203.0.113.1, " + CLIENT),
            (b"x-real-ip", CLIENT),
            (b"x-forwarded-proto", b"http"),
            (b"x-forwarded-host", b"shop.example"),
        ],
    ),
    Case(
        "incoming X-Forwarded-For is extended, -Proto and -Host replaced",
        b"GET / HTTP/1.1\r\nX-Forwarded-For: 203.0.113.1\r\nHost: shop.example\r\n"
        b"X-Forwarded-Proto: https\r\nX-Forwarded-For: 10.0.0.1, 10.0.0.2\r\n"
        b"X-Forwarded-Host: spoofed.example\r\n",
        want=[
            (b"host", b"shop.example"),
            (b"x-forwarded-for", b"203.0.113.1, 10.0.0.1, 10.0.0.2, " + CLIENT),
            (b"x-real-ip", CLIENT),
            (b"x-forwarded-proto", b"http"),
            (b"x-forwarded-host", b"shop.example"),
        ],
    ),
    Case(
        "Connection: close ends keep-alive",
        b"GET / HTTP/1.1\r\nHost: shop.example\r\nConnection: keep-alive, Close\r\n",
        want=[(b"host", b"shop.example"), *XF],
        keep_alive=False,
    ),
    Case(
        "HTTP/1.0 without Host: the backend's name, no X-Forwarded-Host, no keep-alive",
        b"GET /old HTTP/1.0\r\nConnection: keep-alive\r\n",
        want=[
            (b"host", b"backend.svc"),
            (b"x-forwarded-for", CLIENT),
            (b"x-real-ip", CLIENT),
            (b"x-forwarded-proto", b"http"),
        ],
        target=b"/old",
        host=b"",
        keep_alive=False,
    ),
    Case(
        "an empty Host is replaced, never sent beside the backend's",
        b"GET / HTTP/1.1\r\nHost: \r\nX-Forwarded-Host: spoofed\r\n",
        want=[
            (b"host", b"backend.svc"),
            (b"x-forwarded-for", CLIENT),
            (b"x-real-ip", CLIENT),
            (b"x-forwarded-proto", b"http"),
        ],
        host=b"",
    ),
    Case(
        "absolute form: its authority replaces Host",
        b"GET http://other.example:8080/p?q=1 HTTP/1.1\r\nHost: shop.example\r\n"
        b"X-Forwarded-Host: spoofed\r\nAccept: */*\r\n",
        want=[
            (b"accept", b"*/*"),
            (b"host", b"other.example:8080"),
            (b"x-forwarded-for", CLIENT),
            (b"x-real-ip", CLIENT),
            (b"x-forwarded-proto", b"http"),
            (b"x-forwarded-host", b"other.example:8080"),
        ],
        target=b"/p?q=1",
        host=b"other.example:8080",
    ),
    Case(
        "absolute form without a path goes to /",
        b"GET https://other.example HTTP/1.1\r\nHost: shop.example\r\n",
        present=[(b"host", b"other.example")],
        target=b"/",
        host=b"other.example",
    ),
    Case(
        "absolute form with an empty authority: one Host, the backend's",
        b"GET http:///x HTTP/1.1\r\nHost: shop.example\r\n",
        want=[
            (b"host", b"backend.svc"),
            (b"x-forwarded-for", CLIENT),
            (b"x-real-ip", CLIENT),
            (b"x-forwarded-proto", b"http"),
        ],
        target=b"/x",
        host=b"",
    ),
    Case(
        "asterisk form stays",
        b"OPTIONS * HTTP/1.1\r\nHost: shop.example\r\n",
        target=b"*",
        present=[(b"host", b"shop.example")],
    ),
    Case(
        "Upgrade passes when Connection names it",
        b"GET /ws HTTP/1.1\r\nHost: shop.example\r\nConnection: keep-alive, Upgrade\r\n"
        b"Upgrade: websocket\r\nSec-WebSocket-Key: k\r\n",
        want=[
            (b"host", b"shop.example"),
            (b"sec-websocket-key", b"k"),
            (b"connection", b"upgrade"),
            (b"upgrade", b"websocket"),
            *XF,
        ],
        target=b"/ws",
        upgrade=b"websocket",
    ),
    Case(
        "Upgrade without Connection: upgrade is dropped",
        b"GET / HTTP/1.1\r\nHost: shop.example\r\nUpgrade: websocket\r\n",
        want=[(b"host", b"shop.example"), *XF],
    ),
    Case(
        "repeated Upgrade: the last one",
        b"GET / HTTP/1.1\r\nHost: shop.example\r\nUpgrade: h2c\r\nUpgrade: websocket\r\n"
        b"Connection: upgrade\r\n",
        present=[(b"connection", b"upgrade"), (b"upgrade", b"websocket")],
        absent=[b"http2-settings"],
        upgrade=b"websocket",
    ),
    Case(
        "chunked wins over Content-Length, is re-framed last, and the connection closes",
        b"POST / HTTP/1.1\r\nHost: shop.example\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n",
        want=[(b"host", b"shop.example"), *XF, (b"transfer-encoding", b"chunked")],
        chunked=True,
        keep_alive=False,
    ),
    Case(
        "chunked alone keeps the connection",
        b"POST / HTTP/1.1\r\nHost: shop.example\r\nTransfer-Encoding: chunked\r\n",
        want=[(b"host", b"shop.example"), *XF, (b"transfer-encoding", b"chunked")],
        chunked=True,
    ),
    Case(
        "client Forwarded and X-Real-IP never pass; X-Real-IP is the client's address",
        b"GET / HTTP/1.1\r\nForwarded: for=203.0.113.1;proto=https\r\nHost: shop.example\r\n"
        b"X-Real-IP: 10.0.0.1\r\nx-real-ip: 10.0.0.2\r\nX-Kept: yes\r\n",
        want=[(b"host", b"shop.example"), (b"x-kept", b"yes"), *XF],
    ),
    Case(
        "absolute form drops client Forwarded and X-Real-IP too",
        b"GET http://shop.example/ HTTP/1.1\r\nHost: shop.example\r\n"
        b"Forwarded: for=1.2.3.4\r\nX-Real-IP: 1.2.3.4\r\n",
        want=[(b"host", b"shop.example"), *XF],
    ),
    Case(
        "the target goes upstream normalised, query as sent",
        b"GET /api/../%61dmin/./x%2fy?q=/../%2e HTTP/1.1\r\nHost: shop.example\r\n",
        target=b"/api/../%61dmin/./x%2fy?q=/../%2e",  # %2f: refused, kept as sent
    ),
    Case(
        "a dot-segment path is resolved before routing and forwarding",
        b"GET /api/v1/../%7Euser/./%c3%a9?x=%2e HTTP/1.1\r\nHost: shop.example\r\n",
        target=b"/api/~user/%C3%A9?x=%2e",
    ),
    Case(
        "Connection naming Transfer-Encoding cannot unframe a chunked body",
        b"POST / HTTP/1.1\r\nHost: shop.example\r\nConnection: transfer-encoding\r\n"
        b"Transfer-Encoding: chunked\r\n",
        present=[(b"transfer-encoding", b"chunked")],
        chunked=True,
    ),
    Case(
        "an oversized Host passes as sent (routing answers it, not the policy)",
        b"GET / HTTP/1.1\r\nHost: " + b"a" * 8000 + b".example\r\n",
        present=[(b"host", b"a" * 8000 + b".example")],
        host=b"a" * 8000 + b".example",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_request_rewrite(case: Case) -> None:
    creq, headers = rewrite(case.head + b"\r\n")
    if case.want is not None:
        assert headers == case.want
    for pair in case.present:
        assert pair in headers
    for name in case.absent:
        assert name not in names(headers)
    assert creq.target == case.target
    assert creq.host == case.host
    assert creq.keep_alive is case.keep_alive
    assert creq.upgrade == case.upgrade
    assert creq.chunked is case.chunked
    assert (creq.bad_target is not None) is (b"%2f" in case.target)
    # Whatever came in: exactly one Host and one of each X-Forwarded-For/-Proto upstream.
    assert len(values(headers, b"host")) == 1
    assert len(values(headers, b"x-forwarded-for")) == 1
    assert values(headers, b"x-real-ip") == [CLIENT]
    assert values(headers, b"x-forwarded-for")[0].endswith(b", " + CLIENT) or values(
        headers, b"x-forwarded-for"
    ) == [CLIENT]
    assert b"forwarded" not in names(headers)
    assert values(headers, b"x-forwarded-proto") == [b"http"]
    assert len(values(headers, b"x-forwarded-host")) == (1 if creq.host else 0)
    for hop in (b"keep-alive", b"te", b"trailer", b"proxy-connection", b"proxy-authorization"):
        assert hop not in names(headers)


def test_fields_reads_h11_headers_as_h11_iterates_them() -> None:
    req = parse(b"GET / HTTP/1.1\r\nHOST: a\r\nX-Mixed-Case: V a l\r\nx-b: \r\nX-B: 2\r\n\r\n")
    assert list(fields(req.headers)) == list(req.headers)
    assert list(fields(req.headers))[1] == (b"x-mixed-case", b"V a l")
    plain = [(b"a", b"1")]
    assert fields(plain) is plain


def test_the_backend_host_goes_idna_encoded() -> None:
    req = parse(b"GET / HTTP/1.0\r\n\r\n")
    creq = read_request(req.http_version, req.target, req.headers)
    headers = upstream_headers(creq, default_host="bücher.example", client=CLIENT, proto=b"http")
    assert values(headers, b"host") == [b"xn--bcher-kva.example"]


def test_content_length_and_proto() -> None:
    creq, headers = rewrite(
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 12\r\n\r\n", proto=b"https"
    )
    assert creq.content_length == 12
    assert (b"x-forwarded-proto", b"https") in headers
    creq, _ = rewrite(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert creq.content_length == -1


def test_request_head_size_counts_the_bytes_sent() -> None:
    raw = b"GET /p?q HTTP/1.1\r\nHost: shop.example\r\nX-A: 1\r\nx-b: \r\n\r\n"
    req = parse(raw)
    assert request_head_size(req.method, req.target, req.headers) == len(raw)


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),  # duplicate Host
        (b"GET / HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host
        (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"GET / HTTP/1.1\r\nHost: a\r\nBad Name: x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: a\x00b\r\n\r\n", 400),
        # a head still incomplete past the limit (the front reads at most 64 KiB at a time)
        (b"GET / HTTP/1.1\r\nHost: " + b"a" * 70_000, 431),
    ],
)
def test_heads_the_policy_never_sees(head: bytes, status: int) -> None:
    """The policy relies on h11 for these: the front answers them before any rewrite."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
    conn.receive_data(head)
    with pytest.raises(h11.RemoteProtocolError) as info:
        conn.next_event()
    assert info.value.error_status_hint == status


# -- responses ---------------------------------------------------------------------------

UPSTREAM_HEADERS: Headers = [
    (b"content-type", b"text/plain"),
    (b"content-length", b"5"),
    (b"keep-alive", b"timeout=5"),
    (b"connection", b"x-secret-hop, content-length"),
    (b"x-secret-hop", b"must not pass"),
    (b"proxy-authenticate", b"Basic"),
    (b"trailer", b"x-sum"),
    (b"set-cookie", b"a=1"),
    (b"set-cookie", b"b=2"),
]


def split_head(head: bytes) -> tuple[bytes, Headers]:
    assert head.endswith(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    return lines[0], [tuple(line.split(b": ", 1)) for line in lines[1:]]  # type: ignore[misc]


def test_response_head_bytes() -> None:
    head = response_head(200, b"OK", [(b"a", b"1"), (b"b", b"")])
    assert head == b"HTTP/1.1 200 OK\r\na: 1\r\nb: \r\n\r\n"


@pytest.mark.parametrize(
    ("status", "length", "head_request", "http11", "keep", "chunked", "keep_after", "extra"),
    [
        # known length: kept as sent
        (200, 5, False, True, True, False, True, []),
        # unknown length to HTTP/1.1: chunked, Content-Length never beside it
        (200, -1, False, True, True, True, True, [(b"transfer-encoding", b"chunked")]),
        # unknown length to HTTP/1.0: until close
        (200, -1, False, False, True, False, False, [(b"connection", b"close")]),
        # no body whatever the length says
        (204, -1, False, True, True, False, True, []),
        (304, -1, False, True, True, False, True, []),
        (200, -1, True, True, True, False, True, []),
        # the client asked to close
        (404, 5, False, True, False, False, False, [(b"connection", b"close")]),
        # interim responses never close nor frame
        (100, -1, False, True, False, False, False, []),
        (103, -1, False, False, True, False, True, []),
    ],
)
def test_frame_response(
    status: int,
    length: int,
    head_request: bool,
    http11: bool,
    keep: bool,
    chunked: bool,
    keep_after: bool,
    extra: Headers,
) -> None:
    head, is_chunked, keep_alive = frame_response(
        status,
        b"Whatever",
        UPSTREAM_HEADERS,
        length=length,
        head_request=head_request,
        http11=http11,
        keep_alive=keep,
    )
    assert (is_chunked, keep_alive) == (chunked, keep_after)
    line, headers = split_head(head)
    assert line == b"HTTP/1.1 %d Whatever" % status
    end_to_end = [
        (b"content-type", b"text/plain"),
        (b"content-length", b"5"),  # a Connection option cannot drop it
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
    ]
    if chunked:
        end_to_end.remove((b"content-length", b"5"))
    assert headers == end_to_end + extra


def test_switch_response() -> None:
    head = switch_response(
        b"Switching Protocols",
        [
            (b"upgrade", b"websocket"),
            (b"connection", b"Upgrade, x-hop"),
            (b"x-hop", b"1"),
            (b"keep-alive", b"timeout=5"),
            (b"proxy-foo", b"1"),
            (b"sec-websocket-accept", b"abc="),
        ],
    )
    line, headers = split_head(head)
    assert line == b"HTTP/1.1 101 Switching Protocols"
    assert headers == [
        (b"sec-websocket-accept", b"abc="),
        (b"connection", b"upgrade"),
        (b"upgrade", b"websocket"),
    ]
