"""The CONNECT front's I/O: the listeners kube-apiserver's egress selector and Prometheus
use to reach nodes through their agents.

- a Unix socket (`transport.uds`): the file's mode and owner authenticate (0600 or 0660);
- TCP with mutual TLS (`transport.tcp` with a tlsConfig): only clients whose certificate
  the configured CA signed; anything else fails the handshake, is counted and logged. Of
  those, only the allowed identities (`connect.tls.allowed_subjects` CNs, default
  kube-apiserver's egress client, or `allowed_organizations`) get past their request
  head: any other certificate of the CA (a kubelet's) is refused with 403
  `client_not_allowed`.

Each connection sends one request head (h11 parses it; `head_timeout` bounds how long that
may take). `CONNECT host:port` → `nodeagent.server.connect.decide` → a stream through the
node's agent (metadata purpose=control-plane, so the agent checks its own control-plane
rules) → `200 Connection established`, then bytes both ways for as long as both ends keep
the stream (no idle timeout: `kubectl logs -f` and exec run for hours; half-close passes
through on the Unix socket, a full close resets the stream (`UdsClientStream`) — TLS has
no half-close, so there the first end closes both).
An absolute-form `GET http://node:port/path` (Prometheus `proxy_url`) is decided the same
way and forwarded as one request with `Connection: close`; the response streams back
until the target closes. Refusals answer 400/403/408/502/503/504 with a one-line body,
are counted in `nodeagent_connect_requests_total{outcome}` and logged at most once a
minute per reason. Open streams show in the server's debug status (`connect.streams`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
import ssl
import stat
import time
from collections import Counter
from typing import Any, Protocol

import h11
import trio
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as MetricCounter

from nodeagent.config import (
    CONTROL_PLANE_PURPOSE,
    PURPOSE_KEY,
    ConfigError,
    ConnectFrontConfig,
    RoutesConfig,
)
from nodeagent.ops.listener import Listener, bind_errors, socket_address
from nodeagent.ops.streamviews import LiveStreams
from nodeagent.server.connect import (
    REASONS,
    ConnectRoute,
    ProxyTarget,
    Refusal,
    check_client,
    decide,
    parse_target,
)
from nodeagent.trust.tlscontext import TlsInputError, server_ssl_context
from tunnel import protocol as p
from tunnel.errors import StreamFailed
from tunnel.log import RateLimitedLog, StructuredLogger
from tunnel.server import NodeNotConnected
from tunnel.splice import close_stream, splice
from tunnel.stream import TunnelStream

_MAX_HEAD = 16 * 1024
# Request headers not forwarded to the target: hop-by-hop (RFC 9110 §7.6.1) and the
# proxy's own credentials.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te",
                         b"trailer", b"transfer-encoding", b"upgrade",
                         b"proxy-authorization", b"proxy-authenticate"})


class StreamOpener(Protocol):
    async def __call__(self, node: str, target: p.Target,
                       metadata: dict[str, str]) -> TunnelStream: ...


class ConnectFront(Listener):
    """Serves CONNECT and absolute-form proxy requests on the configured listeners."""

    kind = "connect"

    def __init__(self, config: ConnectFrontConfig, *, routes: Any, open_stream: StreamOpener,
                 dial_timeout: float, registry: CollectorRegistry, log: StructuredLogger,
                 server_tls: tuple[Any, Any] | None = None) -> None:
        super().__init__("connect")
        self.config = config
        self._routes = routes  # () -> RoutesConfig: read per request, swapped on updates
        self._open_stream = open_stream
        self.dial_timeout = dial_timeout
        self.log = log.bind(front="connect")
        self._refusal_log = RateLimitedLog(self.log, period=60.0)
        self._server_tls = server_tls  # the tunnel's (cert, key) when connect.tls has none
        self.streams = LiveStreams()
        self.outcomes: Counter[str] = Counter()
        self.requests = MetricCounter(
            "nodeagent_connect_requests_total", "Requests to the CONNECT front (kube-apiserver"
            "'s egress selector, HTTP proxy clients) by outcome: established, forwarded, or "
            "the refusal reason", ["outcome"], registry=registry)
        self.bytes = MetricCounter(
            "nodeagent_connect_bytes_total", "Bytes carried by CONNECT front streams: in "
            "(client to node), out (node to client)", ["direction"], registry=registry)
        # Built now: a certificate or CA that cannot be used stops the server at start.
        self._context = self.ssl_context() if config.listen is not None else None
        self.handshake_failures = MetricCounter(
            "nodeagent_connect_handshake_failures_total", "TLS clients of the CONNECT front "
            "refused before any request (no or untrusted certificate, not TLS)",
            registry=registry)

    # ------------------------------------------------------------------ listeners

    async def run(self, *, task_status: trio.TaskStatus[list[str]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.config.uds is not None:
                with bind_errors("connect.uds", self.config.uds):
                    await nursery.start(self._serve_uds, self.config.uds)
            if self.config.listen is not None:
                with bind_errors("connect.listen", self.config.listen):
                    await nursery.start(self._serve_tls)
            self.log.info("CONNECT front listening", addresses=",".join(self.addresses))
            task_status.started(list(self.addresses))

    def ssl_context(self) -> ssl.SSLContext:
        """The TCP listener's TLS context (client certificates required); ConfigError
        naming the field if a file cannot be used."""
        tls = self.config.tls
        assert tls is not None
        cert, key = (tls.cert_file, tls.key_file) if tls.cert_file is not None else (
            self._server_tls or (None, None))
        if cert is None or key is None:
            raise ConfigError("connect.tls: give cert_file and key_file (the server has no "
                              "tunnel certificate to reuse)")
        try:
            return server_ssl_context(cert, key, client_ca=tls.client_ca_file,
                                      require_client_cert=True)
        except TlsInputError as exc:
            which = {"cert": "cert_file", "key": "key_file", "ca": "client_ca_file",
                     "pair": "cert_file, key_file"}[exc.which]
            raise ConfigError(f"connect.tls.{which}: {exc}") from None
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"connect.tls: cannot load certificate or key: {exc}") from None

    async def _serve_uds(self, path: os.PathLike[str], *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        target = os.fspath(path)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(target).st_mode):
                raise OSError(f"{target} exists and is not a socket")
            os.unlink(target)  # ours from a previous run (the path is this server's)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o777)  # nobody may connect before the mode is set
        try:
            await sock.bind(target)
        finally:
            os.umask(old_umask)
        try:
            if config.uds_owner is not None or config.uds_group is not None:
                os.chown(target, -1 if config.uds_owner is None else config.uds_owner,
                         -1 if config.uds_group is None else config.uds_group)
            os.chmod(target, config.uds_mode)
            sock.listen(1024)
            self.addresses.append(f"unix:{target}")
            listener = trio.SocketListener(sock)

            async def handler(stream: trio.SocketStream) -> None:
                await self.serve_connection(UdsClientStream(stream), _uds_client(stream))

            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(
                    trio.serve_listeners, handler, [listener], handler_nursery=nursery))
                task_status.started()
        finally:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(target)

    async def _serve_tls(self, *, task_status: trio.TaskStatus[None]
                         = trio.TASK_STATUS_IGNORED) -> None:
        listen = self.config.listen
        assert listen is not None
        context = self._context
        assert context is not None

        async def handler(raw: trio.SocketStream) -> None:
            address = _peer(raw)
            tls_stream = trio.SSLStream(raw, context, server_side=True)
            try:
                with trio.fail_after(self.config.head_timeout):
                    await tls_stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError, OSError) as exc:
                self.handshake_failures.inc()
                self._refusal_log.warning("handshake", "CONNECT client refused: TLS "
                                          "handshake failed (a client certificate from "
                                          "connect.tls.client_ca_file is required)",
                                          reason="handshake", client=address,
                                          error=_tls_error(exc))
                await close_stream(raw, abort=True)
                return
            der = tls_stream.getpeercert(binary_form=True)
            from nodeagent.trust import pki  # client certificates: loaded with the first one

            if der is not None and (pki.node_name_from_certificate(der) is not None or
                                    pki.server_name_from_certificate(der) is not None):
                # A node's or a server's tunnel certificate (the CA given here is the
                # cluster's own): an agent must not reach other nodes' kubelets with it.
                await self.serve_connection(tls_stream, address, refusal=Refusal(
                    "nodeagent_identity", "a nodeagent node or server certificate may not "
                    "use the CONNECT front"))
                return
            cert = tls_stream.getpeercert()
            client = f"{address} {_subject(cert)}".strip()
            assert self.config.tls is not None
            await self.serve_connection(tls_stream, client, refusal=check_client(
                _names(cert, "commonName"), _names(cert, "organizationName"),
                self.config.tls))

        listeners = await trio.open_tcp_listeners(listen.port, host=listen.host)
        self.addresses.extend(f"tls:{socket_address(lst)}" for lst in listeners)
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(
                trio.serve_listeners, handler, listeners, handler_nursery=nursery))
            task_status.started()

    # ------------------------------------------------------------------ one client

    async def serve_connection(self, stream: trio.abc.Stream, client: str, *,
                               refusal: Refusal | None = None) -> None:
        """Read one request head, decide, and either refuse it (at once if `refusal` is
        given) or carry the stream. Never raises for anything the client or the node does;
        closes `stream`."""
        try:
            if refusal is not None:
                await self._refuse(stream, client, refusal)
                return
            await self._serve(stream, client)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the client went away
        finally:
            with trio.CancelScope(shield=True):
                await close_stream(stream)

    async def _serve(self, stream: trio.abc.Stream, client: str) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        request: h11.Request | None = None
        with trio.move_on_after(self.config.head_timeout):
            try:
                while request is None:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await stream.receive_some(65536)
                        if not data:
                            return  # closed before a request: nothing to answer
                        conn.receive_data(bytes(data))
                    elif isinstance(event, h11.Request):
                        request = event
                    else:
                        return
            except h11.RemoteProtocolError as exc:
                await self._refuse(stream, client, Refusal("malformed", f"bad request: {exc}"))
                return
        if request is None:
            await self._refuse(stream, client, Refusal(
                "head_timeout", f"no request head within {self.config.head_timeout:g}s"))
            return
        method = request.method.decode("ascii", "replace")
        wanted = parse_target(method, request.target.decode("ascii", "replace"))
        if isinstance(wanted, Refusal):
            await self._refuse(stream, client, wanted)
            return
        routes: RoutesConfig = self._routes()
        decision = decide(wanted, routes)
        if isinstance(decision, Refusal):
            await self._refuse(stream, client, decision, target=wanted)
            return
        if len(self.streams) >= self.config.max_streams:
            await self._refuse(stream, client, Refusal(
                "busy", f"{self.config.max_streams} streams open; retry later"), target=wanted)
            return
        try:
            upstream = await open_control_plane(self._open_stream, decision, client,
                                                self.dial_timeout)
        except StreamFailed as exc:
            await self._refuse(stream, client, failure_refusal(decision, exc), target=wanted)
            return
        if wanted.path is None:
            await self._tunnel(stream, conn, upstream, client, decision, wanted)
        else:
            await self._forward(stream, conn, request, upstream, client, decision, wanted)

    async def _tunnel(self, stream: trio.abc.Stream, conn: h11.Connection,
                      upstream: TunnelStream, client: str,
                      route: ConnectRoute, wanted: ProxyTarget) -> None:
        leftover = conn.trailing_data[0]  # bytes the client sent after its head
        try:
            await stream.send_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        except BaseException:
            with trio.CancelScope(shield=True):
                await close_stream(upstream, abort=True)
            raise
        self._count("established")
        await self._carry(stream, upstream, client, route, wanted, leftover)

    async def _forward(self, stream: trio.abc.Stream, conn: h11.Connection,
                       request: h11.Request, upstream: TunnelStream,
                       client: str, route: ConnectRoute, wanted: ProxyTarget) -> None:
        """An absolute-form request: sent on as origin-form with `Connection: close`; the
        response is carried back raw until the target closes (one request per
        connection, which is what a scraper needs)."""
        assert wanted.path is not None
        head = [b"%s %s HTTP/1.1\r\n" % (request.method, wanted.path.encode())]
        has_host = False
        for name, value in request.headers:
            if name in _HOP_BY_HOP:
                continue
            has_host = has_host or name == b"host"
            head.append(b"%s: %s\r\n" % (name, value))
        if not has_host:
            head.append(b"host: %s\r\n" % wanted.authority.encode())
        head.append(b"connection: close\r\n\r\n")
        body = b""
        # A body (rare for a proxy GET) is read whole first, bounded by the head size.
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    break
                conn.receive_data(bytes(data))
                continue
            if isinstance(event, h11.Data):
                body += bytes(event.data)
                if len(body) > _MAX_HEAD:
                    await close_stream(upstream, abort=True)
                    await self._refuse(stream, client, Refusal(
                        "malformed", f"a proxied request body is limited to {_MAX_HEAD} "
                        f"bytes"), target=wanted)
                    return
                continue
            break  # EndOfMessage (or anything else: the request is complete)
        try:
            await upstream.send_all(b"".join(head) + body)
        except BaseException:
            with trio.CancelScope(shield=True):
                await close_stream(upstream, abort=True)
            raise
        self._count("forwarded")
        await self._carry(stream, upstream, client, route, wanted, b"")

    async def _carry(self, stream: trio.abc.Stream, upstream: TunnelStream,
                     client: str, route: ConnectRoute, wanted: ProxyTarget,
                     leftover: bytes) -> None:
        with self.streams.track(client, route.node, wanted.authority, upstream,
                                sends_toward_target=True):
            started = time.monotonic()
            result = await splice(stream, upstream, a_leftover=leftover)
        self.bytes.labels("in").inc(result.a_to_b)
        self.bytes.labels("out").inc(result.b_to_a)
        self.log.info("CONNECT stream closed", client=client, node=route.node,
                      target=wanted.authority, bytes_in=result.a_to_b,
                      bytes_out=result.b_to_a, seconds=round(time.monotonic() - started, 1),
                      error=result.error or "")

    async def _refuse(self, stream: trio.abc.Stream, client: str, refusal: Refusal, *,
                      target: ProxyTarget | None = None) -> None:
        self._count(refusal.reason)
        # Keyed by the reason (a fixed set): a flood of odd requests is one line a minute.
        self._refusal_log.warning(refusal.reason, "CONNECT request refused",
                                  reason=refusal.reason, status=refusal.status, client=client,
                                  target=target.authority if target else "",
                                  problem=refusal.message)
        body = f"{refusal.status} {_PHRASES[refusal.status]}: {refusal.message}\n".encode()
        head = (f"HTTP/1.1 {refusal.status} {_PHRASES[refusal.status]}\r\n"
                f"content-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
                f"connection: close\r\n\r\n").encode()
        with trio.move_on_after(5):
            await stream.send_all(head + body)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.requests.labels(outcome).inc()

    def status(self) -> dict[str, Any]:
        return {"listeners": self.addresses, "by_outcome": dict(self.outcomes),
                "streams": self.streams.as_list()}


_PHRASES = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout",
            502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
assert set(REASONS.values()) <= set(_PHRASES)


async def open_control_plane(open_stream: StreamOpener, route: ConnectRoute, client: str,
                             dial_timeout: float) -> TunnelStream:
    """A control-plane stream to `route` (the CONNECT front's and the DNAT path's): marked
    purpose=control-plane for the agent's own check; TIMEOUT if the node does not answer
    within `dial_timeout`."""
    metadata = {"origin": client, PURPOSE_KEY: CONTROL_PLANE_PURPOSE}
    with trio.move_on_after(dial_timeout) as scope:
        return await open_stream(route.node, p.Target(route.dial_host, route.port), metadata)
    assert scope.cancelled_caught
    raise StreamFailed(p.StreamReason.TIMEOUT,
                       f"node {route.node} did not answer within {dial_timeout:g}s")


def failure_refusal(route: ConnectRoute, exc: StreamFailed) -> Refusal:
    target = f"{route.dial_host}:{route.port} on node {route.node}"
    if exc.reason is p.StreamReason.TIMEOUT:
        return Refusal("dial_timeout", f"{target}: {exc.message}")
    if exc.reason is p.StreamReason.FORBIDDEN:
        return Refusal("agent_forbidden", f"{target}: the node's agent refused: {exc.message}")
    if isinstance(exc, NodeNotConnected):
        return Refusal("node_not_connected", f"node {route.node} is not connected")
    return Refusal("dial_failed", f"{target}: {exc.message}")


class UdsClientStream(trio.abc.HalfCloseableStream):
    """A Unix-socket client, telling its full close from a half-close.

    Both read as end of file. A client that only shut down its sending side
    (`shutdown(SHUT_WR)`: exec's stdin closed) still reads, and its end of file is passed
    on as a half-close. A client that closed its socket (or shut down both sides) reads
    nothing more: passing that on as a half-close would leave a target that streams and
    never reads holding the stream open on both sides until its next write fails, which
    for a quiet `logs -f` is never. The kernel tells the two apart (POLLHUP: both
    directions shut), so that end of file is a broken stream instead, and splice resets
    the tunnel stream: the agent resets the target's connection.

    A wrapper, not the SocketStream itself, so splice carries these streams with a task
    each way rather than its task-free tunnel → socket path; the CONNECT front carries
    the control plane's streams, not the bulk data path."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.stream.receive_some(max_bytes)
        if not data and _peer_closed(self.stream.socket.fileno()):
            raise trio.BrokenResourceError("the client closed its connection (a full "
                                           "close, not a half-close)")
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


def _peer_closed(fd: int) -> bool:
    """Whether a Unix socket's peer is gone both ways (POLLHUP), not only half-closed."""
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, 0)  # POLLHUP and POLLERR are reported whatever was asked
    return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


def _uds_client(stream: trio.SocketStream) -> str:
    """`uds uid=N pid=N` from the peer's credentials (SO_PEERCRED)."""
    try:
        import struct
        creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                         struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
    except (OSError, AttributeError):
        return "uds"
    return f"uds uid={uid} pid={pid}"


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _subject(cert: Any) -> str:
    """`cn=NAME` of a verified client certificate, for the debug view and logs."""
    names = _names(cert, "commonName")
    return f"cn={names[0]}" if names else ""


def _names(cert: Any, attribute: str) -> list[str]:
    """The values of one subject attribute (commonName, organizationName) of a verified
    client certificate (ssl's getpeercert() dict)."""
    if not isinstance(cert, dict):
        return []
    return [value for rdn in cert.get("subject", ()) for key, value in rdn
            if key == attribute and isinstance(value, str)]


def _tls_error(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    text = str(cause or exc) or type(cause or exc).__name__
    return text[:200]
