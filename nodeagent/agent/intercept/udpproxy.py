"""The agent's transparent UDP proxy: the datagrams the TPROXY rules catch, each
(client, original destination) pair a flow through the tunnel (or direct).

The TPROXY'd datagram keeps its destination; the socket learns it per datagram from
IP_RECVORIGDSTADDR (ancillary data, `netfilter.sockets.recv_with_original_dst`).
Replies must come from that destination, or the pod's connected socket drops them, so
they leave through a transparent socket bound to it (IP_TRANSPARENT; one per original
destination, shared by its flows). Through the tunnel a flow costs no task here: the
tunnel's reader hands each reply to `InterceptedFlow.on_datagram`, which sends it at once
or drops it. A direct flow has a marked, connected socket and a task reading it.

DNS by zone (a rule with `dns_zones`): the flow has two upstreams, a direct socket to
where the pod sent it and a tunnel flow to the cloud-side resolver; each query goes to
one of them by the name it asks (`dnszones.in_zones`), and both answers leave from the
original destination.

Bounds: at most `MAX_FLOWS` flows; a flow's datagrams wait in a small queue while it
opens; idle flows end after `IDLE_TIMEOUT`; a failed flow drops for `FAILED_HOLD` and
then its next datagram tries again. Drops are counted by reason.
"""

from __future__ import annotations

import functools
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.lowlevel

from netfilter.model import NetfilterError
from netfilter.sockets import (
    Address,
    enable_recv_original_dst,
    recv_with_original_dst,
    set_mark,
    set_transparent,
    transparent_udp_reply_socket,
)
from nodeagent.agent.intercept.dnszones import in_zones
from nodeagent.agent.intercept.rules import ActiveRule
from nodeagent.ops.logs import StructuredLogger
from tunnel import protocol as p
from tunnel.errors import StreamFailed, StreamResetError
from tunnel.log import RateLimitedLog
from tunnel.stream import TunnelStream
from tunnel.tcp import format_address
from tunnel.udp import SHARED_BUFFER, connect_udp, expire_flows, size_buffers

OpenFlow = Callable[[p.Target, dict[str, str]], Awaitable[TunnelStream]]
RuleFor = Callable[[str, int], "ActiveRule | None"]

IDLE_TIMEOUT = 60.0  # DNS and most request/response UDP are done long before
MAX_FLOWS = 10_000
PENDING_DATAGRAMS = 16
FAILED_HOLD = 1.0
RECV_BATCH = 64
FlowKey = tuple[tuple[str, int], tuple[str, int]]  # (client, original destination)


@dataclass(eq=False)
class InterceptedFlow:
    """One pod address's datagrams to one original destination (a DatagramSink)."""

    proxy: UdpInterceptor
    key: FlowKey
    client: tuple[Any, ...]
    destination: Address
    rule: str
    via: str
    last_active: float
    dns_zones: tuple[str, ...] = ()  # DNS by zone: these go to dns_resolver (the tunnel)
    dns_resolver: tuple[str, int] | None = None
    reply: socket.socket | None = None
    stream: TunnelStream | None = None
    direct: socket.socket | None = None
    pending: list[bytes] | None = field(default_factory=list)
    failure: str | None = None
    failed_at: float = 0.0
    closed: bool = False
    datagrams_in: int = 0
    datagrams_out: int = 0

    def on_datagram(self, data: bytes) -> None:
        """A reply: to the pod, from the address it sent to."""
        if self.reply is None:
            return
        try:
            self.reply.sendto(data, self.client)
        except BlockingIOError:
            self.proxy.drop("socket_full")
            return
        except OSError:
            self.proxy.drop("send_error")
            return
        self.datagrams_out += 1
        self.last_active = trio.current_time()
        self.proxy.carried("out", len(data))

    def on_datagrams_end(self) -> None:
        pass  # each reply left at once

    def on_reset(self, error: StreamResetError) -> None:
        if self.closed:
            return
        self.stream = None
        self.failure = error.reason.name.lower()
        self.failed_at = trio.current_time()


class UdpInterceptor:
    """Serves the UDP proxy port for the rules in force (`rule_for`)."""

    def __init__(self, port: int, *, open_flow: OpenFlow, rule_for: RuleFor,
                 skip_mark: int, log: StructuredLogger,
                 on_drop: Callable[[str, int], None] | None = None,
                 on_carried: Callable[[str, int], None] | None = None) -> None:
        self.port = port
        self._open_flow = open_flow
        self._rule_for = rule_for
        self.skip_mark = skip_mark
        self.log = log
        self._refusal_log = RateLimitedLog(log, period=60.0)
        self._on_drop = on_drop
        self._on_carried = on_carried
        self.flows: dict[FlowKey, InterceptedFlow] = {}
        self.outcomes: Counter[str] = Counter()
        self.drops: Counter[str] = Counter()
        # Transparent reply sockets by original destination, with how many flows use each.
        self._replies: dict[Address, tuple[socket.socket, int]] = {}
        self._sockets: list[socket.socket] = []

    def drop(self, reason: str, count: int = 1) -> None:
        self.drops[reason] += count
        if self._on_drop is not None:
            self._on_drop(reason, count)

    def carried(self, direction: str, size: int) -> None:
        if self._on_carried is not None:
            self._on_carried(direction, size)

    def open_sockets(self) -> None:
        """Bind the TPROXY sockets (IPv4, and IPv6 where the host has it); raises OSError."""
        for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            sock = socket.socket(family, socket.SOCK_DGRAM)
            try:
                sock.setblocking(False)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                set_transparent(sock, family)
                enable_recv_original_dst(sock)
                size_buffers(sock, SHARED_BUFFER)
                sock.bind((host, self.port))
            except OSError as exc:
                sock.close()
                if family == socket.AF_INET6:
                    self.log.warning("no IPv6 UDP proxy socket", error=str(exc))
                    continue
                raise
            self._sockets.append(sock)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                  ) -> None:
        if not self._sockets:
            self.open_sockets()
        try:
            async with trio.open_nursery() as nursery:
                for sock in self._sockets:
                    nursery.start_soon(self._read, sock, nursery)
                nursery.start_soon(functools.partial(
                    expire_flows, self.flows.values, self._forget,
                    idle_timeout=IDLE_TIMEOUT, failed_hold=FAILED_HOLD))
                task_status.started()
        finally:
            for flow in list(self.flows.values()):
                self._forget(flow)
            with trio.CancelScope(shield=True):
                for flow in list(self.flows.values()):
                    if flow.stream is not None:
                        await flow.stream.aclose()
            for sock in self._sockets:
                sock.close()
            self._sockets = []

    async def _read(self, sock: socket.socket, nursery: trio.Nursery) -> None:
        while True:
            await trio.lowlevel.wait_readable(sock)
            for _ in range(RECV_BATCH):
                try:
                    data, source, destination = recv_with_original_dst(sock)
                except BlockingIOError:
                    break
                except (OSError, NetfilterError):
                    continue  # an ICMP error, or an address family we do not know
                self._from_pod(sock, data, source, destination, nursery)

    def _from_pod(self, sock: socket.socket, data: bytes, source: Address,
                  destination: Address, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        host = destination[0].removeprefix("::ffff:")
        client = (source[0], source[1])
        key: FlowKey = ((source[0], source[1]), (host, destination[1]))
        flow = self.flows.get(key)
        if flow is not None and flow.failure is not None and now - flow.failed_at >= FAILED_HOLD:
            self._forget(flow)
            flow = None
        if flow is None:
            if len(self.flows) >= MAX_FLOWS:
                self.drop("flow_limit")
                return
            rule = self._rule_for(host, destination[1])
            flow = InterceptedFlow(self, key, client, destination,
                                   rule=rule.name if rule else "", via=rule.via if rule
                                   else "tunnel", last_active=now,
                                   dns_zones=rule.dns_zones if rule else (),
                                   dns_resolver=rule.dns_resolver if rule else None)
            try:
                flow.reply = self._reply_socket(destination)
            except OSError as exc:
                self.drop("reply_socket")
                self._refusal_log.warning("reply_socket", "cannot bind a reply socket to "
                                          "the original destination", error=str(exc),
                                          destination=format_address(destination[:2]))
                return
            self.flows[key] = flow
            if flow.dns_zones:
                # DNS by zone: the direct upstream (where the pod asked) at once, so the
                # queries outside the zones never wait for the tunnel.
                try:
                    flow.direct = connect_udp(host, destination[1], mark=self.skip_mark)
                except StreamFailed as exc:
                    self.drop(exc.outcome)
                else:
                    nursery.start_soon(self._read_direct, flow, flow.direct)
            nursery.start_soon(self._open, flow)
        flow.last_active = now
        if flow.dns_zones and not in_zones(data, flow.dns_zones):
            self._send_direct(flow, data)  # not a zone of ours: where the pod sent it
            return
        if flow.failure is not None:
            self.drop(flow.failure)
            return
        if flow.pending is not None:
            if len(flow.pending) >= PENDING_DATAGRAMS:
                self.drop("queue_full")
                return
            flow.pending.append(data)
            return
        self._send(flow, data)

    def _send(self, flow: InterceptedFlow, data: bytes) -> None:
        if flow.stream is not None:
            dropped = flow.stream.send_datagram(data)
            if dropped is not None:
                self.drop(dropped)
                return
        elif flow.direct is not None and not flow.dns_zones:
            self._send_direct(flow, data)
            return
        else:
            self.drop("closed")
            return
        flow.datagrams_in += 1
        self.carried("in", len(data))

    def _send_direct(self, flow: InterceptedFlow, data: bytes) -> None:
        if flow.direct is None:
            self.drop("closed")
            return
        try:
            flow.direct.send(data)
        except BlockingIOError:
            self.drop("socket_full")
            return
        except OSError:
            self.drop("send_error")
            return
        flow.datagrams_in += 1
        self.carried("in", len(data))

    def _reply_socket(self, destination: Address) -> socket.socket:
        held = self._replies.get(destination)
        if held is not None:
            self._replies[destination] = (held[0], held[1] + 1)
            return held[0]
        sock = transparent_udp_reply_socket(destination)
        sock.setblocking(False)
        set_mark(sock, self.skip_mark)  # our own rules never catch the replies
        self._replies[destination] = (sock, 1)
        return sock

    def _release_reply(self, destination: Address) -> None:
        held = self._replies.get(destination)
        if held is None:
            return
        if held[1] <= 1:
            del self._replies[destination]
            held[0].close()
        else:
            self._replies[destination] = (held[0], held[1] - 1)

    async def _open(self, flow: InterceptedFlow) -> None:
        host, port = flow.key[1]
        target = p.Target(host, port, "udp")
        origin = format_address(flow.key[0])
        if flow.dns_resolver is not None:
            target = p.Target(*flow.dns_resolver, "udp")  # the zones' resolver
        try:
            if flow.via == "direct":
                flow.direct = connect_udp(host, port, mark=self.skip_mark)
            else:
                meta = {"origin": origin, "intercepted": flow.rule,
                        "idle": f"{IDLE_TIMEOUT:g}"}
                stream = await self._open_flow(target, meta)
                if flow.closed:
                    await stream.aclose()
                    return
                flow.stream = stream
                stream.attach_datagram_sink(flow)
        except StreamFailed as exc:
            self.outcomes[exc.outcome] += 1
            if not flow.closed:
                flow.failure = exc.outcome
                flow.failed_at = trio.current_time()
                self.drop(exc.outcome, len(flow.pending or ()))
                flow.pending = None
            self._refusal_log.warning(
                f"{flow.rule or '-'}:udp:{exc.outcome}", "intercepted UDP flow refused",
                target=str(target), origin=origin, reason=exc.outcome, error=exc.message)
            return
        self.outcomes["dns_zone" if flow.dns_zones else flow.via] += 1
        pending, flow.pending = flow.pending or [], None
        for data in pending:
            self._send(flow, data)
        if flow.direct is not None and not flow.dns_zones:
            await self._read_direct(flow, flow.direct)

    async def _read_direct(self, flow: InterceptedFlow, sock: socket.socket) -> None:
        try:
            while not flow.closed:
                await trio.lowlevel.wait_readable(sock)
                for _ in range(RECV_BATCH):
                    try:
                        data = sock.recv(65_535)
                    except BlockingIOError:
                        break
                    except OSError:
                        self.drop("recv_error")
                        break
                    flow.on_datagram(data)
        except trio.ClosedResourceError:
            pass  # the flow expired (_forget closed it under us)
        finally:
            sock.close()
            flow.direct = None

    def _forget(self, flow: InterceptedFlow) -> None:
        if flow.closed:
            return
        flow.closed = True
        del self.flows[flow.key]
        if flow.direct is not None:
            trio.lowlevel.notify_closing(flow.direct)  # its reader ends and closes it
        self._release_reply(flow.destination)
        flow.reply = None

    def view(self) -> list[dict[str, Any]]:
        now = trio.current_time()
        return [{"client": format_address(f.key[0]),
                 "destination": format_address(f.key[1]), "rule": f.rule, "via": f.via,
                 "state": "failed" if f.failure else "open" if (f.stream or f.direct)
                 else "opening", "datagrams_in": f.datagrams_in,
                 "datagrams_out": f.datagrams_out,
                 "idle_seconds": round(now - f.last_active, 1)} for f in self.flows.values()]
