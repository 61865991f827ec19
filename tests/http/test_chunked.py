"""Chunk-size lines of request bodies are held to RFC 9112 §7.1: 1-16 hex digits below
2^63, only `;` extensions, CRLF. h11 alone takes 20 digits (2^64 and more), whitespace
before the CRLF and any bytes after a `;`: a proxy in front that reads them otherwise
frames the body differently, and the difference is a smuggled request."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.http.chunked import MAX_LINE, ChunkedBodyCheck, chunk_size
from nodeagent.http.request import BadRequest, EndOfRequest, RequestHead, RequestReader

GOOD = [
    (b"5\r\n", 5),
    (b"0\r\n", 0),
    (b"00000000000000aB\r\n", 0xAB),
    (b"7fffffffffffffff\r\n", 2**63 - 1),
    (b"5;name\r\n", 5),
    (b"5;a=b;c\r\n", 5),
    (b'5 ; a = "x \\" y" \t;b\r\n', 5),
    (b'5;a=""\r\n', 5),
]
BAD = [
    b"10000000000000000\r\n",    # 2^64: 17 digits
    b"ffffffffffffffff\r\n",     # 2^64 - 1: 16 digits, over 2^63 - 1
    b"8000000000000000\r\n",     # 2^63
    b"000000000000000005\r\n",   # 18 digits, however small
    b"5 \r\n",                   # whitespace without an extension
    b"5\t\r\n",
    b" 5\r\n",
    b"+5\r\n",
    b"0x5\r\n",
    b"-1\r\n",
    b"5\n",                      # bare LF
    b"5\r\r\n",
    b"\r\n",
    b"5;\r\n",                   # an extension without a name
    b"5;a=\r\n",
    b"5;a b\r\n",
    b'5;a="x\r\n',
    b"5;a=b c\r\n",
    b"5 junk\r\n",
    b"5\x00\r\n",
]


@pytest.mark.parametrize("line,size", GOOD)
def test_lines_rfc_9112_allows(line: bytes, size: int) -> None:
    assert chunk_size(line) == size


@pytest.mark.parametrize("line", BAD)
def test_lines_it_does_not(line: bytes) -> None:
    assert chunk_size(line) is None


def feed_in_pieces(data: bytes, cuts: list[int]) -> ChunkedBodyCheck:
    check = ChunkedBodyCheck()
    points = sorted({c % (len(data) + 1) for c in cuts})
    for a, b in zip([0, *points], [*points, len(data)], strict=True):
        check.feed(data[a:b])
    return check


@given(cuts=st.lists(st.integers(0, 200), max_size=6))
def test_a_body_is_followed_to_its_last_chunk_however_it_is_cut(cuts: list[int]) -> None:
    body = b"5;x=1\r\nhello\r\n3\r\n\r\n\n\r\n0\r\nT: v\r\n\r\nGET / HTTP/1.1\r\n\r\n"
    check = feed_in_pieces(body, cuts)
    assert check.done and check.problem is None
    bad = b"5\r\nhello\r\n3 \r\nabc\r\n0\r\n\r\n"
    assert feed_in_pieces(bad, cuts).problem is not None
    no_crlf = b"5\r\nhelloX\r\n0\r\n\r\n"
    assert feed_in_pieces(no_crlf, cuts).problem == "chunk data not followed by CRLF"


def test_an_endless_size_line_is_refused_before_it_ends() -> None:
    check = ChunkedBodyCheck()
    check.feed(b"5;" + b"a" * MAX_LINE)
    assert check.problem is not None and "over" in check.problem


def read(data: bytes) -> list[object]:
    reader = RequestReader()
    reader.feed(data)
    events: list[object] = []
    try:
        for _ in range(20):
            event = reader.next()
            events.append(event)
            if type(event) is EndOfRequest:
                break
    except BadRequest as exc:
        events.append(exc)
    return events


HEAD = b"POST /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("size_line", [b"10000000000000000", b"ffffffffffffffff",
                                       b"5 ", b"5;a b", b"00000000000000000005"])
def test_the_reader_refuses_the_body_counted_as_bad_chunk_size(size_line: bytes) -> None:
    events = read(HEAD + size_line + b"\r\nhello\r\n0\r\n\r\n")
    assert type(events[0]) is RequestHead
    refusal = events[-1]
    assert isinstance(refusal, BadRequest), events
    assert refusal.status == 400 and refusal.reason == "bad_chunk_size"
    assert not any(type(e) is bytes for e in events)  # no byte of the body was given out


def test_the_reader_refuses_a_bad_line_that_arrives_later() -> None:
    reader = RequestReader()
    reader.feed(HEAD + b"5\r\nhel")
    assert type(reader.next()) is RequestHead
    assert reader.next() == b"hel"
    reader.feed(b"lo\r\n10000000000000000\r\n")
    with pytest.raises(BadRequest) as info:  # at once: the line is checked as it arrives
        reader.next()
    assert info.value.reason == "bad_chunk_size"


def test_good_chunked_bodies_read_as_before() -> None:
    events = read(HEAD + b"5;a=b\r\nhello\r\n0\r\nT: v\r\n\r\n")
    assert [e for e in events if type(e) is bytes] == [b"hello"]
    end = events[-1]
    assert type(end) is EndOfRequest and end.trailers == [(b"t", b"v")]
