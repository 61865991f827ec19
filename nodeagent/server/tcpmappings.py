"""TCP mappings: a public port on the server whose every connection is spliced into a
stream to `node` → `target`.

`TcpMappingRelay.accept_loop` accepts a mapping's connections and hands each to `take`,
with no task per connection: `take` sends the OPEN through the node's tunnel
(`DataPath.open_to_now`) and returns; the node's connection answers it from its reader,
and accepted, the socket joins that connection's splice loop (tunnel/spliceloop.py
`open_in_loop`). A failure (node not connected, refused, no answer within the dial
timeout, the tunnel lost, the client reset first) resets the client and is counted and
logged; the bytes each way are counted when both ends have closed. The loop flushes each
batch's OPENs at once and waits while the tunnel's output is above its high-water mark,
as a task waiting for its stream did.

`TcpMappingRelay.serve` is the same with a task per connection, for the connections
that must wait for something before their OPEN: a trusted balancer's (its PROXY header
is read first) and a held connection's (heldconnections.py, a sleeping Service's). A
LoadBalancer Service's port (loadbalancers.py) uses the accept loop too, its backend
picked per connection before `take`.

PROXY protocol (docs/proxy-protocol.md): a connection from a trusted load balancer starts
with its v2 header, read first (`ProxyTrust.client_of`), and its client is the one logged
and carried as the stream's origin; a mapping with `proxy_protocol` gets a header naming
that client written into the stream before any client byte. The server writes it, not
the agent: the server alone saw the client and the address it reached, the agent just
dials the target and splices, as for any stream.
"""

from __future__ import annotations

import errno
import functools
import logging
import socket
import time
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
from tunnel.errors import StreamFailed, TunnelClosedError
from tunnel.log import RateLimitedLog
from tunnel.relay import relay_connection
from tunnel.splice import SpliceResult
from tunnel.spliceloop import SpliceEnd, SpliceOwner, reset_socket
from tunnel.stream import StreamCarrier, TunnelStream

Take = Callable[[socket.socket, tuple[str, int]], "TunnelStream | None"]
"""One accepted connection and its peer's address, handed over without a task: the stream
opened for it, if any (its connection's output is flushed after the accept batch)."""

# Connections taken per wake-up of the accept loop before their OPENs go out together.
ACCEPT_BATCH = 64
# accept() failures that cost the connection being accepted, not the loop (trio's list).
_IGNORED_ACCEPT_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


class TcpMappingRelay:
    """Carries the connections of every TCP mapping into their nodes' tunnels."""

    def __init__(self, *, datapath: DataPath, notes: StreamNotes, outcomes: StreamOutcomes,
                 stream_bytes: MetricCounter, log: StructuredLogger,
                 proxy: ProxyTrust | None = None,
                 unhealthy: Callable[[Backend], bool] | None = None,
                 observe_setup: Callable[[float], None] | None = None) -> None:
        """`observe_setup`: how long each OPEN took to be accepted (the stream-setup
        histogram `tracked_opener` feeds for streams opened by a task)."""
        self._datapath = datapath
        self._observe_setup = observe_setup
        self._accept_log = RateLimitedLog(log, period=60.0)
        self._proxy = proxy
        # Active health checks: a mapping has one target, so an unhealthy one is still
        # tried (as with every backend unhealthy), and said so once a minute.
        self._unhealthy = unhealthy
        self._health_log = RateLimitedLog(log, period=60.0)
        # Refusals (node not connected, the agent refused, no answer): whoever can reach a
        # mapping's port can cause one per connection, so a few lines per mapping and
        # reason every 10 s, each with how many were left out since.
        self._refusal_log = RateLimitedLog(log, period=10.0, burst=3)
        self._notes = notes
        self._outcomes = outcomes
        # Per connection: the children looked up once, not by labels() each time.
        self._bytes_out = stream_bytes.labels("out")
        self._bytes_in = stream_bytes.labels("in")
        self.log = log

    async def accept_loop(self, name: str, listener: socket.socket, take: Take) -> None:
        """Accept connections on `listener` (non-blocking; `name` for the log) until
        cancelled, each handed to `take` (`functools.partial(relay.take, mapping, ...)`,
        or a load balancer port's choice of mapping first)."""
        while True:
            await trio.lowlevel.wait_readable(listener)
            carriers: list[StreamCarrier] = []
            for _ in range(ACCEPT_BATCH):
                try:
                    sock, address = listener.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno in _IGNORED_ACCEPT_ERRNOS:
                        continue
                    if exc.errno not in _CAPACITY_ERRNOS:
                        raise
                    self._accept_log.warning(
                        f"accept:{name}", "out of file descriptors; accept paused",
                        listener=name, error=str(exc))
                    await trio.sleep(0.1)
                    break
                try:
                    stream = take(sock, address)
                except Exception as exc:
                    # A bug here must cost one connection, never the mapping's listener.
                    self.log.error("tcp mapping connection failed", error=repr(exc),
                                   listener=name, exc_info=True)
                    reset_socket(sock)
                    continue
                if stream is not None and stream.connection not in carriers:
                    carriers.append(stream.connection)
            # The batch's OPENs in one write, and no more accepting while the node's
            # tunnel has more output queued than its high-water mark (backpressure).
            for carrier in carriers:
                try:
                    await carrier.send_queued(now=True)
                except TunnelClosedError:
                    pass  # its opens are failed by the connection's end

    def take(self, mapping: TcpMapping, sock: socket.socket, address: tuple[str, int], *,
             owner: SpliceOwner, nursery: trio.Nursery) -> TunnelStream | None:
        """One accepted connection (`address`: its peer), without a task: its OPEN queued
        (`open_to_now`), or it is reset and counted. The stream opened, if any."""
        source = (str(address[0]), int(address[1]))
        if not self._datapath.opens_now or (
                self._proxy is not None and self._proxy.trusts(source[0])):
            # A balancer's PROXY header is read before the OPEN: that waits, in a task.
            nursery.start_soon(functools.partial(
                self.serve, mapping, trio.SocketStream(trio.socket.from_stdlib_socket(sock)),
                owner=owner))
            return None
        sock.setblocking(False)  # (TCP_NODELAY comes from the listener: `detached`)
        self._check_health(mapping)
        peer = format_address(source)
        header = b""
        if mapping.proxy_protocol is not None:
            try:
                local = sock.getsockname()
                header = build_header(mapping.proxy_protocol, source,
                                      (str(local[0]), int(local[1])))
            except (OSError, ProxyHeaderError) as exc:
                reset_socket(sock)
                self._refused(mapping, peer, StreamFailed(p.StreamReason.INTERNAL,
                                                          f"no PROXY header: {exc}"))
                return None
        stream = self._datapath.open_to_now(
            mapping.node, mapping.target.host, mapping.target.port, peer, sock,
            to_tunnel=header, owner=owner,
            on_accepted=functools.partial(self._accepted, time.monotonic()),
            on_refused=functools.partial(self._refused, mapping, peer),
            on_end=functools.partial(self._ended, mapping, peer))
        if stream is not None:
            self._notes.note(stream, self._note(mapping, peer))
        return stream

    def _accepted(self, started: float) -> None:
        self._outcomes.outbound("accepted")
        if self._observe_setup is not None:
            self._observe_setup(time.monotonic() - started)

    def _refused(self, mapping: TcpMapping, peer: str, failure: StreamFailed) -> None:
        self._outcomes.outbound(failure.outcome)
        self._refusal_log.warning(
            f"{mapping.name or mapping.listen.port}:{failure.outcome}", "connection refused",
            listener=mapping.name or f":{mapping.listen.port}", node=mapping.node,
            target=str(mapping.target), client=peer, reason=failure.outcome,
            error=failure.message)

    def _ended(self, mapping: TcpMapping, peer: str, end: SpliceEnd) -> None:
        # The client is the splice's socket: what it sent went into the tunnel ("out").
        self._finished(mapping, peer, SpliceResult(end.to_tunnel, end.to_socket, end.error))

    def _check_health(self, mapping: TcpMapping) -> None:
        if self._unhealthy is not None and self._unhealthy(
                Backend(mapping.node, mapping.target.host, mapping.target.port)):
            self._health_log.warning(
                f"unhealthy:{mapping.listen}", "the mapping's backend is unhealthy; trying it "
                "anyway", listener=mapping.name or f":{mapping.listen.port}",
                node=mapping.node, target=str(mapping.target))

    @staticmethod
    def _note(mapping: TcpMapping, peer: str) -> str:
        return f"tcp mapping {mapping.name or f':{mapping.listen.port}'} client {peer}"

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
        self._check_health(mapping)
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
            self._refused(mapping, peer, relayed.failure)
        elif relayed.spliced is not None:
            self._finished(mapping, peer, relayed.spliced)

    def _finished(self, mapping: TcpMapping, peer: str, result: SpliceResult) -> None:
        self._bytes_out.inc(result.a_to_b)
        self._bytes_in.inc(result.b_to_a)
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
        self._notes.note(stream, self._note(mapping, peer))
        return stream

    def _mapping_log(self, mapping: TcpMapping, peer: str) -> StructuredLogger:
        return self.log.bind(listener=mapping.name or f":{mapping.listen.port}",
                             node=mapping.node, target=str(mapping.target), client=peer)


def detached(listener: trio.SocketListener) -> socket.socket:
    """A listening socket out of trio's wrappers, non-blocking: `accept_loop` takes
    connections itself, as plain sockets. TCP_NODELAY is set here: Linux gives every
    accepted connection the listener's (a setsockopt per connection saved)."""
    tsock = listener.socket
    sock = socket.socket(tsock.family, tsock.type, tsock.proto, tsock.detach())
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


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
