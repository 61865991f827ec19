"""The agent's transparent proxy: keeps the kernel's interception rules in step with
config, and serves the connections they catch, carrying each one where config says
(through the tunnel, or direct).

Like sshuttle or redsocks, but per node and driven by config. The rules come from the
`netfilter` package (one owned table, atomic transactions) through `config.intercept_model`;
this module reconciles them at start, re-applies them atomically on change, removes them
on clean shutdown, and serves the connections they redirect to the proxy port.

The netfilter backends block (they run `nft -f -` / `iptables-restore` and talk netlink
through pyroute2's synchronous sockets), so they run in trio worker threads; everything
else is trio.
"""

from __future__ import annotations

import errno
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from netfilter.model import (
    InterceptModel,
    NetfilterError,
)
from netfilter.sockets import intercepted_destination, set_transparent
from nodeagent.agent.intercept.rules import (
    ActiveRule,
    Backend,
    active_rule,
    choose_backend,
    remove_other_backend_leftovers,
)
from nodeagent.agent.intercept.udpproxy import OpenFlow, UdpInterceptor
from nodeagent.config import InterceptConfig, intercept_model
from nodeagent.ops.logs import StructuredLogger, get_logger
from nodeagent.ops.streamviews import StreamNotes, opener_from_metadata
from tunnel import protocol as p
from tunnel.endpoint import TunnelConnection
from tunnel.errors import StreamFailed, TunnelClosedError
from tunnel.log import RateLimitedLog
from tunnel.relay import relay_connection
from tunnel.splice import SpliceResult, close_stream
from tunnel.spliceloop import SpliceEnd, SpliceOwner, open_in_loop, reset_socket
from tunnel.stream import StreamCarrier
from tunnel.tcp import connect_tcp

log = get_logger("nodeagent.intercept")

# Connections accepted per listener wake-up at most, before the others get a turn.
ACCEPT_BATCH = 64
# accept() failing for want of descriptors or memory: wait this long before trying again.
ACCEPT_RETRY = 0.1
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}

OpenTunnel = Callable[[p.Target, dict[str, str]], Awaitable[trio.abc.HalfCloseableStream]]
# The tunnel connection a new stream goes through now (TunnelClient.connection_for_open).
TunnelNow = Callable[[], TunnelConnection | None]


class Interceptor:
    """Owns the node's interception: rules in the kernel, listeners, connections."""

    def __init__(self, config: InterceptConfig, *, skip_mark: int, open_tunnel: OpenTunnel,
                 open_flow: OpenFlow | None = None,
                 dial_timeout: float = 5.0, node: str = "",
                 backend: Backend | None = None, netns: str | None = None,
                 logger: StructuredLogger | None = None,
                 on_datagram_drop: Callable[[str, int], None] | None = None,
                 on_datagram: Callable[[str, int], None] | None = None,
                 tunnel_now: TunnelNow | None = None, notes: StreamNotes | None = None,
                 observe_setup: Callable[[float], None] | None = None) -> None:
        """`tunnel_now`: intercepted connections through the tunnel are opened from the
        accept loop, with no task each (`open_in_loop`), through the connection it
        gives; then `notes` and `observe_setup` note each stream and time its OPEN, as
        the `open_tunnel` the task path uses does. Without it, a task per connection."""
        self.config = config
        self._tunnel_now = tunnel_now
        self._notes = notes
        self._observe_setup = observe_setup
        self.skip_mark = skip_mark
        self._open_tunnel = open_tunnel
        self._dial_timeout = dial_timeout
        self.backend_reason = "given by the caller"
        if backend is None:
            backend, self.backend_reason = choose_backend(config.backend, netns)
        self.backend = backend
        self._netns = netns
        self.log = logger or log.bind(node=node)
        self._refusal_log = RateLimitedLog(self.log, period=60.0)
        self.outcomes: Counter[str] = Counter()
        self.model: InterceptModel | None = None
        self._rules: tuple[ActiveRule, ...] = ()
        self._routing: Any = None
        self._lock = trio.Lock()
        # An agent restarting in place (DaemonSet rollout) leaves its rules to the next
        # one, which replaces them atomically at start: meanwhile intercepted connections
        # are refused (REDIRECT) or wait in SYN retransmission (TPROXY) instead of
        # silently leaving the node without the tunnel.
        self.keep_rules_on_exit = False
        self.active_connections = 0
        self._idle = trio.Event()
        # Intercepted connections through the tunnel are carried by its splice loop, not
        # by tasks in `connections`: ending interception ends them all the same.
        self._spliced = SpliceOwner()
        self._accept_scope: trio.CancelScope | None = None
        self._listeners_open: list[socket.socket] = []
        # Pods' UDP (tproxy udp rules), on the same port number as TCP.
        self.udp: UdpInterceptor | None = None
        if open_flow is not None:
            self.udp = UdpInterceptor(
                config.proxy_port, open_flow=open_flow,
                rule_for=lambda host, port: self._rule_for(host, port, "udp"),
                skip_mark=skip_mark, log=self.log, on_drop=on_datagram_drop,
                on_carried=on_datagram)

    # ------------------------------------------------------------------ rules

    async def apply(self, config: InterceptConfig) -> None:
        """Validate and apply atomically. On any error the previous rules stay in the
        kernel and in force, and the error (naming the rule) is raised."""
        async with self._lock:
            from netfilter.routing import list_interfaces
            interfaces = await trio.to_thread.run_sync(list_interfaces, self._netns)
            model = intercept_model(config, skip_mark=self.skip_mark, interfaces=interfaces)
            if config.proxy_port != self.config.proxy_port and self.model is not None:
                raise NetfilterError("intercept.proxy_port cannot change while running; "
                                     "restart the agent")
            changed = await trio.to_thread.run_sync(self.backend.apply, model)
            await trio.to_thread.run_sync(self._ensure_routing, model)
            self.config, self.model = config, model
            self._rules = tuple(active_rule(rule_cfg, rule)
                                for rule_cfg, rule in zip(config.rules, model.rules, strict=True))
            self.log.info("intercept rules applied" if changed else "intercept rules unchanged",
                          rules=len(model.rules), mode=model.mode.value)

    def _ensure_routing(self, model: InterceptModel) -> None:
        from netfilter.routing import PolicyRouting
        if model.needs_policy_routing:
            if self._routing is None:
                self._routing = PolicyRouting(mark=model.tproxy_mark, table=model.route_table,
                                              netns=self._netns)
            self._routing.ensure()
        elif self._routing is not None:
            self._routing.remove()
            self._routing = None

    async def remove(self) -> None:
        async with self._lock:
            await trio.to_thread.run_sync(self.backend.remove)
            if self._routing is not None:
                await trio.to_thread.run_sync(self._routing.remove)
                self._routing = None
            self.model = None
            self.log.info("intercept rules removed")

    def rules_view(self) -> dict[str, Any]:
        """For `nodeagent debug rules`: the model and what the kernel has right now."""
        from netfilter.iptables import IptablesBackend, render_iptables
        from netfilter.nftables import render_nftables
        rendered = ""
        if self.model is not None:
            if isinstance(self.backend, IptablesBackend):
                rendered = "\n".join(render_iptables(self.model).values())
            else:
                rendered = render_nftables(self.model)
        return {
            "backend": type(self.backend).__name__,
            "backend_reason": self.backend_reason,
            "mode": self.config.mode,
            "rules": [r.model_dump(mode="json") for r in self.config.rules],
            "rendered_from_model": rendered,
            "applied_in_kernel": self.backend.list_applied(),
        }

    # ------------------------------------------------------------------ proxy

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on the proxy port, reconcile the kernel with the config (a table left
        by a crashed or restarted agent is replaced), serve until cancelled, then remove
        the rules (unless `keep_rules_on_exit`)."""
        listeners = self._listeners()
        self._listeners_open = listeners
        if self.udp is not None:
            try:
                self.udp.open_sockets()
            except BaseException:
                for listener in listeners:
                    listener.close()
                raise
        try:
            from netfilter.routing import list_interfaces
            interfaces = await trio.to_thread.run_sync(list_interfaces, self._netns)
            model = intercept_model(self.config, skip_mark=self.skip_mark, interfaces=interfaces)
            # Netfilter calls block (nft/iptables-restore subprocesses, netlink through
            # pyroute2): run them on a worker thread so the tunnel keeps serving.
            await trio.to_thread.run_sync(self.backend.reconcile, model)
            if await trio.to_thread.run_sync(remove_other_backend_leftovers, self.backend,
                                             self._netns):
                self.log.info("removed rules a previous run left in the other backend")
            await trio.to_thread.run_sync(self._ensure_routing, model)
            self.model = model
            self._rules = tuple(active_rule(c, r) for c, r in zip(self.config.rules, model.rules,
                                                               strict=True))
            self.log.info("intercepting", rules=len(model.rules), mode=model.mode.value,
                          proxy_port=self.config.proxy_port,
                          backend=type(self.backend).__name__, why=self.backend_reason)
            async with trio.open_nursery() as connections:
                await connections.start(self._accept, listeners, connections)
                if self.udp is not None:
                    await connections.start(self.udp.run)
                task_status.started()
        finally:
            self._spliced.abort_all("interception stopped")
            with trio.CancelScope(shield=True):
                await self._close_listeners()
                if self.keep_rules_on_exit:
                    self.log.info("leaving intercept rules in place for the next agent",
                                  rules=len(self._rules))
                else:
                    try:
                        await self.remove()
                    except (NetfilterError, OSError) as exc:
                        self.log.error("could not remove intercept rules", error=str(exc))

    async def _accept(self, listeners: list[socket.socket], connections: trio.Nursery,
                      *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                      ) -> None:
        # Accepting has its own cancel scope so that stop_accepting() ends it while the
        # connections already accepted (in `connections`) carry on.
        with trio.CancelScope() as self._accept_scope:
            async with trio.open_nursery() as accepting:
                for listener in listeners:
                    accepting.start_soon(self._accept_from, listener, connections)
                task_status.started()

    async def _accept_from(self, listener: socket.socket, connections: trio.Nursery) -> None:
        """Accept what waits on `listener` at each wake-up, up to ACCEPT_BATCH, each
        connection's task started directly. Not trio.serve_listeners: its accept() yields
        once per connection even when more wait, and its handler wrapper closes each
        stream in a cancel scope of its own after the handler, though a relayed one has
        left for the splice loop by then (a few % of the agent's work per connection)."""
        while True:
            await trio.lowlevel.wait_readable(listener)
            carriers: list[StreamCarrier] = []
            for _ in range(ACCEPT_BATCH):
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                        # Out of descriptors or memory: the waiting connections stay in
                        # the backlog until some close (as trio.serve_listeners does).
                        self._refusal_log.warning(
                            "accept", "cannot accept intercepted connections",
                            error=str(exc))
                        await trio.sleep(ACCEPT_RETRY)
                    break  # ECONNABORTED and the like: that one is gone
                try:
                    carrier = self._take(conn, connections)
                except Exception as exc:
                    # A bug here must cost one connection, never the listener.
                    self.log.error("intercepted connection failed", error=repr(exc),
                                   exc_info=True)
                    reset_socket(conn)
                    continue
                if carrier is not None and carrier not in carriers:
                    carriers.append(carrier)
            else:
                await trio.lowlevel.checkpoint()  # more may wait: let the others run
            # The batch's OPENs in one write; no more accepting while the tunnel has
            # more output queued than its high-water mark (backpressure).
            for carrier in carriers:
                try:
                    await carrier.send_queued(now=True)
                except TunnelClosedError:
                    pass  # its opens are failed by the connection's end

    def _take(self, conn: socket.socket, connections: trio.Nursery) -> StreamCarrier | None:
        """One accepted connection: through the tunnel, its OPEN queued here and the
        rest left to the tunnel connection's splice loop (the connection whose output
        the caller sends); a direct rule, or no tunnel up, leaves it to a task."""
        tunnel = self._tunnel_now() if self._tunnel_now is not None else None
        if tunnel is None:
            connections.start_soon(self._handle_socket, conn)
            return None
        try:
            host, port, _ = intercepted_destination(conn, self.config.proxy_port)
            peer = conn.getpeername()
        except OSError as exc:
            self.log.warning("intercepted connection without a destination", error=str(exc))
            reset_socket(conn)
            return None
        host = host.removeprefix("::ffff:")
        rule = self._rule_for(host, port)
        if rule is not None and rule.via == "direct":
            connections.start_soon(self._handle_socket, conn)
            return None
        conn.setblocking(False)
        self.active_connections += 1
        target = p.Target(host, port)
        origin = f"{peer[0]}:{peer[1]}"
        metadata = {"origin": origin, "intercepted": rule.name if rule else ""}
        return self._open_now(tunnel, conn, target, metadata, rule, time.monotonic())

    def _open_now(self, tunnel: TunnelConnection, conn: socket.socket, target: p.Target,
                  metadata: dict[str, str], rule: ActiveRule | None,
                  started: float) -> StreamCarrier | None:
        def accepted() -> None:
            self.outcomes["tunnel"] += 1
            if self._observe_setup is not None:
                self._observe_setup(time.monotonic() - started)

        def refused(failure: StreamFailed) -> None:
            self._refused(failure, target, metadata["origin"], rule)
            self._connection_done()

        def ended(end: SpliceEnd) -> None:
            self._connection_done()

        def lost(sock: socket.socket) -> bool:
            # The tunnel ended under the open (the agent reconnected): once more through
            # the connection up now, as TunnelClient.open_stream tries the next one.
            newer = self._tunnel_now() if self._tunnel_now is not None else None
            if newer is None or newer is tunnel:
                return False
            carrier = self._open_now(newer, sock, target, metadata, rule, started)
            if carrier is not None:
                carrier.flush()
            return True

        stream = open_in_loop(tunnel, target, metadata, conn,
                              timeout=tunnel.settings.open_timeout, on_accepted=accepted,
                              on_refused=refused, on_end=ended, owner=self._spliced,
                              on_lost=lost)
        if stream is None:
            return None
        if self._notes is not None:
            self._notes.note(stream, opener_from_metadata(metadata), started)
        return stream.connection

    def _connection_done(self) -> None:
        self.active_connections -= 1
        if not self.active_connections:
            self._idle.set()

    def _refused(self, failure: StreamFailed, target: p.Target, origin: str,
                 rule: ActiveRule | None) -> None:
        outcome = failure.outcome
        self.outcomes[outcome] += 1
        # Keyed by rule and reason (bounded by config), not by what pods dial.
        self._refusal_log.warning(
            f"{rule.name if rule else '-'}:{outcome}",
            "intercepted connection refused; client reset",
            target=str(target), origin=origin, reason=outcome, error=failure.message)

    async def stop_accepting(self) -> None:
        """Close the proxy listeners; connections already accepted carry on. New
        intercepted connections are then refused by the kernel (nobody listens), or
        taken by another agent listening on the port."""
        if self._accept_scope is not None:
            self._accept_scope.cancel()
        await self._close_listeners()

    async def _close_listeners(self) -> None:
        listeners, self._listeners_open = self._listeners_open, []
        for listener in listeners:
            trio.lowlevel.notify_closing(listener)  # a task waiting on it wakes
            listener.close()
        await trio.lowlevel.checkpoint()

    def _listeners(self) -> list[socket.socket]:
        # IP_TRANSPARENT always: even in REDIRECT mode, connections kube-proxy already
        # DNAT'ed arrive by TPROXY (netfilter/nftables.py explains why).
        listeners = []
        for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            set_transparent(sock, family)
            try:
                sock.bind((host, self.config.proxy_port))
            except OSError as exc:
                sock.close()
                if family == socket.AF_INET6:
                    self.log.warning("no IPv6 proxy listener", error=str(exc))
                    continue
                raise
            # Accepted connections inherit it (Linux): the splice loop's writes toward
            # the pod are not held back by Nagle, as trio.SocketStream's were not.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.listen(4096)
            sock.setblocking(False)
            listeners.append(sock)
        return listeners

    def _rule_for(self, host: str, port: int, protocol: str = "tcp") -> ActiveRule | None:
        for rule in self._rules:
            if rule.protocol == protocol and rule.matches(host, port):
                return rule
        return None

    async def _handle_socket(self, conn: socket.socket) -> None:
        try:
            client = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
        except BaseException:
            conn.close()
            raise
        try:
            await self._handle(client)
        finally:
            # Closed here unless it was handed to the splice loop (which detached the
            # socket from trio's wrapper: then this does nothing).
            client.socket.close()

    async def _handle(self, client: trio.SocketStream) -> None:
        self.active_connections += 1
        counted = True

        def finished(result: SpliceResult | None = None) -> None:
            # Once per connection: at the splice's end, which may come after this task
            # has ended (handed to the tunnel's splice loop), or when it failed here.
            nonlocal counted
            if counted:
                counted = False
                self.active_connections -= 1
                if not self.active_connections:
                    self._idle.set()

        spliced = False  # then `finished` is called by the splice's end
        try:
            spliced = await self._proxy(client, finished)
        except Exception as exc:
            # A bug here must cost one connection, never the agent (serve_listeners would
            # let the exception end every listener).
            self.log.error("intercepted connection failed", error=repr(exc), exc_info=True)
            await close_stream(client, abort=True)
        finally:
            if not spliced:
                finished()

    async def wait_idle(self) -> None:
        """Until no intercepted connection is open (a draining agent)."""
        while self.active_connections:
            self._idle = trio.Event()
            await self._idle.wait()

    async def _proxy(self, client: trio.SocketStream,
                     finished: Callable[[SpliceResult], None]) -> bool:
        """Relay one intercepted connection; True if it was spliced (`finished` is then
        called at its end), False if it was refused."""
        try:
            host, port, _ = intercepted_destination(client.socket, self.config.proxy_port)
            peer = client.socket.getpeername()
        except OSError as exc:
            self.log.warning("intercepted connection without a destination", error=str(exc))
            await close_stream(client, abort=True)
            return False
        host = host.removeprefix("::ffff:")
        origin = f"{peer[0]}:{peer[1]}"
        rule = self._rule_for(host, port)
        via = rule.via if rule is not None else "tunnel"
        target = p.Target(host, port)

        async def open_original_destination() -> trio.abc.HalfCloseableStream:
            if via == "direct":
                return await connect_tcp(host, port, connect_timeout=self._dial_timeout,
                                         mark=self.skip_mark)
            meta = {"origin": origin, "intercepted": rule.name if rule else ""}
            return await self._open_tunnel(target, meta)

        def accepted() -> None:
            self.outcomes[via] += 1

        relayed = await relay_connection(client, open_original_destination,
                                         on_accepted=accepted, on_finished=finished,
                                         owner=self._spliced)
        if relayed.failure is None:
            return True
        self._refused(relayed.failure, target, origin, rule)
        return False
