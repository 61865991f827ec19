"""The controller's side of the config stream (its wire contract:
`nodeagent.configstream.protocol`): HTTP/1.1 (`ops.jsonhttp`'s server) over TLS.

    GET  /v1/config/nodes/{node}?after=N     an agent's NodeConfig
    GET  /v1/config/servers/{id}?after=N     the servers' RoutesConfig
    POST /v1/certificates                    how a client gets its certificate (signing.py)
    POST /v1/servers/{id}/activity|wake      scale to zero: a server's reports (sleeper.py)

Every connection is TLS with this replica's serving certificate (`servingtls`); a client
certificate from the controller's CA is optional at the handshake and decides what the
client may read (`peer_identity`, `may_read`): a node certificate reads its own node's
config only, a server identity the servers' config (which holds Ingress TLS keys), and a
client without a certificate nothing but the signing endpoint. Agents reach this through
their tunnel with TLS end to end, so a server relaying their bytes can neither read nor
forge a node's config.

Connections are capped, so that idle dialers cannot exhaust this process's file
descriptors (600 idle streams once took it from 21 to 621 open files): at most
`max_connections` in all (and never more than the file limit allows), and at most
`max_anonymous_per_peer` from one address (IPv6: one /64) that have not yet proved an
identity — still in the TLS handshake, or holding no client certificate. Agents and
servers reach this through a few server pods, so a per-address cap on connections that
did prove an identity would cap the fleet: those count only in the total. A connection
over a cap is closed at once, before its handshake, counted by reason
(`too_many_connections`, `too_many_from_peer`) and logged at most once a minute per
reason. A connection must finish its handshake within `anonymous_deadline`; one without
a client certificate must also have sent its whole request by then, and gets one
answer (the signer's) before it is closed.

A watch answers `200`, `Content-Type: application/x-ndjson`, chunked, and never ends: one
line `{"version": V, "config": {...}}` at once if the subscriber's current version V is
newer than `after` (an unknown node gets an empty NodeConfig at version 0), then one line
per new version, and `{}` as a heartbeat when it has sent nothing for `heartbeat` seconds
(60 by default), announced in the `x-nodeagent-heartbeat` header so the watcher knows when
to give up (after three missed). The heartbeat is for a peer that is wedged but still
answers TCP; a peer that vanished is noticed sooner by TCP keepalive on every hop (the
controller's accepted sockets here, the dials of `tunnel.tcp`), at no cost in this process:
at 5,000 watches each heartbeat round is 5,000 TLS writes (~60 µs each). A slow subscriber
is never queued for: each wake-up sends only the newest version; a change wakes only the
watches of the keys it changed (`notify(keys)`). A refusal is one JSON line `{"error": ...,
"reason": <code>}`, counted by reason and logged at most once a minute per reason.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import resource
import ssl
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import trio
from cryptography import x509

from nodeagent.config import DNS_NAME, NodeConfig
from nodeagent.configstream.protocol import (
    HEARTBEAT_HEADER,
    HEARTBEAT_LINE,
    MAX_REQUEST_BYTES,
    NODES,
    config_line,
    parse_config_path,
    parse_report_path,
)
from nodeagent.controller.compute import ConfigVersions
from nodeagent.controller.metrics import ControllerMetrics
from nodeagent.ops.jsonhttp import (
    Reply,
    Request,
    StreamingReply,
    serve_http,
)
from nodeagent.ops.logs import get_logger
from nodeagent.trust import pki
from nodeagent.trust.enrollment import CERTIFICATES_PATH
from tunnel.log import RateLimitedLog
from tunnel.tcp import set_keepalive
from tunnel.transports.tls import TLSStream

log = get_logger("nodeagent.controller.configserver")
# What a watch of a node the controller has no config for gets: an empty one, version 0.
EMPTY_NODE_LINE = (0, config_line(0, NodeConfig()))


@dataclass(frozen=True)
class Identity:
    """Who a verified client certificate says the client is."""

    kind: str  # "node" | "server"
    name: str


def peer_identity(der: bytes | None) -> Identity | None:
    """The identity in a client certificate the TLS handshake verified against our CA:
    exactly one `nodeagent://server/<pod>` or `nodeagent://node/<node>` URI SAN with
    clientAuth. None for no certificate or any other certificate of the CA (the servers'
    tunnel certificate, the controller's own)."""
    if not der:
        return None
    server = pki.server_name_from_certificate(der)
    if server is not None:
        return Identity("server", server)
    node = pki.node_name_from_certificate(der)
    # node_name_from_certificate may still fall back to a certificate's CN (certificates
    # of other PKIs); here only our node URI names a node.
    if node is None or not DNS_NAME.match(node) or _uris(der) != [pki.NODE_URI_PREFIX + node]:
        return None
    return Identity("node", node)


def _uris(der: bytes) -> list[str]:
    try:
        san = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError):
        return []
    return [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u.startswith("nodeagent://")]


def may_read(identity: Identity | None, kind: str, name: str) -> bool:
    """`kind` is the path's "nodes" or "servers": a node reads only its own config; any
    server replica reads the servers' config; nobody else reads anything."""
    if identity is None:
        return False
    if kind == "nodes":
        return identity.kind == "node" and identity.name == name
    return kind == "servers" and identity.kind == "server"


# POST /v1/certificates: the request and the identity its connection's client
# certificate proves (None: anonymous).
Signer = Callable[[Request, Identity | None], Awaitable[Reply]]


@dataclass(frozen=True)
class ConnectionLimits:
    """Caps on the config stream's connections (see the module docstring)."""

    max_connections: int = 20_000
    max_anonymous_per_peer: int = 256
    anonymous_deadline: float = 5.0  # handshake (and, anonymous, the request) within

    def effective_max(self) -> int:
        """`max_connections`, lowered to what the process's file limit leaves room for
        (a reserve for the API client, the informers and the metrics listener)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft - 128))


def peer_key(address: str) -> str:
    """Whom a per-address cap counts: the IPv4 address (an IPv4-mapped IPv6 one
    unmapped), or the IPv6 /64."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def refusal(status: int, reason: str, message: str) -> Reply:
    """One JSON line saying why, and the connection closes: a refused client reconnects
    with backoff, no reason to keep its connection."""
    body = json.dumps({"error": message, "reason": reason}, separators=(",", ":")) + "\n"
    return Reply(status, body.encode(), headers=(("connection", "close"),))


class ConfigStreamServer:
    """`tls()` gives the current serving context (it waits until there is one: a fresh
    cluster has no CA until the leader creates it); `signer` answers POST
    /v1/certificates; `authorize(identity, kind, name)` decides each watch."""

    def __init__(self, versions: ConfigVersions, *,
                 tls: Callable[[], Awaitable[ssl.SSLContext]],
                 signer: Signer | None = None,
                 authorize: Callable[[Identity | None, str, str], bool] = may_read,
                 reports: Callable[[str, str, bytes], Awaitable[Reply]] | None = None,
                 metrics: ControllerMetrics | None = None,
                 heartbeat: float = 60.0, request_timeout: float = 10.0,
                 limits: ConnectionLimits | None = None) -> None:
        self.versions = versions
        self.limits = limits or ConnectionLimits()
        self.max_connections = self.limits.effective_max()
        self.connections = 0  # open now
        self.unproven: Counter[str] = Counter()  # peer → connections without an identity
        self._tls = tls
        self._signer = signer
        self._authorize = authorize
        self._reports = reports
        self.metrics = metrics or ControllerMetrics()
        self.heartbeat = heartbeat
        self.request_timeout = request_timeout
        # key → the event its open watches wait on, and since when: a change wakes only
        # the watches of the keys it changed (one node's Ingress edit wakes one task, not
        # 5,000), and `_heartbeats` wakes those that waited `heartbeat` seconds. In
        # insertion order, which is the order they started waiting.
        self._waiting: dict[str, tuple[trio.Event, float]] = {}
        self._refusals = RateLimitedLog(log)
        self.subscribers: Counter[str] = Counter()  # key → open watches

    def notify(self, keys: Iterable[str] | None = None) -> None:
        """New versions are in `versions` for `keys` ("node/NAME", "servers"; None: any):
        wake the watches of those keys."""
        if keys is None:
            waiting, self._waiting = self._waiting, {}
            for event, _ in waiting.values():
                event.set()
            return
        for key in keys:
            if key in self._waiting:
                self._waiting.pop(key)[0].set()

    def _wakeup(self, key: str) -> trio.Event:
        waiting = self._waiting.get(key)
        if waiting is None:
            waiting = self._waiting[key] = (trio.Event(), trio.current_time())
        return waiting[0]

    def wake_idle(self, now: float) -> int:
        """Wake the watches that have waited `heartbeat` seconds (they send `{}`);
        returns how many keys. Only the due ones are looked at: `_waiting` is in the
        order they started waiting."""
        due = []
        for key, (_, since) in self._waiting.items():
            if now - since < self.heartbeat:
                break
            due.append(key)
        for key in due:
            self._waiting.pop(key)[0].set()
        return len(due)

    async def _heartbeats(self) -> None:
        # One task and no timer per watch: 5,000 watches each sleeping in a cancel scope
        # of their own cost a deadline each, pruned from trio's heap in bulk, and a
        # Cancelled exception per heartbeat.
        tick = min(1.0, self.heartbeat / 4)
        while True:
            await trio.sleep(tick)
            self.wake_idle(trio.current_time())

    async def run(self, host: str, port: int, *,
                  task_status: trio.TaskStatus[list[trio.SocketListener]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        log.info("config stream listening", address=f"{host}:{port}")
        task_status.started(listeners)
        # Until there is a serving certificate, dialers wait in the listen backlog.
        await self._tls()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats)
            await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        try:
            peer = peer_key(str(stream.socket.getpeername()[0]))
        except OSError:  # gone already
            await trio.aclose_forcefully(stream)
            return
        if self.connections >= self.max_connections:
            await self._refuse_connection(stream, "too_many_connections", peer)
            return
        if self.unproven[peer] >= self.limits.max_anonymous_per_peer:
            await self._refuse_connection(stream, "too_many_from_peer", peer)
            return
        self.connections += 1
        self.unproven[peer] += 1
        proven = False
        try:
            deadline = trio.current_time() + self.limits.anonymous_deadline
            with trio.CancelScope(deadline=deadline) as scope:
                shaken = await self._handshake(stream)
                if shaken is None:
                    return
                tls, identity = shaken
                if identity is not None:
                    proven = True
                    self._release(peer)
                    scope.deadline = float("inf")
                await serve_http(tls, handler=functools.partial(
                    self._answer_within, identity, scope), idle_timeout=self.request_timeout,
                    max_request_bytes=MAX_REQUEST_BYTES)
            if scope.cancelled_caught and scope.deadline == deadline:  # never answered
                self.metrics.config("anonymous_deadline")
                self._refusals.warning("anonymous_deadline", "config stream connection "
                                       "closed: no certificate and no request in time",
                                       reason="anonymous_deadline")
        finally:
            self.connections -= 1
            if not proven:
                self._release(peer)
            await trio.aclose_forcefully(stream)

    def _release(self, peer: str) -> None:
        self.unproven[peer] -= 1
        if self.unproven[peer] <= 0:
            del self.unproven[peer]

    async def _refuse_connection(self, stream: trio.SocketStream, reason: str,
                                 peer: str) -> None:
        self.metrics.config(reason)
        self._refusals.warning(reason, "config stream connection refused", reason=reason,
                               peer=peer, open=self.connections)
        await trio.aclose_forcefully(stream)

    async def _handshake(self, stream: trio.SocketStream
                         ) -> tuple[TLSStream, Identity | None] | None:
        """The TLS stream and the identity its client certificate proves (None: no
        certificate); None if the handshake failed (counted and logged here)."""
        # A client that vanished while its watch was quiet: the kernel ends it in ~35 s
        # (with a heartbeat unacknowledged, TCP's retransmission timeout does, later).
        set_keepalive(stream.socket)
        # The tunnel's TLSStream, not trio.SSLStream: its send_nowait lets a watch write
        # a config line without a scheduler round trip (jsonhttp._send_chunk).
        tls = TLSStream(stream, await self._tls(), server_side=True)
        try:
            with trio.fail_after(min(self.request_timeout, self.limits.anonymous_deadline)):
                await tls.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            # Scanners, health checks, clients with a certificate of another CA.
            self.metrics.config("tls_handshake")
            cause = exc.__cause__ if isinstance(exc.__cause__, ssl.SSLError) else exc
            self._refusals.warning("tls_handshake", "config stream TLS handshake failed",
                                   reason="tls_handshake", error=str(cause)[:200])
            await trio.aclose_forcefully(tls)
            return None
        return tls, peer_identity(tls.getpeercert(binary_form=True))

    async def _answer_within(self, identity: Identity | None, scope: trio.CancelScope,
                             request: Request) -> Reply | StreamingReply:
        if identity is None:
            # The request is in: time for its answer, then the connection ends (an
            # anonymous client gets one answer; its keep-alive would hold a slot).
            scope.deadline = trio.current_time() + self.request_timeout
        return await self.answer(identity, request)

    async def answer(self, identity: Identity | None, request: Request
                     ) -> Reply | StreamingReply:
        if request.path == CERTIFICATES_PATH and self._signer is not None:
            return await self._signer(request, identity)
        report = parse_report_path(request.path)
        if report is not None and self._reports is not None:
            return await self._report(identity, request, *report)
        watched = parse_config_path(request.path)
        if watched is None:
            return self._refuse(404, "not_found", "use /v1/config/nodes/NAME, "
                                f"/v1/config/servers/ID or POST {CERTIFICATES_PATH}")
        kind, name = watched
        if request.method != "GET":
            return self._refuse(405, "method_not_allowed", "config paths take GET")
        if not self._authorize(identity, kind, name):
            who = "no client certificate" if identity is None else \
                f"{identity.kind} {identity.name}"
            # Keyed by what kind of client asked for what kind of path: a bounded set.
            key = f"forbidden:{identity.kind if identity else 'anonymous'}:{kind}"
            return self._refuse(403, "forbidden", f"{who} may not read {request.path}",
                                log_key=key, client=who)
        try:
            after = int(request.query.get("after", ["-1"])[0])
        except ValueError:
            return self._refuse(400, "bad_after", "after must be an integer")
        self.metrics.config("watching")
        return StreamingReply(self._watch(kind, name, after), headers=(
            ("cache-control", "no-store"), (HEARTBEAT_HEADER.decode(), f"{self.heartbeat:g}")))

    async def _report(self, identity: Identity | None, request: Request, kind: str,
                      server_id: str) -> Reply:
        """A server's scale-to-zero report: only a server certificate may post one (a
        node's agent, or anyone without a certificate, cannot wake or keep awake)."""
        assert self._reports is not None
        if request.method != "POST":
            return self._refuse(405, "method_not_allowed", "report paths take POST")
        if identity is None or identity.kind != "server":
            who = "no client certificate" if identity is None else \
                f"{identity.kind} {identity.name}"
            key = f"forbidden:{identity.kind if identity else 'anonymous'}:{kind}"
            return self._refuse(403, "forbidden", f"{who} may not post {request.path}",
                                log_key=key, client=who)
        self.metrics.config(f"report_{kind}")
        return await self._reports(kind, server_id, request.body)

    def _refuse(self, status: int, reason: str, message: str, *, log_key: str | None = None,
                **fields: Any) -> Reply:
        self.metrics.config(reason)
        self._refusals.warning(log_key or reason, "config request refused", status=status,
                               reason=reason, **fields)
        return refusal(status, reason, message)

    async def _watch(self, kind: str, name: str, after: int) -> AsyncGenerator[bytes, None]:
        key = f"node/{name}" if kind == NODES else "servers"
        self.subscribers[key] += 1
        log.info("config watch opened", subscriber=name, kind=kind, after=after)
        woken = False
        try:
            while True:
                changed = self._wakeup(key)
                # Encoded once per version (ConfigVersions.line), not once per watch.
                current = self.versions.line(key)
                if current is None and key.startswith("node/"):
                    current = EMPTY_NODE_LINE
                if current is not None and current[0] > after:
                    after = current[0]
                    yield current[1]
                elif woken:  # by _heartbeats, or by a change another watch already sent
                    yield HEARTBEAT_LINE
                await changed.wait()
                woken = True
        finally:
            self.subscribers[key] -= 1
            if not self.subscribers[key]:
                del self.subscribers[key]
                self._waiting.pop(key, None)
            log.info("config watch closed", subscriber=name, kind=kind)
