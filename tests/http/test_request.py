"""The front's request parser: llhttp's fast path against h11, the reference, on the same bytes.

`RequestReader(fast=False)` reads every request with h11 alone (what the front did before);
the default reads plain heads with llhttp. Driven the way the front drives it (the next
request is read only after a kept-alive request was read to its end), both must give the
same heads, bodies, ends and refusals, for well-formed requests, smuggling attempts and
garbage alike, split at any points.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeagent.http.headers import read_request
from nodeagent.http.request import (
    CLOSED,
    NEED_DATA,
    PAUSED,
    BadRequest,
    EndOfRequest,
    RequestHead,
    RequestReader,
)


def drive(reader: RequestReader, chunks: list[bytes]) -> list[Any]:
    """What the front would see: heads, each body joined, ends, and the refusal if any."""
    out: list[Any] = []
    pending = [*chunks, b""]  # the client closes at the end
    body = b""
    keep = False
    try:
        while True:
            event = reader.next()
            if event is NEED_DATA:
                assert pending, "asked for data after the close"
                reader.feed(pending.pop(0))
                continue
            if type(event) is bytes:
                body += event
                continue
            if body:
                out.append(("body", body))
                body = b""
            if type(event) is RequestHead:
                out.append(("head", event.method, event.target, event.headers, event.http_version))
                keep = read_request(event.http_version, event.target, event.headers).keep_alive
            elif type(event) is EndOfRequest:
                out.append(("end", event.trailers))
                if not (keep and reader.done):
                    break
                reader.start_next()
            else:
                assert event is CLOSED or event is PAUSED
                out.append(repr(event))
                break
    except BadRequest as exc:
        if body:
            out.append(("body", body))
        out.append(("refused", exc.status))
    return out


def both(data: bytes, cuts: list[int] = [], max_head: int = 16 * 1024) -> list[Any]:  # noqa: B006
    points = sorted({c % (len(data) + 1) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    chunks = [c for c in chunks if c]
    reference = drive(RequestReader(max_head, fast=False), chunks)
    fast = drive(RequestReader(max_head), chunks)
    assert fast == reference, (data, chunks)
    return fast


# -- examples first: what the front's hardening tests rely on ---------------------------


def test_plain_keep_alive_requests_take_the_fast_path() -> None:
    data = (
        b"GET /a?b=1 HTTP/1.1\r\nHost: h\r\nUser-Agent: x y  \r\nAccept:*/*\r\n\r\n"
        b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello"
        b"GET /c HTTP/1.1\r\nhost: h\r\nConnection: close\r\n\r\n"
    )
    out = both(data, [3, 40, 90])
    assert [e[0] if isinstance(e, tuple) else e for e in out] == [
        "head",
        "end",
        "head",
        "body",
        "end",
        "head",
        "end",
    ]
    assert out[0][3] == [(b"host", b"h"), (b"user-agent", b"x y"), (b"accept", b"*/*")]
    reader = RequestReader()
    reader.feed(data)
    assert type(reader.next()) is RequestHead
    assert reader._h11 is None  # llhttp read it


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # Content-Length and Transfer-Encoding: framed by the latter (h11), then closed.
        (
            b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\nGET /s HTTP/1.1\r\n\r\n",
            ["head", ("body", b"hello"), "end"],
        ),
        # Conflicting Content-Length values.
        (
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            [("refused", 400)],
        ),
        # obs-fold: h11 unfolds it (llhttp refuses it: so it goes to h11).
        (b"GET / HTTP/1.1\r\nHost: h\r\nX: a\r\n b\r\n\r\n", ["head", "end", "CLOSED"]),
        (b"GET / HTTP/1.1\r\nHost: h\r\n\r\n", ["head", "end", "CLOSED"]),
        (b"GET / HTTP/1.1\r\n\r\n", [("refused", 400)]),  # no Host
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", [("refused", 400)]),
        (b"GET  / HTTP/1.1\r\nHost: h\r\n\r\n", [("refused", 400)]),  # llhttp would take it
        (b"GET / HTTP/1.1\r\nHost: h\x7f\r\n\r\n", ["head", "end", "CLOSED"]),  # h11 takes DEL
        (b"GET / HTTP/1.1\r\nHo st: h\r\n\r\n", [("refused", 400)]),
        (
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nab",
            ["head", ("body", b"ab"), ("refused", 400)],
        ),
        (b"GET / HTTP/1.1\r\nHost: h\r\n", [("refused", 400)]),  # cut by the close
        (b"\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n", [("refused", 400)]),
    ],
)
def test_smuggling_and_malformed_heads_are_h11s_answer(data: bytes, expected: list[Any]) -> None:
    out = both(data)
    assert [
        e
        if isinstance(e, tuple) and e[0] in ("body", "refused")
        else e[0]
        if isinstance(e, tuple)
        else e
        for e in out
    ] == expected


def test_bare_lf_heads_as_h11_reads_them() -> None:
    out = both(b"GET / HTTP/1.1\nHost: h\n\nGET /2 HTTP/1.1\r\nHost: h\r\n\r\n", [5])
    assert [e[2] for e in out if e[0] == "head"] == [b"/", b"/2"]


def test_head_limits() -> None:
    big = b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"v" * 2000
    assert both(big, [100, 1000], max_head=1000) == [("refused", 431)]
    # A whole head over the limit in one piece: h11 takes it, and so does the fast path
    # (the front measures it: test_hardening's test_a_head_that_arrives_whole_is_measured).
    whole = big + b"\r\n\r\n"
    assert both(whole, max_head=1000)[0][0] == "head"


def test_upgrade_is_left_to_h11() -> None:
    data = (
        b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        b"early bytes"
    )
    reader = RequestReader()
    reader.feed(data)
    assert type(reader.next()) is RequestHead
    assert type(reader.next()) is EndOfRequest
    assert reader.next() is PAUSED and not reader.done
    assert reader.trailing_data == b"early bytes"


# -- the differential property test ------------------------------------------------------

_EOL = st.sampled_from([b"\r\n"] * 12 + [b"\n", b"\r", b"\r\r\n", b"\n\r"])
_METHOD = st.sampled_from(
    [b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"get", b"CONNECT", b"FOO", b""]
)
_TARGET = st.one_of(
    st.sampled_from(
        [
            b"/",
            b"/a/b?c=d&e",
            b"*",
            b"http://h:8/x",
            b"/%41",
            b"/\x80",
            b"/a b",
            b"",
            b"/\x00",
            b"h:443",
            b"/~!$&'()*+,;=:@",
            b"/a#f",
            b"/?",
            b"//x",
        ]
    ),
    st.binary(max_size=8).map(lambda b: b"/" + b),
)
_VERSION = st.sampled_from(
    [b"HTTP/1.1"] * 6
    + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.1 ", b"http/1.1", b"HTTP/11"]
)
_SP = st.sampled_from([b" "] * 8 + [b"  ", b"\t", b""])
_FIELD = st.one_of(
    st.sampled_from(
        [
            b"Host: h",
            b"Host: h",
            b"Host: h",
            b"host:h ",
            b"Host:",
            b"Host: a b",
            b"Content-Length: 3",
            b"Content-Length: 0",
            b"Content-Length: 03",
            b"Content-Length: 3, 3",
            b"Content-Length: -1",
            b"Content-Length: 1x",
            b"Content-Length:  3 ",
            b"Content-Length: 99999999999999999999",
            b"Transfer-Encoding: chunked",
            b"Transfer-Encoding: gzip, chunked",
            b"Transfer-Encoding: gzip",
            b"transfer-encoding : chunked",
            b"Connection: close",
            b"Connection: keep-alive",
            b"Connection: Upgrade",
            b"Upgrade: websocket",
            b"Expect: 100-continue",
            b"X-A: \x80\xff",
            b"X-A: a\x01b",
            b"X-A: a\x7fb",
            b"X-A:\ta\t",
            b" X-A: folded",
            b"\tcontinued",
            b": empty",
            b"X A: b",
            b"X-\x00: b",
            b"x" * 300 + b": long",
        ]
    ),
    st.binary(max_size=20).map(lambda b: b"X-R: " + b),
    st.binary(max_size=6).map(lambda b: b + b": v"),
)
_BODY = st.one_of(
    st.just(b""),
    st.sampled_from(
        [
            b"abc",
            b"3\r\nabc\r\n0\r\n\r\n",
            b"0\r\n\r\n",
            b"3\r\nabc\r\n0\r\nT: v\r\n\r\n",
            b"x\r\n",
            b"3;ext=1\r\nabc\r\n0\r\n\r\n",
        ]
    ),
    st.binary(max_size=30),
)


@st.composite
def _request(draw: st.DrawFn) -> bytes:
    eol = draw(_EOL) if draw(st.integers(0, 9)) == 0 else b"\r\n"
    line = draw(_METHOD) + draw(_SP) + draw(_TARGET) + draw(_SP) + draw(_VERSION)
    fields = draw(st.lists(_FIELD, max_size=6))
    if draw(st.integers(0, 4)):
        fields.insert(draw(st.integers(0, len(fields))), b"Host: h")
    head = eol.join([line, *fields]) + eol + eol
    return head + draw(_BODY)


_NAME = st.from_regex(rb"\A[-!#$%&'*+.^_`|~0-9A-Za-z]{1,12}\Z")
_VALUE = st.from_regex(rb"\A[\x21-\x7e\x80-\xff]([\x20-\x7e\x80-\xff]{0,20}[\x21-\x7e])?\Z")


@st.composite
def _plain_request(draw: st.DrawFn) -> bytes:
    """Mostly what real clients send (the fast path's share), at times with one flaw."""
    method = draw(st.sampled_from([b"GET", b"GET", b"POST", b"HEAD", b"PUT", b"OPTIONS"]))
    target = draw(st.from_regex(rb"\A/[\x21-\x7e]{0,20}\Z"))
    version = draw(st.sampled_from([b"1.1", b"1.1", b"1.1", b"1.0"]))
    fields = draw(st.lists(st.tuples(_NAME, _VALUE), max_size=5))
    fields = [(n, v) for n, v in fields if n.lower() not in (b"host", b"content-length")]
    fields.insert(draw(st.integers(0, len(fields))), (b"Host", draw(_VALUE)))
    body = b""
    if method in (b"POST", b"PUT") and draw(st.booleans()):
        body = draw(st.binary(max_size=40))
        fields.append((b"Content-Length", b"%d" % len(body)))
    lines = [b"%b %b HTTP/%b" % (method, target, version)]
    lines += [n + b":" + draw(st.sampled_from([b" ", b"", b"\t", b"  "])) + v for n, v in fields]
    data = b"\r\n".join(lines) + b"\r\n\r\n" + body
    if draw(st.integers(0, 3)) == 0:  # one flaw: a byte replaced, inserted or removed
        i = draw(st.integers(0, len(data)))
        b = draw(st.binary(min_size=1, max_size=1))
        data = draw(
            st.sampled_from(
                [data[:i] + b + data[i + 1 :], data[:i] + b + data[i:], data[:i] + data[i + 1 :]]
            )
        )
    return data


_STREAM = st.one_of(
    st.lists(_plain_request(), min_size=1, max_size=3).map(b"".join),
    st.lists(_request(), min_size=1, max_size=3).map(b"".join),
    st.binary(max_size=200),
    st.tuples(st.lists(_request(), max_size=2).map(b"".join), st.binary(max_size=40)).map(
        lambda t: t[0] + t[1]
    ),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_STREAM, cuts=st.lists(st.integers(0, 2000), max_size=4))
def test_same_events_and_refusals_as_h11(data: bytes, cuts: list[int]) -> None:
    both(data, cuts, max_head=256)
