"""The client side of the HTTP front: one request parser per connection, sans-IO.

`RequestReader` reads the requests of one client connection in turn, like h11's server
side but for requests only (the front writes responses itself): `feed(bytes)` (b"" when
the client closed), then `next()` gives `NEED_DATA`, a `RequestHead`, a body piece
(`bytes`), an `EndOfRequest`, `CLOSED` (the client closed between requests) or `PAUSED`
(the request is read: nothing more until `start_next()`, or ever after an upgrade). A
request it refuses raises `BadRequest` with the status to answer (400 or 431).

Two parsers behind it. Request heads go to llhttp (httptools, strict: no leniency is
turned on), fed exactly one head at a time so that it stays in step with the requests;
bodies framed by Content-Length are counted here (and fed to llhttp too, so that one
parser serves the whole connection). Why: a head costs llhttp several times less CPU
than a fresh `h11.Connection` per request (`python -m scripts.bench.http_parse` measures
both; docs/performance.md has today's figures).

h11 stays the reference and the authority for everything unusual. A request that llhttp
refuses (bare CR or LF, obs-fold, control characters, non-ASCII targets, duplicate or
conflicting Content-Length, Content-Length with Transfer-Encoding...) or that the fast
path declines (Transfer-Encoding at all, an Upgrade or CONNECT, a Host count other than
one, a version other than 1.0 or 1.1, runs of spaces in the request line or blank lines
before it, a head not complete within the size limit or cut by the client's close) is
read by an `h11.Connection` from its first byte, so the answer to a strange request is
h11's, its smuggling defences included, with one more: a chunked body's size lines are held
to RFC 9112 (`chunked`) before h11 reads them. `tests/http/test_request.py` feeds both the same
bytes (hypothesis) and asserts the same heads, bodies and refusals.
"""

from __future__ import annotations

from typing import Final

import h11
import httptools

from nodeagent.http.chunked import ChunkedBodyCheck
from nodeagent.http.h1 import NEED_DATA, Sentinel
from nodeagent.http.stats import RefusalReason

CLOSED: Final = Sentinel("CLOSED")
PAUSED: Final = Sentinel("PAUSED")


class BadRequest(Exception):
    """The client's request is not one the front may serve; `status` says what to answer,
    `reason` how the refusal is counted (`stats.RefusalReason`)."""

    def __init__(self, status: int, detail: str, reason: RefusalReason = "malformed") -> None:
        super().__init__(detail)
        self.status = status
        self.reason: RefusalReason = reason


class RequestHead:
    """A request line and header block. Names are lowercased; values stripped of OWS."""

    __slots__ = ("headers", "http_version", "method", "target")

    def __init__(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], http_version: bytes
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.http_version = http_version

    def __repr__(self) -> str:
        return (
            f"RequestHead({self.method!r}, {self.target!r}, {self.headers!r}, "
            f"{self.http_version!r})"
        )


class EndOfRequest:
    """The request's body is complete; `trailers` from a chunked body (lowercased)."""

    __slots__ = ("trailers",)

    def __init__(self, trailers: list[tuple[bytes, bytes]]) -> None:
        self.trailers = trailers


_NO_TRAILERS: Final = EndOfRequest([])

Event = RequestHead | bytes | EndOfRequest | Sentinel
"""What `RequestReader.next()` gives."""

_VERSIONS: Final = {"1.1": b"1.1", "1.0": b"1.0"}
# Fields after which the fast path hands the request to h11 (see the module docstring).
_TO_H11 = frozenset({b"transfer-encoding", b"upgrade"})

_HEAD, _BODY, _END, _DONE, _H11 = range(5)


class RequestReader:
    """Parses the requests of one client connection, in order. One per connection."""

    __slots__ = (
        "_buf",
        "_chunks",
        "_content_length",
        "_eof",
        "_h11",
        "_headers",
        "_hosts",
        "_llhttp",
        "_mode",
        "_remaining",
        "_scan",
        "_to_h11",
        "_url",
        "fast",
        "max_head",
    )

    def __init__(self, max_head: int = 64 * 1024, *, fast: bool = True) -> None:
        self.max_head = max_head
        self.fast = fast
        """False: every request goes to h11 (the reference the tests compare against)."""
        self._buf = b""
        self._eof = False
        self._scan = 0  # where to look for the end of the head next time
        self._mode = _HEAD
        self._remaining = 0
        self._llhttp: httptools.HttpRequestParser | None = None
        self._h11: h11.Connection | None = None
        # A chunked body's size lines, checked before h11 reads them (see `chunked`).
        self._chunks: ChunkedBodyCheck | None = None
        # Filled by llhttp's callbacks while it reads one head.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._hosts = 0
        self._content_length = -1
        self._to_h11 = False

    # -- the interface -----------------------------------------------------------------

    def feed(self, data: bytes | bytearray) -> None:
        """Bytes from the client; b"" means it closed its side."""
        conn = self._h11
        if conn is not None:
            chunks = self._chunks
            if chunks is not None and data and not chunks.done:
                chunks.feed(bytes(data))
            conn.receive_data(bytes(data))
            return
        if not data:
            self._eof = True
            return
        if type(data) is not bytes:
            data = bytes(data)  # trio's streams may hand out bytearrays
        self._buf = self._buf + data if self._buf else data

    @property
    def done(self) -> bool:
        """The current request was read to its end (the next may follow its response)."""
        conn = self._h11
        if conn is not None:
            return conn.their_state is h11.DONE
        return self._mode == _DONE

    @property
    def trailing_data(self) -> bytes:
        """Bytes received after the current request (after an upgrade: the new protocol's)."""
        conn = self._h11
        if conn is not None:
            return bytes(conn.trailing_data[0])
        return self._buf if self._mode == _DONE else b""

    def start_next(self) -> int:
        """The response to the current request went out: read the next. Returns how many of
        its bytes were already received."""
        conn = self._h11
        if conn is not None:
            rest, eof = conn.trailing_data
            self._h11 = None
            self._chunks = None
            self._llhttp = None  # it stopped somewhere in that request: a fresh one
            self._buf = bytes(rest)
            self._eof = eof
        self._mode = _HEAD
        self._scan = 0
        return len(self._buf)

    def next(self) -> Event:
        mode = self._mode
        if mode == _HEAD:
            return self._head()
        if mode == _BODY:
            buf = self._buf
            if not buf:
                if self._eof:
                    raise BadRequest(
                        400,
                        "peer closed connection without sending complete message body: "
                        f"{self._remaining} bytes missing",
                    )
                return NEED_DATA
            n = self._remaining
            if len(buf) <= n:
                self._buf = b""
            else:
                self._buf = buf[n:]
                buf = buf[:n]
            n -= len(buf)
            self._remaining = n
            parser = self._llhttp
            assert parser is not None
            parser.feed_data(buf)  # keeps llhttp in step: it completes the message at 0
            if n == 0:
                self._mode = _END
            return buf
        if mode == _END:
            self._mode = _DONE
            return _NO_TRAILERS
        if mode == _DONE:
            return PAUSED
        return self._from_h11()

    # -- llhttp's callbacks (httptools looks them up by name) --------------------------

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"host":
            self._hosts += 1
        elif name == b"content-length":
            self._content_length = int(value)  # llhttp allows digits only, and one
        elif name in _TO_H11:
            self._to_h11 = True
        # llhttp drops leading whitespace only; h11 strips both ends.
        self._headers.append((name, value.rstrip(b" \t")))

    # -- internals ---------------------------------------------------------------------

    def _head(self) -> Event:
        buf = self._buf
        if not self.fast:
            return self._hand_to_h11()
        end = buf.find(b"\r\n\r\n", self._scan)
        if end < 0:
            if not buf and self._eof:
                return CLOSED
            if len(buf) > self.max_head or self._eof or b"\n\n" in buf or b"\n\r\n" in buf:
                return self._hand_to_h11()  # its refusal (431, a cut head) or a bare-LF head
            self._scan = max(0, len(buf) - 3)
            return NEED_DATA
        end += 4
        head = buf[:end] if end < len(buf) else buf
        # llhttp is stricter than h11 about the bytes of a head (bare CR or LF, obs-fold,
        # control characters, non-ASCII targets: it refuses them, and h11 answers), and
        # more lenient about its shape in three ways checked here: runs of spaces in the
        # request line, blank lines before it, trailing whitespace in values.
        if end > self.max_head:
            return self._hand_to_h11()
        parser = self._llhttp
        if parser is None:
            parser = self._llhttp = httptools.HttpRequestParser(self)
        self._url = b""
        headers: list[tuple[bytes, bytes]] = []
        self._headers = headers
        self._hosts = 0
        self._content_length = -1
        self._to_h11 = False
        try:
            parser.feed_data(head)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return self._hand_to_h11()
        method: bytes = parser.get_method()
        version = _VERSIONS.get(parser.get_http_version())
        url = self._url
        if (
            version is None
            or self._hosts != 1
            or self._to_h11
            or method == b"CONNECT"
            # llhttp takes runs of spaces in the request line; h11 takes one.
            or not buf.startswith(b"%b %b HTTP/%b\r\n" % (method, url, version))
        ):
            return self._hand_to_h11()
        self._buf = buf[end:] if end < len(buf) else b""
        length = self._content_length
        if length > 0:
            self._remaining = length
            self._mode = _BODY
        else:
            self._mode = _END
        return RequestHead(method, url, headers, version)

    def _hand_to_h11(self) -> Event:
        conn = self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head)
        self._chunks = None
        if self._buf:
            conn.receive_data(self._buf)
        if self._eof:
            conn.receive_data(b"")
        self._buf = b""
        self._mode = _H11
        return self._from_h11()

    def _from_h11(self) -> Event:
        conn = self._h11
        assert conn is not None
        chunks = self._chunks
        if chunks is not None and chunks.problem is not None:
            raise BadRequest(400, chunks.problem, "bad_chunk_size")
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise BadRequest(exc.error_status_hint, str(exc)) from None
        t = type(event)
        if t is h11.Data:
            return bytes(event.data)  # type: ignore[union-attr]
        if t is h11.Request:
            assert isinstance(event, h11.Request)
            headers = [(name, value) for _, name, value in event.headers._full_items]
            if any(name == b"transfer-encoding" for name, _ in headers):
                # h11 took it, so it is chunked: what it holds beyond the head is the body.
                chunks = self._chunks = ChunkedBodyCheck()
                chunks.feed(conn.trailing_data[0])
            return RequestHead(event.method, event.target, headers, event.http_version)
        if t is h11.EndOfMessage:
            assert isinstance(event, h11.EndOfMessage)
            return EndOfRequest(list(event.headers))
        if event is h11.NEED_DATA:
            return NEED_DATA
        return CLOSED if t is h11.ConnectionClosed else PAUSED


__all__ = [
    "CLOSED",
    "NEED_DATA",
    "PAUSED",
    "BadRequest",
    "EndOfRequest",
    "RequestHead",
    "RequestReader",
]
