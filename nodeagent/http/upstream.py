"""A client connection's upstream side: the held upstream stream and how a new one is dialed.

`dial_upstream` tries a route's backends in the `Balancer`'s order (at most
`max_dial_attempts`, each within `dial_timeout`) through the caller's opener, and maps every
failure to the status the client gets: `UpstreamUnavailable` carries its own, a timeout is
504, any other `OSError` 502. `Upstream` is what a connection holds between requests: the
stream, its response parser, and whether the last request went out whole.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from nodeagent.http.balancer import Balancer
from nodeagent.http.errors import UpstreamUnavailable
from nodeagent.http.h1 import ResponseParser, encode_chunk, encode_last_chunk
from nodeagent.http.limits import Limits
from nodeagent.http.routetable import Backend, Route
from nodeagent.http.stats import HttpStats
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.http")

Opener = Callable[[Backend, Route, str], Awaitable[trio.abc.HalfCloseableStream]]
"""`open_upstream(backend, route, client)`: a stream to the backend for the client at
address `client` (which the debug views show on both sides of the tunnel), or
`UpstreamUnavailable`."""


class UpstreamFailed(Exception):
    """No upstream, or it failed during the exchange: `status` is the answer to the client."""

    def __init__(self, status: int, reason: str, stale: bool = False) -> None:
        super().__init__(status, reason)
        self.status = status
        self.reason = reason
        self.stale = stale
        """A kept-alive upstream that failed before any response byte: worth one retry."""


class UpstreamRequest:
    """A request as it goes upstream: the head bytes and the body framing."""

    __slots__ = ("chunked", "head", "method")

    def __init__(self, method: bytes, head: bytes, chunked: bool) -> None:
        self.method = method
        self.head = head
        self.chunked = chunked


class Upstream:
    """One upstream stream of a client connection, reused across its requests."""

    __slots__ = ("backend", "chunked", "parser", "request_done", "stream")

    def __init__(
        self, backend: Backend, stream: trio.abc.HalfCloseableStream, max_head: int
    ) -> None:
        self.backend = backend
        self.stream = stream
        self.parser = ResponseParser(max_head)
        self.request_done = False
        """The whole request (head and body) was sent: one condition for reuse."""
        self.chunked = False
        """The request in progress has a chunked body."""

    async def send_body(self, data: bytes) -> None:
        """A piece of the request body, framed as the request's head said."""
        await self.send(encode_chunk(data) if self.chunked else data)

    async def end_body(self, trailers: list[tuple[bytes, bytes]]) -> None:
        if self.chunked:
            await self.send(encode_last_chunk(trailers))
        self.request_done = True

    async def send(self, data: bytes, stale: bool = False) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise UpstreamFailed(
                502, f"upstream {self.backend} closed the connection", stale=stale
            ) from exc


async def dial_upstream(
    route: Route, opener: Opener, balancer: Balancer, limits: Limits, stats: HttpStats,
    client: str = "",
) -> Upstream:
    """A new upstream to one of `route`'s backends; raises `UpstreamFailed` with the last
    failure when none could be reached."""
    failure: UpstreamFailed | None = None  # built only on the failing path
    for backend in balancer.candidates(route)[: limits.max_dial_attempts]:
        try:
            with trio.fail_after(limits.dial_timeout):
                stream = await opener(backend, route, client)
        except trio.TooSlowError:
            stats.timeouts += 1
            failure = UpstreamFailed(
                504, f"dialing {backend} timed out after {limits.dial_timeout:g}s"
            )
        except UpstreamUnavailable as exc:
            failure = UpstreamFailed(exc.status, exc.reason)
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            failure = UpstreamFailed(502, f"cannot connect to {backend}: {reason}")
        else:
            stats.upstream_opens += 1
            balancer.succeeded(backend)
            return Upstream(backend, stream, limits.max_header_bytes)
        stats.upstream_errors += 1
        balancer.failed(backend)
        log.info(
            "upstream unavailable",
            route=route.name,
            backend=str(backend),
            status=failure.status,
            reason=failure.reason,
        )
    raise failure or UpstreamFailed(502, f"route {route.name}: no backend could be reached")


__all__ = [
    "Opener",
    "Upstream",
    "UpstreamFailed",
    "UpstreamRequest",
    "dial_upstream",
]
