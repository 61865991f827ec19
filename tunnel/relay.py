"""Joining a stream or a connection to its upstream: open → refuse or accept → splice.

The agent (streams the server opens), the server (streams agents open, TCP mappings) and
the agent's transparent proxy (intercepted connections) all do the same three steps; this
is the one place they are written. Opening the upstream is the caller's (a dial, a stream
through another node, an allow-list check that raises): any `StreamFailed` it raises
refuses the incoming stream with that reason, or resets the client connection, and is
returned for the caller to count and log. Anything else propagates.

A caller that passes `on_finished` need not wait for the end: a stream joined to a TCP
socket is handed to its connection's splice loop (tunnel/spliceloop.py), the call returns
at once and the handler's task ends; `on_finished` gets the result when both directions
are done. That is what makes an idle relayed stream cost no task.

`relay_incoming_now` goes further for a stream whose upstream is a TCP address needing
no wait before the connect (an IP literal the caller has already allowed): called by the
connection's reader itself (a `tunnel.stream.StreamTaker`), it makes no task at all; the
splice loop connects, answers and splices. Per new connection that saves the handler's
task and the wake-ups around its dial and answer (docs/performance.md, "Per connection").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from tunnel.endpoint import IncomingStream
from tunnel.errors import StreamFailed
from tunnel.splice import SpliceResult, close_stream, result_of, splice
from tunnel.spliceloop import SpliceEnd, SpliceHandle, SpliceOwner, dial_in_loop, splice_in_loop
from tunnel.stream import TunnelStream
from tunnel.tcp import literal_family

OpenUpstream = Callable[[], Awaitable[trio.abc.HalfCloseableStream]]
OnFinished = Callable[[SpliceResult], None]


@dataclass(frozen=True)
class Relayed:
    """How a relay ended: refused before any byte moved, or spliced until both ends closed."""

    failure: StreamFailed | None = None
    spliced: SpliceResult | None = None  # None, with no failure: handed over (on_finished)
    handle: SpliceHandle | None = None  # a handed-over splice, for an owner to abort


def _nothing() -> None:
    pass


async def relay_incoming(incoming: IncomingStream, open_upstream: OpenUpstream, *,
                         on_accepted: Callable[[], None] = _nothing,
                         on_finished: OnFinished | None = None) -> Relayed:
    """Open the upstream for a stream the peer opened; refuse the stream with the reason
    if that fails, else accept it (calling `on_accepted`) and splice the two; with
    `on_finished`, hand them over where it can (see the module docstring)."""
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
    if on_finished is not None and isinstance(upstream, trio.SocketStream):
        incoming.hand_over()
        return Relayed(handle=_hand_over(stream, upstream, True, on_finished, None))
    result = await splice(stream, upstream)
    if on_finished is None:
        return Relayed(spliced=result)
    on_finished(result)
    return Relayed()


def relay_incoming_now(incoming: IncomingStream, host: str, port: int, *, timeout: float,
                       mark: int | None, on_accepted: Callable[[], None],
                       on_refused: Callable[[StreamFailed], None],
                       on_finished: OnFinished) -> bool:
    """`relay_incoming` to a TCP target, with `connect_tcp`'s dial, for a caller that
    cannot wait (the connection's reader): False, with nothing done, unless `host` is
    an IP literal (a name needs the resolver: the caller's task path). Else the stream
    is refused (`on_refused`, with the failure `connect_tcp` would raise) or accepted
    (`on_accepted`) and spliced (`on_finished` at the end) later, from the splice loop."""
    family = literal_family(host)
    if family is None:
        return False

    def on_end(end: SpliceEnd) -> None:
        on_finished(result_of(end, True))

    dial_in_loop(incoming, family, (host, port), timeout=timeout, mark=mark,
                 on_accepted=on_accepted, on_refused=on_refused, on_end=on_end)
    return True


async def relay_connection(client: trio.abc.Stream, open_upstream: OpenUpstream, *,
                           on_accepted: Callable[[], None] = _nothing,
                           on_finished: OnFinished | None = None,
                           owner: SpliceOwner | None = None) -> Relayed:
    """Open the upstream for a client connection; reset the client if that fails, else
    (calling `on_accepted`) splice the two; with `on_finished`, hand them over where it
    can, on behalf of `owner` (which aborts them if it ends first)."""
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
    if (on_finished is not None and isinstance(upstream, TunnelStream)
            and isinstance(client, trio.SocketStream)):
        return Relayed(handle=_hand_over(upstream, client, False, on_finished, owner))
    result = await splice(client, upstream)
    if on_finished is None:
        return Relayed(spliced=result)
    on_finished(result)
    return Relayed()


def _hand_over(stream: TunnelStream, sock: trio.SocketStream, stream_first: bool,
               on_finished: OnFinished, owner: SpliceOwner | None) -> SpliceHandle:
    def on_end(end: SpliceEnd) -> None:
        on_finished(result_of(end, stream_first))

    return splice_in_loop(stream, sock, on_end=on_end, owner=owner)
