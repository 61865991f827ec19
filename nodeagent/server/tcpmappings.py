"""TCP mappings: a public port on the server whose every connection is spliced into a
stream to `node` → `target`.

`TcpMappingRelay.serve` carries one accepted connection: `open_mapping_target` opens the
stream through the node's tunnel (within the dial timeout), a failure resets the client and
is counted and logged, and the bytes each way are counted when both ends have closed.

PROXY protocol (docs/proxy-protocol.md): a connection from a trusted load balancer starts
with its v2 header, read first (`ProxyTrust.client_of`), and its client is the one logged
and carried as the stream's origin; a mapping with `proxy_protocol` gets a header naming
that client written into the stream before any client byte. The server writes it, not
the agent: the server alone saw the client and the address it reached, the agent just
dials the target and splices, as for any stream.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import trio
from prometheus_client import Counter as MetricCounter

from nodeagent.config import TcpMapping
from nodeagent.http.routetable import Backend
from nodeagent.ops.logs import StructuredLogger
from nodeagent.ops.streamviews import StreamNotes
from nodeagent.proxyprotocol import ProxyHeaderError, build_header
from nodeagent.proxyprotocol.receive import ProxyTrust
from nodeagent.server.datapath import DataPath
from nodeagent.server.openers import StreamOutcomes
from tunnel import protocol as p
from tunnel.errors import StreamFailed
from tunnel.log import RateLimitedLog
from tunnel.relay import relay_connection
from tunnel.splice import SpliceResult
from tunnel.spliceloop import SpliceOwner


class TcpMappingRelay:
    """Carries the connections of every TCP mapping into their nodes' tunnels."""

    def __init__(self, *, datapath: DataPath, notes: StreamNotes, outcomes: StreamOutcomes,
                 stream_bytes: MetricCounter, log: StructuredLogger,
                 proxy: ProxyTrust | None = None,
                 unhealthy: Callable[[Backend], bool] | None = None) -> None:
        self._datapath = datapath
        self._proxy = proxy
        # Active health checks: a mapping has one target, so an unhealthy one is still
        # tried (as with every backend unhealthy), and said so once a minute.
        self._unhealthy = unhealthy
        self._health_log = RateLimitedLog(log, period=60.0)
        self._notes = notes
        self._outcomes = outcomes
        self._stream_bytes = stream_bytes
        self.log = log

    async def serve(self, mapping: TcpMapping, client: trio.SocketStream, *,
                    opened: trio.abc.HalfCloseableStream | None = None,
                    owner: SpliceOwner | None = None) -> None:
        """Carry one connection. `opened`: the stream to the target, already open
        (`open_target`: a held connection's, server/heldconnections.py). With `owner`
        (the mapping's listener) the splice is handed to the tunnel connection's loop
        once the stream is open, and this task ends: an idle connection keeps no task;
        the owner aborts it if it stops first. Without one (a held connection, whose
        caller counts activity while it lasts; a load balancer port) this returns when
        the connection ends."""
        source, destination = socket_addresses(client)
        if self._proxy is not None and source is not None:
            listener = mapping.name or f":{mapping.listen.port}"
            header = await self._proxy.client_of(client, source, f"tcp:{listener}")
            source, destination = ((header.source, header.destination or destination)
                                   if header is not None else (None, None))
        if source is None:  # reset before we got to it, or a balancer's header refused
            await trio.aclose_forcefully(client)
            if opened is not None:
                await trio.aclose_forcefully(opened)
            return
        if self._unhealthy is not None and self._unhealthy(
                Backend(mapping.node, mapping.target.host, mapping.target.port)):
            self._health_log.warning(
                f"unhealthy:{mapping.listen}", "the mapping's backend is unhealthy; trying it "
                "anyway", listener=mapping.name or f":{mapping.listen.port}",
                node=mapping.node, target=str(mapping.target))
        peer = format_address(source)  # the stream's origin, which the agent logs

        async def open_mapping_target() -> trio.abc.HalfCloseableStream:
            header = b""
            if mapping.proxy_protocol is not None:
                if destination is None:
                    raise StreamFailed(p.StreamReason.INTERNAL,
                                       "no local address for the PROXY header")
                try:
                    header = build_header(mapping.proxy_protocol, source, destination)
                except ProxyHeaderError as exc:
                    raise StreamFailed(p.StreamReason.INTERNAL, str(exc)) from None
            stream = opened if opened is not None else await self.open_target(mapping, peer)
            if header:
                try:
                    await stream.send_all(header)  # before the splice moves a client byte
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    await trio.aclose_forcefully(stream)
                    raise StreamFailed(p.StreamReason.CANCELLED, f"stream broke: {exc}") from None
            return stream

        relayed = await relay_connection(
            client, open_mapping_target,
            on_accepted=lambda: self._outcomes.outbound("accepted"),
            on_finished=(functools.partial(self._finished, mapping, peer)
                         if owner is not None else None), owner=owner)
        if relayed.failure is not None:
            self._outcomes.outbound(relayed.failure.outcome)
            self._mapping_log(mapping, peer).info(
                "connection refused", reason=relayed.failure.outcome,
                error=relayed.failure.message)
        elif relayed.spliced is not None:
            self._finished(mapping, peer, relayed.spliced)

    def _finished(self, mapping: TcpMapping, peer: str, result: SpliceResult) -> None:
        self._stream_bytes.labels("out").inc(result.a_to_b)
        self._stream_bytes.labels("in").inc(result.b_to_a)
        if self.log.isEnabledFor(logging.DEBUG):  # no logger bound per connection otherwise
            self._mapping_log(mapping, peer).debug(
                "connection finished", sent=result.a_to_b, received=result.b_to_a,
                error=result.error or "")

    async def open_target(self, mapping: TcpMapping, peer: str, *, wakes: bool = False
                          ) -> trio.abc.HalfCloseableStream:
        """The stream to the mapping's target for client `peer` (`wakes`: of a Service
        that scales to zero, `DataPath.open_to`); raises StreamFailed."""
        stream = await self._datapath.open_to(mapping.node, mapping.target.host,
                                              mapping.target.port, peer, wakes=wakes)
        name = f"tcp mapping {mapping.name or f':{mapping.listen.port}'} client {peer}"
        self._notes.note(stream, name)
        return stream

    def _mapping_log(self, mapping: TcpMapping, peer: str) -> StructuredLogger:
        return self.log.bind(listener=mapping.name or f":{mapping.listen.port}",
                             node=mapping.node, target=str(mapping.target), client=peer)


def socket_addresses(stream: trio.SocketStream) -> tuple[tuple[str, int] | None,
                                                         tuple[str, int] | None]:
    """(peer, local) (host, port) of a connection; None for one the OS no longer knows."""
    try:
        peer = stream.socket.getpeername()
        local = stream.socket.getsockname()
    except OSError:
        return None, None
    return (str(peer[0]), int(peer[1])), (str(local[0]), int(local[1]))


def format_address(address: tuple[str, int] | None) -> str:
    """host:port ([host]:port for IPv6), or "?"."""
    if address is None:
        return "?"
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def peer_address(stream: trio.SocketStream) -> str:
    """host:port of the connection's peer ([host]:port for IPv6), or "?"."""
    return format_address(socket_addresses(stream)[0])
