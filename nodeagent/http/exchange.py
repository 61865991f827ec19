"""One request's exchange with a backend, whatever protocol the backend speaks.

The HTTP/2 front (`h2connection`) and the HTTP/1.1 front's h2c path (`connection`) send a
request and relay its response through one small interface, `Exchange`: `send_body`,
`end_body(trailers)`, `receive()` (a `ResponseStart`, body `bytes`, then a `ResponseEnd`
with the trailers), and `finish()` / `abort()`. Two implementations:

- `H1Exchange`: an HTTP/1.1 upstream (`upstream.Upstream`, a tunnel stream of its own), the
  request written by `h1.serialize_request` (a body without a declared length goes
  chunked, its trailers as chunked trailers), the response parsed by `h1.ResponseParser`;
  1xx responses other than 101 are skipped, 101 is an error (HTTP/2 has no Upgrade).
- `H2cExchange` (in `h2pool`): a stream on the backend's shared h2c connection.

`receive()` gives back the window of the data it returned before, on the next call: by
then the caller has forwarded it, so an h2c backend's data is bounded by the windows on
both sides.
"""

from __future__ import annotations

from typing import Protocol, cast

import trio

from nodeagent.http.h1 import (
    NEED_DATA,
    ResponseHead,
    UpstreamProtocolError,
    encode_chunk,
    encode_last_chunk,
)
from nodeagent.http.headers import Headers
from nodeagent.http.routetable import Backend
from nodeagent.http.upstream import Upstream, UpstreamFailed


class ResponseStart:
    """A backend's final response head: status and regular fields (lowercased names)."""

    __slots__ = ("ended", "headers", "length", "status")

    def __init__(self, status: int, headers: Headers, ended: bool = False,
                 length: int = -1) -> None:
        self.status = status
        self.headers = headers
        self.ended = ended
        """No body and no trailers follow (a gRPC trailers-only response)."""
        self.length = length
        """Body length the backend declared, -1 when unknown."""


class ResponseEnd:
    __slots__ = ("trailers",)

    def __init__(self, trailers: Headers) -> None:
        self.trailers = trailers


class Exchange(Protocol):
    backend: Backend

    async def send_body(self, data: bytes) -> None: ...

    async def end_body(self, trailers: Headers) -> None: ...

    async def receive(self) -> ResponseStart | bytes | ResponseEnd: ...

    def ends_next(self) -> bool:
        """The next `receive()` returns a `ResponseEnd` without trailers at once: the
        HTTP/2 front then ends the stream on the last DATA frame, not an empty one after."""
        ...

    async def finish(self) -> bool:
        """The exchange ended well; whether its upstream can serve another request."""
        ...

    async def abort(self) -> None:
        """Reset the request upstream (client gone, deadline, error)."""
        ...


class H1Exchange:
    """A request on an HTTP/1.1 upstream; see the module docstring."""

    __slots__ = ("_got_any", "backend", "chunked", "read_size", "reused", "up")

    def __init__(self, up: Upstream, *, chunked: bool, head_request: bool, reused: bool,
                 read_size: int) -> None:
        self.up = up
        self.backend = up.backend
        self.chunked = chunked
        self.reused = reused
        self.read_size = read_size
        self._got_any = False
        up.request_done = False
        up.parser.start(head_request)

    async def start(self, head: bytes, end: bool) -> None:
        """Send the head; `end`: the request has no body."""
        if end:
            if self.chunked:
                head += encode_last_chunk()
            self.up.request_done = True
        await self.up.send(head, stale=self.reused)

    async def send_body(self, data: bytes) -> None:
        await self.up.send(encode_chunk(data) if self.chunked else data)

    async def end_body(self, trailers: Headers) -> None:
        if self.chunked:
            await self.up.send(encode_last_chunk(trailers))
        self.up.request_done = True

    async def receive(self) -> ResponseStart | bytes | ResponseEnd:
        up = self.up
        parser = up.parser
        try:
            while True:
                event = parser.next()
                if event is NEED_DATA:
                    try:
                        data = cast(bytes, await up.stream.receive_some(self.read_size))
                    except (trio.BrokenResourceError, trio.ClosedResourceError,
                            OSError) as exc:
                        raise UpstreamFailed(502, f"upstream {up.backend} broke: {exc}",
                                             stale=self.reused and not self._got_any) from exc
                    if not data and not self._got_any:
                        raise UpstreamFailed(
                            502, f"upstream {up.backend} closed the connection without "
                                 f"answering", stale=self.reused)
                    self._got_any = True
                    parser.feed(data)
                    continue
                t = type(event)
                if t is bytes:
                    return cast(bytes, event)
                if t is ResponseHead:
                    head = cast(ResponseHead, event)
                    if head.status == 101:
                        raise UpstreamFailed(502, f"upstream {up.backend} switched protocols "
                                                  f"on a request that cannot")
                    if head.status < 200:
                        continue  # 100 Continue and friends: not relayed
                    return ResponseStart(head.status, head.headers, length=parser.length)
                return ResponseEnd(parser.trailers)
        except UpstreamProtocolError as exc:
            raise UpstreamFailed(
                502, f"upstream {up.backend} sent a malformed response: {exc}") from exc

    def ends_next(self) -> bool:
        return self.up.parser.ends_next and not self.up.parser.trailers

    async def finish(self) -> bool:
        up = self.up
        if up.request_done and up.parser.reusable:
            return True
        await trio.aclose_forcefully(up.stream)
        return False

    async def abort(self) -> None:
        await trio.aclose_forcefully(self.up.stream)


__all__ = ["Exchange", "H1Exchange", "ResponseEnd", "ResponseStart"]
