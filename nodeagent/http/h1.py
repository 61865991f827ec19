"""The upstream side of the HTTP front: a small sans-IO HTTP/1.1 client codec.

The front parses what clients send with `request.RequestReader` (llhttp, and h11 for
whatever is unusual). For upstreams it uses this codec instead:
on this project's 2-core machines one h11 client cycle (send a request, parse a 1 KiB
response) costs about 90 µs of CPU, a third of the front's per-request budget, while the
requests it writes are already validated (parsed strictly on the client side) and the
responses it reads come from the cluster's own backends. This codec writes a request
head with one join and parses the response head with one split; bodies are framed per
RFC 9112 §6.3 (no body for HEAD/1xx/204/304, chunked, Content-Length, or until close).
It is still strict where it matters for a proxy: conflicting Content-Length values,
malformed chunk sizes, oversized heads, an early close and header folding are errors, and
the headers it returns go through the front's header policy (`headers.frame_response`)
before reaching a client.

No I/O here: `ResponseParser.feed(bytes)` then `next()` returns `NEED_DATA`, a
`ResponseHead`, a body `bytes` piece, or `END`. A differential property test checks it
against h11 on random responses split at random points.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

import httptools


class UpstreamProtocolError(Exception):
    """The upstream's response is not valid HTTP/1.1."""


class Sentinel:
    """A parser's answer that is not an event (NEED_DATA, END...)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA: Final = Sentinel("NEED_DATA")
END: Final = Sentinel("END")

# Whole-line patterns, used with fullmatch: `$` would also match before a final LF, and a
# header name "x\n" passed on to the client splits its response.
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: (.*))?")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;.*)?")

# Body framing modes.
_HEAD, _NONE, _LENGTH, _CHUNK_SIZE_LINE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _UNTIL_CLOSE = range(
    8
)
_DONE = 8  # between responses
_SWITCHED = 9  # after a 101
_END = 10  # the body is complete; next() says END once


class ResponseHead:
    """A parsed status line and header block. Header names are lowercased."""

    __slots__ = ("headers", "http_version", "reason", "status")

    def __init__(
        self,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        http_version: bytes,
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.http_version = http_version

    def __repr__(self) -> str:
        return f"ResponseHead({self.status}, {self.reason!r}, {self.headers!r})"


def serialize_request(
    method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]]
) -> bytes:
    """An HTTP/1.1 request head. Names and values must be valid (h11 parsed them)."""
    parts = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def encode_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def encode_last_chunk(trailers: Iterable[tuple[bytes, bytes]] = ()) -> bytes:
    return b"0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in trailers) + b"\r\n"


class ResponseParser:
    """Parses the responses to the requests sent on one upstream connection, in order."""

    __slots__ = (
        "_buf",
        "_eof",
        "_head_only",
        "_mode",
        "_remaining",
        "fast",
        "keep_alive",
        "length",
        "max_head",
        "trailers",
    )

    def __init__(self, max_head: int = 64 * 1024, *, fast: bool = True) -> None:
        self.max_head = max_head
        self.fast = fast
        """False: every head read line by line in Python (the tests' reference)."""
        self._buf = b""
        self._eof = False
        self._mode = _DONE
        self._remaining = 0
        self._head_only = False
        self.keep_alive = True
        self.length = -1
        """The last head's Content-Length, or -1 for chunked / until-close bodies."""
        self.trailers: list[tuple[bytes, bytes]] = []

    def start(self, head_request: bool) -> None:
        """Expect the response to a request just sent (`head_request`: it was a HEAD)."""
        self._mode = _HEAD
        self._head_only = head_request
        self.trailers = []

    @property
    def ends_next(self) -> bool:
        """The body is complete: `next()` returns END without needing more bytes."""
        return self._mode == _END or self._mode == _NONE

    @property
    def reusable(self) -> bool:
        """The last response ended, allowed keep-alive, and nothing unasked-for followed."""
        return self._mode == _DONE and self.keep_alive and not self._buf and not self._eof

    def feed(self, data: bytes | bytearray) -> None:
        """Bytes from the upstream; b"" means it closed its side."""
        if not data:
            self._eof = True
            return
        if type(data) is not bytes:
            data = bytes(data)  # trio's memory and TLS streams hand out bytearrays
        if self._buf:
            self._buf += data
        else:
            self._buf = data

    def rest(self) -> bytes:
        """After a 101: the bytes that followed the response head (they belong to the new
        protocol)."""
        data, self._buf = self._buf, b""
        return data

    def next(self) -> ResponseHead | bytes | Sentinel:
        mode = self._mode
        buf = self._buf
        if mode == _LENGTH:
            if not buf:
                if self._eof:
                    raise UpstreamProtocolError(
                        f"upstream closed with {self._remaining} body bytes missing"
                    )
                return NEED_DATA
            n = self._remaining
            if len(buf) <= n:
                self._buf = b""
                n -= len(buf)
                self._remaining = n
                if n == 0:
                    self._mode = _END
                return buf
            self._buf = buf[n:]
            self._remaining = 0
            self._mode = _END
            return buf[:n]
        if mode == _HEAD:
            return self._parse_head()
        if mode == _END or mode == _NONE:
            self._mode = _DONE
            return END
        if mode == _UNTIL_CLOSE:
            if buf:
                self._buf = b""
                return buf
            if self._eof:
                self._mode = _DONE
                return END
            return NEED_DATA
        if mode == _DONE or mode == _SWITCHED:
            return NEED_DATA
        return self._chunked()

    # -- internals ---------------------------------------------------------------------------

    def _parse_head(self) -> ResponseHead | Sentinel:
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > self.max_head:
                raise UpstreamProtocolError(f"response head over {self.max_head} bytes")
            if self._eof:
                if buf:
                    raise UpstreamProtocolError("upstream closed in the middle of a response head")
                raise UpstreamProtocolError("upstream closed without answering")
            return NEED_DATA
        if end > self.max_head:
            raise UpstreamProtocolError(f"response head over {self.max_head} bytes")
        self._buf = buf[end + 4 :]
        parsed = _llhttp_head(buf, end) if self.fast else None
        minor, status, reason, headers = parsed or _parse_head_lines(buf[:end])
        length = -1
        chunked = False
        transfer_encoding = False
        close = minor == b"0"
        for name, value in headers:
            if name == b"content-length":
                if not value.isdigit() or len(value) > 18:
                    raise UpstreamProtocolError(f"bad Content-Length {value[:40]!r}")
                if length >= 0 and int(value) != length:
                    raise UpstreamProtocolError("conflicting Content-Length values")
                length = int(value)
            elif name == b"transfer-encoding":
                transfer_encoding = True
                chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
            elif name == b"connection":
                tokens = [t.strip().lower() for t in value.split(b",")]
                if b"close" in tokens:
                    close = True
        if reason and _BAD_VALUE.search(reason):
            reason = b""
        head = ResponseHead(status, reason or b"", headers, b"1." + minor)
        self.length = -1 if transfer_encoding else length
        self._remaining = 0
        if status < 200:
            if status == 101:
                self._mode = _SWITCHED
                self.keep_alive = False
            # Other 1xx: the final response follows; stay in _HEAD.
            return head
        self.keep_alive = not close
        if self._head_only or status in (204, 304):
            self._mode = _NONE
        elif transfer_encoding:
            if chunked:
                self._mode = _CHUNK_SIZE_LINE
            else:
                self._mode = _UNTIL_CLOSE
                self.keep_alive = False
        elif length >= 0:
            self._remaining = length
            self._mode = _LENGTH if length else _NONE
        else:
            self._mode = _UNTIL_CLOSE
            self.keep_alive = False
        return head

    def _chunked(self) -> bytes | Sentinel:
        while True:
            mode = self._mode
            buf = self._buf
            if mode == _CHUNK_DATA:
                if not buf:
                    break
                n = self._remaining
                if len(buf) <= n:
                    self._buf = b""
                    self._remaining = n - len(buf)
                    if self._remaining == 0:
                        self._mode = _CHUNK_CRLF
                    return buf
                self._buf = buf[n:]
                self._remaining = 0
                self._mode = _CHUNK_CRLF
                return buf[:n]
            eol = buf.find(b"\r\n")
            if eol < 0:
                if len(buf) > 4096:
                    raise UpstreamProtocolError("chunk size or trailer line too long")
                break
            line = buf[:eol]
            self._buf = buf[eol + 2 :]
            if mode == _CHUNK_CRLF:
                if line:
                    raise UpstreamProtocolError("missing CRLF after chunk data")
                self._mode = _CHUNK_SIZE_LINE
            elif mode == _CHUNK_SIZE_LINE:
                m = _CHUNK_SIZE.fullmatch(line)
                if m is None:
                    raise UpstreamProtocolError(f"bad chunk size line {line[:40]!r}")
                size = int(m.group(1), 16)
                if size:
                    self._remaining = size
                    self._mode = _CHUNK_DATA
                else:
                    self._mode = _TRAILERS
            else:  # _TRAILERS
                if not line:
                    self._mode = _DONE
                    return END
                colon = line.find(b":")
                if colon <= 0 or len(self.trailers) > 100:
                    raise UpstreamProtocolError(f"bad trailer line {line[:80]!r}")
                name = line[:colon].lower()
                if not _TOKEN.fullmatch(name):
                    raise UpstreamProtocolError(f"bad trailer name {name[:80]!r}")
                self.trailers.append((name, line[colon + 1 :].strip(b" \t")))
        if self._eof:
            raise UpstreamProtocolError("upstream closed in the middle of a chunked body")
        return NEED_DATA


def _parse_head_lines(head: bytes) -> tuple[bytes, int, bytes, list[tuple[bytes, bytes]]]:
    """A response head read line by line in Python: (minor version, status, reason,
    headers). The reference for `_llhttp_head`, and what reads every head it declines."""
    lines = head.split(b"\r\n")
    m = _STATUS_LINE.fullmatch(lines[0])
    if m is None:
        raise UpstreamProtocolError(f"bad status line {lines[0][:80]!r}")
    minor, code, reason = m.groups()
    status = int(code)
    if status < 100:
        raise UpstreamProtocolError(f"bad status code {status}")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        colon = line.find(b":")
        if colon <= 0:
            raise UpstreamProtocolError(f"bad header line {line[:80]!r}")
        name = line[:colon].lower()
        if not _TOKEN.fullmatch(name):
            raise UpstreamProtocolError(f"bad header name {name[:80]!r}")
        value = line[colon + 1 :].strip(b" \t")
        if _BAD_VALUE.search(value):
            raise UpstreamProtocolError(f"bad value in header {name.decode()}")
        headers.append((name, value))
    return minor, status, reason or b"", headers


class _HeadFields:
    """llhttp's callbacks for one response head (httptools looks them up by name)."""

    __slots__ = ("headers",)

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        # llhttp drops leading whitespace only; the Python reader strips both ends.
        self.headers.append((name.lower(), value.rstrip(b" \t")))


_MINOR = {"1.1": b"1", "1.0": b"0"}


def _llhttp_head(
    buf: bytes, end: int
) -> tuple[bytes, int, bytes, list[tuple[bytes, bytes]]] | None:
    """The head `buf[:end + 4]` read by llhttp (httptools, strict), ~2 µs for a
    9-field head against ~15 µs line by line here; None when llhttp refuses it or it is
    one the Python reader might read differently (then that reader decides). Only the
    head is fed: a parser per head, the body is framed by ResponseParser."""
    fields = _HeadFields()
    parser = httptools.HttpResponseParser(fields)
    try:
        parser.feed_data(memoryview(buf)[: end + 4])
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None
    minor = _MINOR.get(parser.get_http_version())
    status = parser.get_status_code()
    if minor is None or not 100 <= status <= 999:
        return None
    # The status line as _STATUS_LINE reads it: llhttp takes a few shapes it does not.
    line_end = buf.find(b"\r\n")
    if not buf.startswith(b"HTTP/1.%b %d" % (minor, status)):
        return None
    if line_end > 12:
        if buf[12:13] != b" ":
            return None
        reason = buf[13:line_end]
        if b"\n" in reason or b"\r" in reason:
            return None
    else:
        reason = b""
    return minor, status, reason, fields.headers
