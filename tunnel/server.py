"""The accepting endpoint (server side): many agents, one registry keyed by node name.

Each accepted transport is handshaken (the caller's `authenticate` decides who the dialer
is), registered under its node name, and served until it ends. A second connection for a
node that is already registered replaces the first cleanly: the old one is closed with
REPLACED (its streams are reset), because an agent that reconnects after a network blip
must win over its own half-dead previous connection.

Admission: handshakes are admitted at a rate the server sustains (`HandshakeAdmission`, a
token bucket with a burst); beyond it a dialer is refused before it is authenticated
(OVERLOADED) and told when to come back. Those times are handed out one slot per 1/rate
seconds, so 5,000 agents cut off together return spread over 5,000/rate seconds instead
of all at once, every few seconds, until the server falls over. Draining (a SIGTERM), the
server refuses new handshakes as SHUTTING_DOWN: agents retry at once, elsewhere.

Bootstrap (an agent without credentials fetching its certificate, `Bootstrap`): anyone
who can reach the server can open such a connection, so they are capped in all
(`max_bootstrap_sessions`) and per source address (`max_bootstrap_per_address`, see
tunnel.bootstrap); each connection lives at most `bootstrap_seconds`, about what one
certificate request needs, and its streams end with it; and a connection opens at
most `max_bootstrap_streams` streams (our HELLO announces it as its concurrent cap; it is
also counted over the connection's life), since each becomes a connection to the
controller. Beyond a cap the dialer is refused as OVERLOADED, counted by reason
(`refusals`, `on_refusal`) and logged at most once per reason per 10 s.

Replicas: the server's HELLO names it (server id) and says how many replicas serve the
public address; an agent names the servers it already holds, and one named there refuses
as ALREADY_CONNECTED (politely, before authenticating) instead of replacing that tunnel.
"""

from __future__ import annotations

import collections
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from tunnel import protocol as p
from tunnel.bootstrap import BootstrapRefusal, BootstrapSlots, source_of
from tunnel.endpoint import (
    AuthenticationFailed,
    EndpointSettings,
    HandshakeError,
    HandshakeRefused,
    IncomingStream,
    StreamRefusedError,
    TunnelClosedError,
    TunnelConnection,
    TunnelStream,
)
from tunnel.errors import end_label
from tunnel.limits import HandshakeAdmission as HandshakeAdmission  # re-exported
from tunnel.log import RateLimitedLog, StructuredLogger, get_logger
from tunnel.shaping import ShapedTransport, Shaper
from tunnel.transports import PeerInfo, Transport


@dataclass(frozen=True)
class Bootstrap:
    """An authenticator's answer for a dialer that has no credentials yet and may only
    fetch them: its connection is never registered as a node, lives at most
    `bootstrap_seconds` (its streams end with it), opens at most
    `max_bootstrap_streams`, and its streams go to the server's `bootstrap_handler`
    (which lets them reach the certificate signer, nothing else)."""

    claimed_node: str


# Decides who a dialer is: returns the node name (or Bootstrap), or raises
# AuthenticationFailed.
Authenticator = Callable[[p.Hello, PeerInfo], Awaitable["str | Bootstrap"]]
# Serves a stream an agent opened: (node, stream) -> None.
NodeStreamHandler = Callable[[str, IncomingStream], Awaitable[None]]
# Looks at a stream an agent opened before a handler task is made for it, from the
# connection's reader (tunnel.stream.StreamTaker, with the node): True if it answered or
# took the stream without a task, False to leave it to the NodeStreamHandler's task.
NodeStreamTaker = Callable[[str, IncomingStream], bool]


class NodeNotConnected(StreamRefusedError):
    """No live tunnel from `node` to this server. With several replicas that is
    short-lived (the agent dials every replica): callers answer at once (502) rather
    than forward to another replica, which would need replica-to-replica trust."""

    def __init__(self, node: str, server_id: str = "") -> None:
        where = f" to server {server_id}" if server_id else ""
        super().__init__(p.StreamReason.UNREACHABLE, f"node {node} is not connected{where}")
        self.node = node


RECENT_ENDS = 1024
# What a refused bootstrap dialer is told: a slot frees as soon as another agent has its
# certificate, well within a second.
BOOTSTRAP_RETRY_AFTER = 1.0
_BOOTSTRAP_FULL = {
    BootstrapRefusal.FULL: "too many agents are fetching credentials; retry later",
    BootstrapRefusal.PER_SOURCE: "too many agents at this address are fetching credentials; "
                                 "retry later",
}


@dataclass
class EndedSession:
    node: str
    peer: str
    label: str  # errors.END_LABELS
    reason: str
    since: float  # wall clock, when it ended


@dataclass
class AgentSession:
    node: str
    connection: TunnelConnection
    since: float  # wall clock
    shaper: Shaper | None = None  # its bandwidth (shaping.py), if the server shapes


Bandwidth = Callable[[str], tuple[float | None, float | None]]
"""node → (bytes/s toward it, bytes/s from it), None for unlimited."""


class TunnelServer:
    def __init__(
        self,
        *,
        authenticate: Authenticator,
        server_id: str = "nodeagent-server",
        settings: EndpointSettings | None = None,
        stream_handler: NodeStreamHandler | None = None,
        bootstrap_handler: NodeStreamHandler | None = None,
        stream_taker: NodeStreamTaker | None = None,
        max_sessions: int = 10_000,
        max_bootstrap_sessions: int = 64,
        max_bootstrap_per_address: int | None = 4,
        bootstrap_seconds: float = 10.0,
        max_bootstrap_streams: int = 2,
        admission: HandshakeAdmission | None = None,
        replicas: int | None = None,
        on_refusal: Callable[[str], None] | None = None,
        bandwidth: Bandwidth | None = None,
        log: StructuredLogger | None = None,
    ) -> None:
        self._authenticate = authenticate
        # Per-node bandwidth shaping of the tunnels (shaping.py); None: none at all.
        self.bandwidth = bandwidth
        self.server_id = server_id
        # How many replicas serve the public address, announced in the HELLO so agents
        # hold a tunnel to each (None: not announced, agents hold one). Set it when the
        # count changes; agents learn it at their next handshake.
        self.replicas = replicas
        self.settings = settings or EndpointSettings()
        self._stream_handler = stream_handler
        self._bootstrap_handler = bootstrap_handler
        # Registered nodes' streams only (never a bootstrap connection's): see
        # NodeStreamTaker.
        self._stream_taker = stream_taker if stream_handler is not None else None
        # Registered agents at most: beyond it a new node is refused (one already
        # registered may still reconnect), so no stream of names can grow the registry.
        self.max_sessions = max_sessions
        # Bootstrap connections open now, in all and per source address (None: no cap per
        # address, for a server behind a proxy that hides them), how long each (and so each
        # of its streams) may last, and how many streams each may open: one certificate
        # request takes one stream and well under a second.
        self.bootstrap_slots = BootstrapSlots(max_bootstrap_sessions, max_bootstrap_per_address)
        self.bootstrap_seconds = bootstrap_seconds
        if not 1 <= max_bootstrap_streams <= self.settings.protocol.max_streams:
            raise ValueError(f"max_bootstrap_streams {max_bootstrap_streams} not in "
                             f"[1, {self.settings.protocol.max_streams}]")
        self.max_bootstrap_streams = max_bootstrap_streams
        self.bootstrap_served = 0  # ever
        self.log = log or get_logger("tunnel.server")
        self.sessions: dict[str, AgentSession] = {}
        # Agent tunnels that ended, by why (errors.END_LABELS, a closed set), and the
        # latest ends per node for debug views ("node X: gone since ..., keepalive
        # timeout"), the oldest forgotten beyond RECENT_ENDS.
        self.disconnects: Counter[str] = Counter()
        self.recent_ends: collections.OrderedDict[str, EndedSession] = \
            collections.OrderedDict()
        self.handshake_failures = 0
        self.handshake_failures_by_code: Counter[str] = Counter()
        self._handshake_log = RateLimitedLog(self.log, period=60.0)
        self.replaced = 0
        self._changed = trio.Event()
        self._draining = False
        self.admission = admission or HandshakeAdmission()
        # Handshakes refused before authentication, by reason (overloaded, shutting_down).
        self.refusals: Counter[str] = Counter()
        self._on_refusal = on_refusal
        self._refusal_log = RateLimitedLog(self.log, period=10.0)

    @property
    def bootstrap_sessions(self) -> int:
        """Bootstrap connections open now."""
        return self.bootstrap_slots.total

    @property
    def draining(self) -> bool:
        """True from drain() on: the server is going away (readiness fails)."""
        return self._draining

    def _refuse(self, reason: str, message: str, code: p.ErrorCode,
                retry_after: float | None = None, **fields: object) -> HandshakeRefused:
        self.refusals[reason] += 1
        if self._on_refusal is not None:
            self._on_refusal(reason)
        fields.update(reason=reason, refused_total=self.refusals[reason])
        if reason == "overloaded":
            fields["rate"] = f"{self.admission.rate:g}/s"
        self._refusal_log.warning(reason, "agent handshake refused", **fields)
        return HandshakeRefused(message, code, retry_after)

    # ---------------------------------------------------------------- queries

    def connection_for(self, node: str) -> TunnelConnection | None:
        session = self.sessions.get(node)
        if session is None or not session.connection.is_open:
            return None
        return session.connection

    def live_connection(self, node: str) -> TunnelConnection:
        """`node`'s live connection, for an opener that does not wait (`open_stream_nowait`);
        raises NodeNotConnected if there is none."""
        conn = self.connection_for(node)
        if conn is None:
            raise NodeNotConnected(node, self.server_id)
        return conn

    async def open_stream(self, node: str, target: p.Target,
                          metadata: dict[str, str] | None = None) -> TunnelStream:
        """Open a stream to `target` through `node`'s agent. Raises StreamRefusedError
        (NodeNotConnected when there is no live connection to that node)."""
        conn = self.connection_for(node)
        if conn is None:
            raise NodeNotConnected(node, self.server_id)
        try:
            return await conn.open_stream(target, metadata)
        except TunnelClosedError:
            # The connection ended while we waited for the answer: the agent reconnected
            # (a new connection replaced this one: try that one, once) or went away.
            newer = self.connection_for(node)
            if newer is None or newer is conn:
                raise NodeNotConnected(node, self.server_id) from None
            try:
                return await newer.open_stream(target, metadata)
            except TunnelClosedError:
                raise NodeNotConnected(node, self.server_id) from None

    async def wait_for_node(self, node: str) -> TunnelConnection:
        while (conn := self.connection_for(node)) is None:
            self._changed = trio.Event() if self._changed.is_set() else self._changed
            await self._changed.wait()
        return conn

    # ---------------------------------------------------------------- serving

    async def handle_transport(self, transport: Transport) -> None:
        """Serve one accepted transport until it ends (give this to tunnel.accept.serve)."""
        log = self.log.bind(peer=transport.peer.address)
        identity: str | Bootstrap | None = None
        reserved: str | None = None  # the source holding a bootstrap slot taken by vet()

        async def vet(hello: p.Hello, peer: PeerInfo) -> p.Hello:
            nonlocal identity, reserved
            # Before authentication, which is the costly part: a refusal costs the HELLO.
            if self._draining:
                raise self._refuse("shutting_down", "server is shutting down; connect again",
                                   p.ErrorCode.SHUTTING_DOWN)
            wait = self.admission.admit(trio.current_time())
            if wait is not None:
                raise self._refuse(
                    "overloaded", f"server admits {self.admission.rate:g} handshakes/s; "
                    f"come back in {wait:.1f}s", p.ErrorCode.OVERLOADED, retry_after=wait)
            if self.server_id in p.held_servers(hello.identity):
                # The agent reached us again through the load balancer: refuse before
                # registering, which would replace (reset) the tunnel it holds to us.
                raise self._refuse("already_connected",
                                   "this agent already holds a tunnel to this server",
                                   p.ErrorCode.ALREADY_CONNECTED)
            identity = await self._authenticate(hello, peer)
            if (isinstance(identity, str) and identity not in self.sessions
                    and len(self.sessions) >= self.max_sessions):
                raise AuthenticationFailed(f"this server holds its maximum of "
                                           f"{self.max_sessions} agents; try another replica")
            if isinstance(identity, Bootstrap):
                if self._bootstrap_handler is None:
                    raise AuthenticationFailed("this server issues no credentials: present a "
                                               "node certificate or token")
                source = source_of(peer.address)
                refused = self.bootstrap_slots.take(source)
                if refused is not None:
                    raise self._refuse(refused.value, _BOOTSTRAP_FULL[refused],
                                       p.ErrorCode.OVERLOADED,
                                       retry_after=BOOTSTRAP_RETRY_AFTER, source=source)
                reserved = source
                # Every bootstrap stream becomes a connection to the controller.
                conn.limit_peer_streams(self.max_bootstrap_streams)
            answer = {p.IDENTITY_SERVER: self.server_id}
            if self.replicas is not None:
                answer[p.IDENTITY_REPLICAS] = str(self.replicas)
            return p.Hello(identity=answer)

        handler = None
        bootstrap_streams = 0  # opened on this connection, if it is a bootstrap
        if self._stream_handler is not None or self._bootstrap_handler is not None:
            stream_handler, bootstrap_handler = self._stream_handler, self._bootstrap_handler

            async def handler(incoming: IncomingStream) -> None:
                nonlocal bootstrap_streams
                if isinstance(identity, Bootstrap):
                    if bootstrap_handler is not None:
                        bootstrap_streams += 1
                        await self._serve_bootstrap_stream(
                            bootstrap_handler, identity, incoming, bootstrap_streams,
                            reserved or "")
                        return
                elif identity is not None and stream_handler is not None:
                    await stream_handler(identity, incoming)
                    return
                await incoming.refuse(p.StreamReason.FORBIDDEN, "no streams on this connection")

        take = None
        if self._stream_taker is not None:
            node_taker = self._stream_taker

            def take(incoming: IncomingStream) -> bool:
                # A node's connection only: a bootstrap one's streams reach the signer
                # through their handler, and nothing is taken before the handshake.
                return isinstance(identity, str) and node_taker(identity, incoming)

        shaped = None
        if self.bandwidth is not None:  # paced once the node is known (below)
            transport = shaped = ShapedTransport(transport)
        conn = TunnelConnection(transport, p.Role.ACCEPTOR, self.settings, handler, log=log,
                                take_stream=take)
        try:
            await conn.accept_handshake(vet)
        except BaseException as exc:
            if reserved is not None:
                self.bootstrap_slots.give_back(reserved)
            if not isinstance(exc, HandshakeError):
                raise
            if exc.code not in (p.ErrorCode.OVERLOADED, p.ErrorCode.SHUTTING_DOWN,
                                p.ErrorCode.ALREADY_CONNECTED):
                # (Those two are counted and logged by _refuse().)
                self.handshake_failures += 1
                code = exc.code.name.lower()
                self.handshake_failures_by_code[code] += 1
                # One line per failure code a minute: a scanner or a misconfigured fleet
                # must not flood the log. What the peer claimed is not echoed: it is
                # whatever it sent.
                self._handshake_log.warning(code, "agent handshake failed", code=code,
                                            reason=str(exc)[:200])
            await transport.aclose()
            return
        if isinstance(identity, Bootstrap):
            assert reserved is not None
            await self._serve_bootstrap(conn, identity, reserved, log)
            return
        node = identity
        assert node is not None
        if self._draining:
            await conn.aclose(p.ErrorCode.SHUTTING_DOWN, "server is shutting down")
            return
        conn.log = log = log.bind(node=node)
        previous = self.sessions.get(node)
        self.sessions[node] = AgentSession(node, conn, time.time(),
                                           shaped.shaper if shaped is not None else None)
        if shaped is not None and self.bandwidth is not None:
            shaped.shaper.set(*self.bandwidth(node))
        self._notify()
        if previous is not None:
            self.replaced += 1
            log.info("agent connected again; closing its previous connection",
                     previous_peer=previous.connection.peer.address)
            await previous.connection.aclose(
                p.ErrorCode.REPLACED,
                f"node {node} connected again from {transport.peer.address}")
        log.info("agent connected", agent_version=conn.identity.get("agent_version", ""))
        try:
            await conn.run()
        finally:
            if (current := self.sessions.get(node)) is not None and current.connection is conn:
                del self.sessions[node]
                self._notify()
            reason = conn.end_reason
            # (conn.is_draining is no test: closing sends a GOAWAY too)
            label = end_label(reason, drained=self._draining)
            self.disconnects[label] += 1
            self.recent_ends.pop(node, None)
            self.recent_ends[node] = EndedSession(node, transport.peer.address, label,
                                                  str(reason) if reason else "cancelled",
                                                  time.time())
            while len(self.recent_ends) > RECENT_ENDS:
                self.recent_ends.popitem(last=False)
            log.info("agent disconnected", reason=str(reason) if reason else "cancelled")

    def reshape(self) -> None:
        """Apply `bandwidth` again to every node's tunnel (after a config change)."""
        if self.bandwidth is None:
            return
        for node, session in self.sessions.items():
            if session.shaper is not None:
                rates = self.bandwidth(node)
                if rates != (session.shaper.rate_out, session.shaper.rate_in):
                    session.shaper.set(*rates)

    async def _serve_bootstrap(self, conn: TunnelConnection, bootstrap: Bootstrap,
                               source: str, log: StructuredLogger) -> None:
        """A connection that may only fetch credentials: never a node, time-boxed."""
        self.bootstrap_served += 1
        log.info("agent fetching credentials", claimed_node=bootstrap.claimed_node)
        try:
            with trio.move_on_after(self.bootstrap_seconds) as scope:
                await conn.run()
            if scope.cancelled_caught:
                log.info("credential fetch took too long; closing",
                         claimed_node=bootstrap.claimed_node)
        finally:
            self.bootstrap_slots.give_back(source)
            with trio.CancelScope(shield=True):
                await conn.aclose(p.ErrorCode.NO_ERROR, "credentials fetched")
            # OPENs beyond the concurrent cap, which the protocol core refused itself.
            if over := conn.stats.streams_refused_over_limit:
                self._bootstrap_streams_refused(over, source)

    async def _serve_bootstrap_stream(self, handler: NodeStreamHandler, bootstrap: Bootstrap,
                                      incoming: IncomingStream, nth: int,
                                      source: str) -> None:
        """The `nth` stream of a bootstrap connection: refused (OVERLOADED) beyond
        `max_bootstrap_streams`. (Its deadline is its connection's: the handler runs in
        the connection's nursery, which _serve_bootstrap ends after `bootstrap_seconds`,
        resetting every stream.)"""
        if nth > self.max_bootstrap_streams:
            self._bootstrap_streams_refused(1, source)
            await incoming.refuse(p.StreamReason.OVERLOADED, "a bootstrap connection opens at "
                                  f"most {self.max_bootstrap_streams} streams")
            return
        await handler(bootstrap.claimed_node, incoming)

    def _bootstrap_streams_refused(self, count: int, source: str) -> None:
        reason = "bootstrap_streams"
        self.refusals[reason] += count
        if self._on_refusal is not None:
            for _ in range(count):
                self._on_refusal(reason)
        self._refusal_log.warning(reason, "bootstrap streams refused", reason=reason,
                                  refused=count, source=source,
                                  refused_total=self.refusals[reason])

    def _notify(self) -> None:
        self._changed.set()

    def start_draining(self) -> None:
        """From now on readiness fails (`draining`) and new handshakes are refused."""
        self._draining = True

    async def drain(self, message: str = "server shutting down", grace: float = 30.0) -> None:
        """Zero-downtime shutdown: GOAWAY to every agent (they dial a replacement at once),
        wait up to `grace` for running streams, then close what is left."""
        self.start_draining()
        sessions = list(self.sessions.values())
        for session in sessions:
            session.connection.goaway(message)
        busy = sum(1 for s in sessions if s.connection.info().streams_open)
        self.log.info("draining agents", agents=len(sessions), with_streams=busy,
                      grace_seconds=grace)
        with trio.move_on_after(grace) as scope:
            for session in sessions:
                await session.connection.wait_idle()
        left = sum(s.connection.info().streams_open for s in sessions)
        if scope.cancelled_caught and left:
            self.log.warning("drain grace period over; resetting streams left",
                             streams=left, grace_seconds=grace)
        for session in sessions:
            await session.connection.aclose(p.ErrorCode.SHUTTING_DOWN, message)
