"""The dialing endpoint (agent side): dial, handshake, serve, and reconnect for ever.

The delay before each reconnect depends on what the last attempt ran into
(tunnel/backoff.py says why): an unreachable server is retried about every second, so a
node is back within ~1 s of its server returning; a server that refused the handshake as
overloaded is retried when it said, with jitter; one that refused our credentials, or
whose TLS failed, at a slowing pace up to 15 s (never a retry storm). When the server
drains a connection (GOAWAY) the client dials a fresh one at once and lets the old one
finish its streams: make-before-break, for zero-downtime server rollouts.

A server that stays down is one warning line, then one every 30 s per kind of failure
with the count, never a line per attempt.

Several server replicas: each server's HELLO names it and says how many replicas serve
the public address. The client keeps dialing that address (one dial at a time, naming
the servers it already holds, so one it reaches again refuses politely with
ALREADY_CONNECTED instead of replacing that tunnel) until it holds a tunnel to as many
distinct servers as announced, then keeps them all. Those extra dials are paced on their
own jittered backoff (1 s growing to 30 s), so a fleet missing a dead replica costs the
survivors a bounded rate of handshakes. Servers listed as `direct` are dialed at their own
addresses, one tunnel each. Streams open on any live tunnel that is not draining (the one
with fewest streams); a tunnel that ends or drains is skipped at once, no backoff.
"""

from __future__ import annotations

import collections
import copy
import random
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from tunnel import protocol as p
from tunnel.backoff import Backoff as Backoff  # re-exported: callers pass one in
from tunnel.backoff import Failure, ReconnectPolicy
from tunnel.dial import dial
from tunnel.endpoint import (
    EndpointSettings,
    HandshakeError,
    StreamHandler,
    StreamRefusedError,
    TunnelClosedError,
    TunnelConnection,
    TunnelStream,
)
from tunnel.errors import end_label
from tunnel.log import RateLimitedLog, StructuredLogger, get_logger
from tunnel.proxy import DIRECT, ProxyRules
from tunnel.stream import StreamTaker
from tunnel.transports import DialError, Endpoint, TransportError

# Dial failures that cost the server nothing (the kernel or a proxy answered for it).
_UNREACHABLE_DIAL = frozenset({"refused", "unreachable", "timeout", "dns", "reset",
                               "unavailable"})
# Handshake refusals that mean "come back soon": the server is going away, or the
# connection was cut before it answered.
_UNREACHABLE_HANDSHAKE = frozenset({p.ErrorCode.SHUTTING_DOWN, p.ErrorCode.NO_ERROR})
FAILURE_LOG_PERIOD = 30.0
# The TCP connect alone gives up after this: a server whose host drops our SYNs (a link
# down, a firewall) is then retried on the unreachable schedule, about every second; the
# kernel alone would resend a SYN only at 1, 3, 7 s, so a node could wait seconds after
# the path is back. Two SYNs fit (0 and 1 s); TLS and the upgrade keep connect_timeout.
TCP_CONNECT_TIMEOUT = 2.0
# Dials for replicas not held yet while at least one tunnel is up: paced on this backoff
# (jittered), reset when a new server is reached.
EXTRA_DIAL_INITIAL = 1.0
EXTRA_DIAL_MAXIMUM = 30.0


def classify_dial_error(exc: TransportError) -> Failure:
    reason = exc.reason if isinstance(exc, DialError) else ""
    return Failure.UNREACHABLE if reason in _UNREACHABLE_DIAL else Failure.REJECTED


def classify_handshake_error(exc: HandshakeError) -> Failure:
    if exc.code is p.ErrorCode.OVERLOADED:
        return Failure.OVERLOADED
    if exc.transport or exc.code in _UNREACHABLE_HANDSHAKE:
        return Failure.UNREACHABLE
    return Failure.REJECTED


@dataclass
class ClientStatus:
    state: str = "starting"  # starting | connecting | connected | backoff | stopped
    connects: int = 0  # successful handshakes
    failures: int = 0  # failed dials or handshakes in a row
    last_error: str | None = None
    last_failure: str | None = None  # unreachable | overloaded | rejected
    already_connected: int = 0  # dials that reached a server already held
    # Tunnels that ended (each one redialed), by why: errors.END_LABELS, a closed set.
    lost: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass
class Tunnel:
    """One live connection to one server."""

    connection: TunnelConnection
    endpoint: Endpoint  # the address dialed (public or direct)
    server_id: str  # from the server's HELLO ("" from a server that sends none)
    since: float  # wall clock

    def as_dict(self) -> dict[str, object]:
        info = self.connection.info()
        return {
            "server_id": self.server_id, "address": str(self.endpoint), "peer": info.peer,
            "state": "draining" if info.draining else ("open" if self.connection.is_open
                                                       else "closed"),
            "rtt_ms": round(info.rtt_seconds * 1000, 2) if info.rtt_seconds is not None
            else None,
            "streams_open": info.streams_open, "bytes_in": info.bytes_in,
            "bytes_out": info.bytes_out,
            "connected_seconds": round(max(0.0, time.time() - self.since), 1),
        }


class _AlreadyConnected:
    """_connect_once's answer when the dial reached a server already held."""


ALREADY_CONNECTED = _AlreadyConnected()


@dataclass
class _Dialer:
    """The reconnect state of one address."""

    endpoint: Endpoint
    direct: bool
    policy: ReconnectPolicy
    extra: Backoff
    failure_log: RateLimitedLog
    log: StructuredLogger
    down_since: float | None = None
    next_delay: float = 0.0
    not_before: float = 0.0  # trio clock: no dial before (after a tunnel was lost)
    dialing: bool = False  # a dial or handshake is under way now
    last_error: str | None = None  # this address's last failure or lost tunnel


class TunnelClient:
    """Keeps tunnel connections to the server replicas behind `endpoint` (and to each of
    `direct`) alive, serves streams the servers open with `handler`, and opens streams on
    any live one."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        hello: Callable[[], p.Hello],
        handler: StreamHandler | None,
        take_stream: StreamTaker | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        headers: Callable[[], Sequence[tuple[str, str]]] = lambda: (),
        settings: EndpointSettings | None = None,
        socket_mark: int | None = None,
        backoff: Backoff | None = None,
        reconnect: ReconnectPolicy | None = None,
        connect_timeout: float = 10.0,
        direct: Sequence[Endpoint] = (),
        log: StructuredLogger | None = None,
        proxy: ProxyRules = DIRECT,
    ) -> None:
        self.endpoint = endpoint
        # Which forward proxy each address is dialed through (tunnel.proxy).
        self.proxy = proxy
        self._hello = hello
        self._handler = handler
        self._take_stream = take_stream  # see tunnel.stream.StreamTaker
        # Read at every dial: replace it to present a renewed certificate from the next
        # connection on (the running one stays up; TLS checked validity at its handshake).
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname
        self._headers = headers
        self.settings = settings or EndpointSettings()
        self.socket_mark = socket_mark
        if reconnect is None:
            # A bare Backoff (older callers) sets the rejected schedule's bounds.
            reconnect = (ReconnectPolicy(backoff.initial, backoff.maximum)
                         if backoff is not None else ReconnectPolicy())
        self.reconnect = reconnect
        self._connect_timeout = connect_timeout
        self.log = log or get_logger("tunnel.client", server=str(endpoint))
        self._rng = random.Random()
        self._dialers = [self._dialer(endpoint, False, reconnect)] + [
            self._dialer(ep, True, copy.deepcopy(reconnect)) for ep in direct]
        self.status = ClientStatus()
        self.tunnels: list[Tunnel] = []
        # Replicas behind the public address: from the latest server HELLO (1: unknown),
        # unless a hint (the agent's config, pushed when the count changes) says.
        self.announced_replicas = 1
        self._replicas_hint: int | None = None
        self._changed = trio.Event()
        self._dial_lock = trio.Lock()
        self._stopping = False  # drain(): dial nothing more
        self._connected = trio.Event()

    def _dialer(self, endpoint: Endpoint, direct: bool, policy: ReconnectPolicy) -> _Dialer:
        log = self.log if not direct else self.log.bind(direct=str(endpoint))
        return _Dialer(endpoint, direct, policy,
                       Backoff(EXTRA_DIAL_INITIAL, EXTRA_DIAL_MAXIMUM, rng=self._rng),
                       RateLimitedLog(log, period=FAILURE_LOG_PERIOD), log)

    @property
    def replicas(self) -> int:
        """How many distinct servers to hold a tunnel to."""
        return self._replicas_hint or self.announced_replicas

    def set_replicas(self, hint: int | None) -> None:
        """Hold a tunnel to `hint` servers (None: as the servers announce). More than
        before: the missing ones are dialed at once, not at the paced rate."""
        if hint == self._replicas_hint:
            return
        before, self._replicas_hint = self.replicas, hint
        if self.replicas > before:
            for dialer in self._dialers:
                dialer.extra.reset()
        self._notify()

    # ---------------------------------------------------------------- queries

    def live(self) -> list[Tunnel]:
        """Tunnels that take new streams: open and not draining."""
        return [t for t in self.tunnels
                if t.connection.is_open and not t.connection.is_draining]

    def held_servers(self) -> set[str]:
        return {t.server_id for t in self.live()}

    def dialing(self) -> list[dict[str, object]]:
        """For debug views: a row per address a tunnel is wanted through and not held
        yet (the public address while replicas are missing, a direct server that is
        down): dialing now or waiting to, since when, its last failure and the delay
        chosen after it."""
        now = trio.current_time()
        rows: list[dict[str, object]] = []
        for dialer in self._dialers:
            if not self._wanted(dialer):
                continue
            down = dialer.down_since
            rows.append({
                "server_id": None, "address": str(dialer.endpoint), "peer": None,
                "state": "dialing" if dialer.dialing else "backoff",
                "rtt_ms": None, "streams_open": 0, "bytes_in": 0, "bytes_out": 0,
                "since_seconds": round(now - down, 1) if down is not None else None,
                "last_error": dialer.last_error,
                # The delay chosen after its last failure (the reconnect policy's pick:
                # about a second while unreachable), so a test or an operator can see the
                # schedule without timing it.
                "retry_in_seconds": round(dialer.next_delay, 3),
            })
        return rows

    @property
    def connection(self) -> TunnelConnection | None:
        """A live connection (the one with fewest streams), or None."""
        live = self.live()
        if not live:
            return None
        return min(live, key=lambda t: t.connection.info().streams_open).connection

    async def wait_connected(self) -> TunnelConnection:
        while True:
            await self._connected.wait()
            if (conn := self.connection) is not None:
                return conn
            await trio.sleep(0.01)  # between a connection's end and its bookkeeping

    def connection_for_open(self) -> TunnelConnection | None:
        """The live connection a new stream goes through now (the least busy), or None:
        for an owner that opens without waiting (tunnel/spliceloop.py `open_in_loop`)."""
        live = self.live()
        if not live:
            return None
        tunnel = live[0] if len(live) == 1 else min(
            live, key=lambda t: t.connection.info().streams_open)
        return tunnel.connection

    async def open_stream(self, target: p.Target,
                          metadata: dict[str, str] | None = None) -> TunnelStream:
        """Open a stream on a live connection, trying the next one when a connection
        ended or drains meanwhile. Raises StreamRefusedError: with the peer's reason, or
        UNREACHABLE when no connection is left."""
        tried: set[int] = set()
        last = "tunnel is not connected"
        while True:
            candidates = [t for t in self.live() if id(t.connection) not in tried]
            if not candidates:
                raise StreamRefusedError(p.StreamReason.UNREACHABLE, last)
            # The least busy; one alone (one server replica) needs no comparing: info()
            # builds a whole snapshot, on every new connection.
            tunnel = candidates[0] if len(candidates) == 1 else min(
                candidates, key=lambda t: t.connection.info().streams_open)
            tried.add(id(tunnel.connection))
            try:
                return await tunnel.connection.open_stream(target, metadata)
            except TunnelClosedError as exc:
                last = f"tunnel connection ended: {exc}"
            except StreamRefusedError as exc:
                if exc.reason is not p.StreamReason.DRAINING:
                    raise
                last = str(exc)

    # ---------------------------------------------------------------- running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled."""
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                for dialer in self._dialers:
                    nursery.start_soon(self._keep, dialer, nursery)
        finally:
            self.status.state = "stopped"

    def drain(self, message: str = "agent shutting down") -> None:
        """Stop dialing and send GOAWAY on every tunnel: the servers open no new streams
        here, the running ones finish (wait_idle). For a graceful restart."""
        self._stopping = True
        for tunnel in self.tunnels:
            if tunnel.connection.is_open:
                tunnel.connection.goaway(message)
        self._notify()

    async def wait_idle(self) -> None:
        """Until no tunnel has a stream open (after drain())."""
        for tunnel in list(self.tunnels):
            await tunnel.connection.wait_idle()

    def streams_open(self) -> int:
        return sum(t.connection.info().streams_open for t in self.tunnels)

    def _wanted(self, dialer: _Dialer) -> bool:
        if self._stopping:
            return False
        live = self.live()
        mine = any(t.endpoint is dialer.endpoint for t in live)
        if dialer.direct:
            return not mine
        return not mine or len({t.server_id for t in live}) < self.replicas

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        if self.live():
            self.status.state = "connected"
            self._connected.set()
        else:
            self._connected = trio.Event()

    async def _keep(self, dialer: _Dialer, nursery: trio.Nursery) -> None:
        """Dial `dialer.endpoint` whenever a tunnel through it is wanted."""
        while True:
            while not self._wanted(dialer):
                await self._changed.wait()
            if (wait := dialer.not_before - trio.current_time()) > 0:
                await trio.sleep(wait)
                continue
            async with self._dial_lock:
                if not self._wanted(dialer):
                    continue
                dialer.dialing = True
                try:
                    result = await self._connect_once(dialer)
                finally:
                    dialer.dialing = False
            if isinstance(result, TunnelConnection):
                tunnel = Tunnel(result, dialer.endpoint,
                                result.identity.get(p.IDENTITY_SERVER, ""), time.time())
                self.announced_replicas = p.server_replicas(result.identity) or 1
                self.tunnels.append(tunnel)
                dialer.extra.reset()
                nursery.start_soon(self._serve, tunnel, dialer)
                self._notify()  # a replica still missing is dialed at once
                continue
            if result is ALREADY_CONNECTED:
                self.status.already_connected += 1
                delay = (dialer.policy.delay(Failure.REJECTED) if dialer.direct
                         else dialer.extra.next_delay())
                dialer.log.debug("reached a server already held; dialing again later",
                                 retry_in=f"{delay:.2f}s")
                await trio.sleep(delay)
                continue
            if not self.live():
                self.status.state = "backoff"
            delay = dialer.next_delay
            if self.live() and not dialer.direct:
                # Missing a replica while others serve: no hurry, bounded rate.
                delay = max(delay, dialer.extra.next_delay())
            await trio.sleep(delay)

    async def _connect_once(self, dialer: _Dialer) -> TunnelConnection | _AlreadyConnected | None:
        if not self.live():
            self.status.state = "connecting"
        try:
            transport = await dial(
                dialer.endpoint, ssl_context=self.ssl_context,
                server_hostname=self.server_hostname,
                connect_timeout=self._connect_timeout, socket_mark=self.socket_mark,
                headers=tuple(self._headers()),
                tcp_timeout=min(TCP_CONNECT_TIMEOUT, self._connect_timeout),
                proxy=self.proxy.for_endpoint(dialer.endpoint))
        except TransportError as exc:
            self._failed(dialer, f"dial failed: {exc}", classify_dial_error(exc))
            return None
        conn = TunnelConnection(transport, p.Role.DIALER, self.settings, self._handler,
                                log=dialer.log.bind(peer=transport.peer.address),
                                take_stream=self._take_stream)
        hello = self._with_features(self._hello())
        hello = p.Hello(settings=hello.settings,
                        identity=p.with_held_servers(hello.identity, self.held_servers()),
                        features=hello.features, min_version=hello.min_version,
                        max_version=hello.max_version)
        try:
            await conn.dial_handshake(hello)
        except HandshakeError as exc:
            await transport.aclose()
            if exc.code is p.ErrorCode.ALREADY_CONNECTED:
                return ALREADY_CONNECTED
            failure = classify_handshake_error(exc)
            if exc.code is p.ErrorCode.UNAUTHORIZED:
                self._failed(dialer, f"server refused our credentials: {exc}", failure,
                             level="error")
            elif exc.code is p.ErrorCode.UNSUPPORTED_VERSION:
                self._failed(dialer, f"protocol version mismatch: {exc}", failure,
                             level="error")
            elif failure is Failure.OVERLOADED:
                self._failed(dialer, f"server is busy: {exc}", failure,
                             retry_after=exc.retry_after)
            else:
                self._failed(dialer, f"handshake failed: {exc}", failure)
            return None
        self.status.connects += 1
        self.status.failures = 0
        self.status.last_error = None
        dialer.last_error = None
        self.status.last_failure = None
        dialer.policy.reset()
        dialer.failure_log = RateLimitedLog(dialer.log, period=FAILURE_LOG_PERIOD)
        fields = {}
        if dialer.down_since is not None and not self.live():
            fields["down_seconds"] = f"{trio.current_time() - dialer.down_since:.2f}"
        dialer.down_since = None
        dialer.log.info("tunnel connected", peer=transport.peer.address,
                        server_identity=conn.identity.get(p.IDENTITY_SERVER, ""),
                        replicas=conn.identity.get(p.IDENTITY_REPLICAS, ""),
                        tunnels=len(self.live()) + 1, **fields)
        return conn

    @staticmethod
    def _with_features(hello: p.Hello) -> p.Hello:
        """Announce what this client understands (the server's retry-after)."""
        if p.FEATURE_RETRY_AFTER in hello.features:
            return hello
        return p.Hello(settings=hello.settings, identity=hello.identity,
                       features=(*hello.features, p.FEATURE_RETRY_AFTER),
                       min_version=hello.min_version, max_version=hello.max_version)

    def _failed(self, dialer: _Dialer, message: str, failure: Failure, *,
                level: str = "warning", retry_after: float | None = None) -> None:
        """Count a failed attempt, pick the delay before the next, and log it: the first
        of each kind at once, then at most one line per kind every 30 s with a count."""
        if dialer.down_since is None:
            dialer.down_since = trio.current_time()
        self.status.failures += 1
        self.status.last_error = message
        dialer.last_error = message
        self.status.last_failure = failure.value
        dialer.next_delay = dialer.policy.delay(failure, retry_after)
        fields = {"reason": message, "failure": failure.value,
                  "failures": self.status.failures,
                  "retry_in": f"{dialer.next_delay:.2f}s"}
        if self.live():
            fields["tunnels"] = len(self.live())
        log = dialer.failure_log.error if level == "error" else dialer.failure_log.warning
        log(failure.value, "tunnel connect failed", **fields)

    async def _serve(self, tunnel: Tunnel, dialer: _Dialer) -> None:
        conn = tunnel.connection

        async def close_when_drained() -> None:
            await conn.goaway_received.wait()
            dialer.log.info("server is draining this connection; dialing a new one",
                            server_identity=tunnel.server_id)
            self._notify()  # no longer live: the keeper dials a replacement at once
            with trio.move_on_after(300):
                await conn.wait_idle()
            await conn.aclose(p.ErrorCode.NO_ERROR, "drained")

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(close_when_drained)
                await conn.run()
                nursery.cancel_scope.cancel()
        finally:
            self.tunnels.remove(tunnel)
            if dialer.down_since is None:
                dialer.down_since = trio.current_time()
            drained = conn.goaway_received.is_set()
            reason = conn.end_reason
            label = end_label(reason, drained=drained)
            self.status.lost[label] += 1
            if not drained:
                dialer.last_error = f"tunnel to {tunnel.server_id or 'server'} lost " \
                                    f"({label}): {reason or 'cancelled'}"
            if drained:
                pass  # its replacement was dialed when the GOAWAY came
            elif reason is not None and reason.code is p.ErrorCode.REPLACED:
                # Another agent registered our node name: normally our own replacement
                # (a restarted pod) and this process is on its way out. If both live,
                # retrying at once would make them evict each other in a loop, so wait
                # the longest backoff.
                dialer.policy.to_maximum()
                dialer.not_before = trio.current_time() + dialer.policy.delay(
                    Failure.REJECTED)
                dialer.log.error("another agent connected with this node name and "
                                 "replaced this connection; retrying at the slowest "
                                 "backoff", reason=str(reason))
            else:
                delay = dialer.policy.delay(Failure.UNREACHABLE)
                dialer.not_before = trio.current_time() + delay
                dialer.log.warning("tunnel connection lost",
                                   reason=str(reason) if reason else "unknown",
                                   retry_in=f"{delay:.2f}s",
                                   server_identity=tunnel.server_id,
                                   tunnels=len(self.live()))
            if not self.live():
                self.status.state = "backoff"
            self._notify()
