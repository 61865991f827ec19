"""TCP mappings: a public port on the server whose every connection is spliced into a
stream to `node` → `target`.

`TcpMappingRelay.serve` carries one accepted connection: `open_mapping_target` opens the
stream through the node's tunnel (within the dial timeout), a failure resets the client and
is counted and logged, and the bytes each way are counted when both ends have closed.
"""

from __future__ import annotations

import functools
import logging

import trio
from prometheus_client import Counter as MetricCounter

from nodeagent.config import TcpMapping
from nodeagent.ops.logs import StructuredLogger
from nodeagent.ops.streamviews import StreamNotes
from nodeagent.server.datapath import DataPath
from nodeagent.server.openers import StreamOutcomes
from tunnel.relay import relay_connection
from tunnel.splice import SpliceResult
from tunnel.spliceloop import SpliceOwner


class TcpMappingRelay:
    """Carries the connections of every TCP mapping into their nodes' tunnels."""

    def __init__(self, *, datapath: DataPath, notes: StreamNotes, outcomes: StreamOutcomes,
                 stream_bytes: MetricCounter, log: StructuredLogger) -> None:
        self._datapath = datapath
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
        peer = peer_address(client)  # the stream's origin, which the agent logs

        async def open_mapping_target() -> trio.abc.HalfCloseableStream:
            return opened if opened is not None else await self.open_target(mapping, peer)

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

    async def open_target(self, mapping: TcpMapping, peer: str
                          ) -> trio.abc.HalfCloseableStream:
        """The stream to the mapping's target for client `peer`; raises StreamFailed."""
        stream = await self._datapath.open_to(mapping.node, mapping.target.host,
                                              mapping.target.port, peer)
        name = f"tcp mapping {mapping.name or f':{mapping.listen.port}'} client {peer}"
        self._notes.note(stream, name)
        return stream

    def _mapping_log(self, mapping: TcpMapping, peer: str) -> StructuredLogger:
        return self.log.bind(listener=mapping.name or f":{mapping.listen.port}",
                             node=mapping.node, target=str(mapping.target), client=peer)


def peer_address(stream: trio.SocketStream) -> str:
    """host:port of the connection's peer ([host]:port for IPv6), or "?"."""
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
