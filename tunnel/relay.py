"""Joining a stream or a connection to its upstream: open → refuse or accept → splice.

The agent (streams the server opens), the server (streams agents open, TCP mappings) and
the agent's transparent proxy (intercepted connections) all do the same three steps; this
is the one place they are written. Opening the upstream is the caller's (a dial, a stream
through another node, an allow-list check that raises): any `StreamFailed` it raises
refuses the incoming stream with that reason, or resets the client connection, and is
returned for the caller to count and log. Anything else propagates.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from tunnel.endpoint import IncomingStream
from tunnel.errors import StreamFailed
from tunnel.splice import SpliceResult, close_stream, splice

OpenUpstream = Callable[[], Awaitable[trio.abc.HalfCloseableStream]]


@dataclass(frozen=True)
class Relayed:
    """How a relay ended: refused before any byte moved, or spliced until both ends closed."""

    failure: StreamFailed | None = None
    spliced: SpliceResult | None = None


def _nothing() -> None:
    pass


async def relay_incoming(incoming: IncomingStream, open_upstream: OpenUpstream, *,
                         on_accepted: Callable[[], None] = _nothing) -> Relayed:
    """Open the upstream for a stream the peer opened; refuse the stream with the reason
    if that fails, else accept it (calling `on_accepted`) and splice the two."""
    try:
        upstream = await open_upstream()
    except StreamFailed as exc:
        await incoming.refuse(exc.reason, exc.message)
        return Relayed(failure=exc)
    try:
        stream = await incoming.accept()
    except BaseException:
        with trio.CancelScope(shield=True):
            await close_stream(upstream, abort=True)
        raise
    on_accepted()
    return Relayed(spliced=await splice(stream, upstream))


async def relay_connection(client: trio.abc.Stream, open_upstream: OpenUpstream, *,
                           on_accepted: Callable[[], None] = _nothing) -> Relayed:
    """Open the upstream for a client connection; reset the client if that fails, else
    (calling `on_accepted`) splice the two."""
    try:
        upstream = await open_upstream()
    except StreamFailed as exc:
        await close_stream(client, abort=True)
        return Relayed(failure=exc)
    except BaseException:
        with trio.CancelScope(shield=True):
            await close_stream(client, abort=True)
        raise
    on_accepted()
    return Relayed(spliced=await splice(client, upstream))
