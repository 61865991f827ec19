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
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
from tunnel.log import RateLimitedLog, StructuredLogger, get_logger
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


class TunnelClient:
    """Keeps one tunnel connection to `endpoint` alive and serves streams the server
    opens with `handler`."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        hello: Callable[[], p.Hello],
        handler: StreamHandler | None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        headers: Callable[[], Sequence[tuple[str, str]]] = lambda: (),
        settings: EndpointSettings | None = None,
        socket_mark: int | None = None,
        backoff: Backoff | None = None,
        reconnect: ReconnectPolicy | None = None,
        connect_timeout: float = 10.0,
        log: StructuredLogger | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._hello = hello
        self._handler = handler
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
        self._failure_log = RateLimitedLog(self.log, period=FAILURE_LOG_PERIOD)
        self._down_since: float | None = None
        self.status = ClientStatus()
        self._next_delay = 0.0
        self.connection: TunnelConnection | None = None
        self._connected = trio.Event()

    async def wait_connected(self) -> TunnelConnection:
        while True:
            await self._connected.wait()
            if self.connection is not None and self.connection.is_open:
                return self.connection
            await trio.sleep(0.01)  # between a connection's end and its bookkeeping

    async def open_stream(self, target: p.Target,
                          metadata: dict[str, str] | None = None) -> TunnelStream:
        """Open a stream on the current connection. Raises StreamRefusedError: with the
        peer's reason, or UNREACHABLE when there is no connection or it ends meanwhile."""
        conn = self.connection
        if conn is None or not conn.is_open or conn.is_draining:
            raise StreamRefusedError(p.StreamReason.UNREACHABLE, "tunnel is not connected")
        try:
            return await conn.open_stream(target, metadata)
        except TunnelClosedError as exc:
            raise StreamRefusedError(p.StreamReason.UNREACHABLE,
                                     f"tunnel connection ended: {exc}") from None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled."""
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    conn = await self._connect_once()
                    if conn is None:
                        self.status.state = "backoff"
                        await trio.sleep(self._next_delay)
                        continue
                    done = trio.Event()
                    nursery.start_soon(self._serve, conn, done)
                    # Wait until this connection ends or the server asks us to move.
                    async with trio.open_nursery() as watch:
                        async def until(event: trio.Event) -> None:
                            await event.wait()
                            watch.cancel_scope.cancel()
                        watch.start_soon(until, done)
                        watch.start_soon(until, conn.goaway_received)
                    self._down_since = trio.current_time()
                    if conn.goaway_received.is_set() and not done.is_set():
                        self.log.info("server is draining this connection; dialing a new one")
                        continue  # make-before-break: the old one finishes in _serve
                    reason = conn.end_reason
                    if reason is not None and reason.code is p.ErrorCode.REPLACED:
                        # Another agent registered our node name: normally our own
                        # replacement (a restarted pod) and this process is on its way
                        # out. If both live, retrying at once would make them evict each
                        # other in a loop, so wait the longest backoff.
                        self.reconnect.to_maximum()
                        delay = self.reconnect.delay(Failure.REJECTED)
                        self.log.error("another agent connected with this node name and "
                                       "replaced this connection; retrying at the "
                                       "slowest backoff", reason=str(reason))
                    else:
                        delay = self.reconnect.delay(Failure.UNREACHABLE)
                        self.log.warning("tunnel connection lost",
                                         reason=str(reason) if reason else "unknown",
                                         retry_in=f"{delay:.2f}s")
                    self.status.state = "backoff"
                    await trio.sleep(delay)
        finally:
            self.status.state = "stopped"

    async def _connect_once(self) -> TunnelConnection | None:
        self.status.state = "connecting"
        try:
            transport = await dial(
                self.endpoint, ssl_context=self.ssl_context,
                server_hostname=self.server_hostname,
                connect_timeout=self._connect_timeout, socket_mark=self.socket_mark,
                headers=tuple(self._headers()),
                tcp_timeout=min(TCP_CONNECT_TIMEOUT, self._connect_timeout))
        except TransportError as exc:
            self._failed(f"dial failed: {exc}", classify_dial_error(exc))
            return None
        conn = TunnelConnection(transport, p.Role.DIALER, self.settings, self._handler,
                                log=self.log.bind(peer=transport.peer.address))
        try:
            await conn.dial_handshake(self._with_features(self._hello()))
        except HandshakeError as exc:
            await transport.aclose()
            failure = classify_handshake_error(exc)
            if exc.code is p.ErrorCode.UNAUTHORIZED:
                self._failed(f"server refused our credentials: {exc}", failure, level="error")
            elif exc.code is p.ErrorCode.UNSUPPORTED_VERSION:
                self._failed(f"protocol version mismatch: {exc}", failure, level="error")
            elif failure is Failure.OVERLOADED:
                self._failed(f"server is busy: {exc}", failure, retry_after=exc.retry_after)
            else:
                self._failed(f"handshake failed: {exc}", failure)
            return None
        self.status.connects += 1
        self.status.failures = 0
        self.status.last_error = None
        self.status.last_failure = None
        self.status.state = "connected"
        self.reconnect.reset()
        self._failure_log = RateLimitedLog(self.log, period=FAILURE_LOG_PERIOD)
        fields = {}
        if self._down_since is not None:
            fields["down_seconds"] = f"{trio.current_time() - self._down_since:.2f}"
        self._down_since = None
        self.log.info("tunnel connected", peer=transport.peer.address,
                      server_identity=conn.identity.get("server", ""), **fields)
        return conn

    @staticmethod
    def _with_features(hello: p.Hello) -> p.Hello:
        """Announce what this client understands (the server's retry-after)."""
        if p.FEATURE_RETRY_AFTER in hello.features:
            return hello
        return p.Hello(settings=hello.settings, identity=hello.identity,
                       features=(*hello.features, p.FEATURE_RETRY_AFTER),
                       min_version=hello.min_version, max_version=hello.max_version)

    def _failed(self, message: str, failure: Failure, *, level: str = "warning",
                retry_after: float | None = None) -> None:
        """Count a failed attempt, pick the delay before the next, and log it: the first
        of each kind at once, then at most one line per kind every 30 s with a count."""
        if self._down_since is None:
            self._down_since = trio.current_time()
        self.status.failures += 1
        self.status.last_error = message
        self.status.last_failure = failure.value
        self._next_delay = self.reconnect.delay(failure, retry_after)
        fields = {"reason": message, "failure": failure.value,
                  "failures": self.status.failures, "retry_in": f"{self._next_delay:.2f}s"}
        log = self._failure_log.error if level == "error" else self._failure_log.warning
        log(failure.value, "tunnel connect failed", **fields)

    async def _serve(self, conn: TunnelConnection, done: trio.Event) -> None:
        async def close_when_drained() -> None:
            await conn.goaway_received.wait()
            with trio.move_on_after(300):
                await conn.wait_idle()
            await conn.aclose(p.ErrorCode.NO_ERROR, "drained")

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(close_when_drained)
                self.connection = conn
                self._connected.set()
                await conn.run()
                nursery.cancel_scope.cancel()
        finally:
            if self.connection is conn:
                self.connection = None
                self._connected = trio.Event()
            done.set()
