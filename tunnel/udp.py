"""Flows (tunnel streams whose target is udp) joined to connected UDP sockets: the
agent's end of a public UDP mapping and of intercepted UDP, the server's end of an
agent's intercepted UDP sent from the cloud side. What splice.py is for bytes.

Nothing here buffers a datagram. One from the tunnel goes to the socket at once
(non-blocking send; a full socket buffer drops it, counted as `socket_full`); one from
the socket goes to the flow at once (`TunnelStream.send_datagram`, which queues within
the core's bounds or drops). `FlowPoller` serves every flow of a process with one task
(an epoll set of their sockets), so an idle flow costs its socket and a `SocketFlow`
record, no task, and a burst on one flow never delays another.

`expire_flows` is the idle timer of the flow tables that key flows by client address
(server/udpmappings.py, agent/intercept/udpproxy.py): one sweep per table, no timer
per flow.
"""

from __future__ import annotations

import errno
import select
import socket
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import trio
import trio.lowlevel

from tunnel.errors import StreamResetError
from tunnel.protocol import StreamReason
from tunnel.stream import StreamCarrier, TunnelStream
from tunnel.tcp import SO_MARK, DialCause, DialFailed

# Datagrams read from the socket per wake-up (wait_readable yields every time): a flood
# on one flow cannot starve the others' tasks.
RECV_BATCH = 64
RECV_SIZE = 65_535
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTDOWN}


# A flow's idle timeout at the end that did not open it, when the opener names none
# (metadata "idle"): the opener owns expiry, this only ends flows whose opener vanished
# without a reset; past the opener's own by a margin, so the opener's comes first.
DEFAULT_FLOW_IDLE = 120.0
FLOW_IDLE_MARGIN = 5.0


def flow_idle_timeout(metadata: dict[str, str]) -> float:
    """The idle timeout the opener named for a flow (seconds) plus a margin, bounded."""
    try:
        named = float(metadata.get("idle", ""))
    except ValueError:
        return DEFAULT_FLOW_IDLE
    if not 0 < named <= 3600:
        return DEFAULT_FLOW_IDLE
    return named + FLOW_IDLE_MARGIN


# Receive buffers: the default (~208 KiB, 150 full-size datagrams) overflows whenever the
# process is not scheduled for a few milliseconds at a few hundred Mbit/s, and a datagram
# the kernel drops there is lost without a trace. A shared socket (a mapping's, the
# TPROXY one) gets more than a flow's own. The kernel allocates buffers as datagrams
# queue, so an idle socket costs nothing for it.
SHARED_BUFFER = 8 * 1024 * 1024
FLOW_BUFFER = 1024 * 1024
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)


def size_buffers(sock: socket.socket, size: int) -> None:
    """Ask for `size`-byte receive and send buffers: past net.core.rmem_max with
    CAP_NET_ADMIN (the agent has it), else as much as the limit allows. Best effort."""
    for force, plain in ((_SO_RCVBUFFORCE, socket.SO_RCVBUF),
                         (_SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, size)
        except OSError:
            try:
                sock.setsockopt(socket.SOL_SOCKET, plain, size)
            except OSError:
                pass


# UDP generic segmentation offload (Linux 4.18+): the datagrams of one flow that one read
# of the tunnel delivered leave in one sendmsg() with a UDP_SEGMENT size, and the kernel
# (or the NIC) cuts them into datagrams after doing the routing, netfilter and device work
# once for all of them. Measured on loopback, 1,400-byte datagrams in batches of 46: 5.1
# µs of CPU per datagram sent and received one by one, 1.5 µs with GSO. A run is at most
# the kernel's UDP_MAX_SEGMENTS (64 since 4.18) datagrams of one size (the last may be
# shorter) and one UDP payload's bytes in all.
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)  # not in Python's socket module
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 65_507


def gso_runs(batch: list[bytes]) -> list[tuple[int, int]]:
    """Split `batch` into runs one GSO send can carry: (start, end) index pairs, each
    of datagrams of the first one's size but the last, which may be shorter, at most
    GSO_MAX_SEGMENTS of them and GSO_MAX_BYTES in all. Empty datagrams run alone."""
    runs = []
    count = len(batch)
    start = 0
    while start < count:
        size = len(batch[start])
        end = start + 1
        if size:
            total = size
            limit = min(count, start + GSO_MAX_SEGMENTS)
            while end < limit and len(batch[end]) == size and total + size <= GSO_MAX_BYTES:
                total += size
                end += 1
            if end < limit and 0 < len(batch[end]) < size \
                    and total + len(batch[end]) <= GSO_MAX_BYTES:
                end += 1
        runs.append((start, end))
        start = end
    return runs


@dataclass
class FlowCounters:
    """What one flow carried: "in" is toward the target, "out" back from it. Made when
    the flow ends (an open flow keeps plain ints in its record)."""

    datagrams_in: int = 0
    datagrams_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    drops: Counter[str] = field(default_factory=Counter)
    ended_by: str = ""  # reset | idle | refused | cancelled
    stream: TunnelStream | None = None  # the flow's stream (its id, target, metadata)


def connect_udp(host: str, port: int, *, mark: int | None = None) -> socket.socket:
    """A non-blocking UDP socket connected to host:port (an IP literal: the agent's
    targets are addresses; a name costs a blocking lookup, so it is refused here).
    `mark` sets SO_MARK so the agent's own rules never catch it. Raises DialFailed."""
    family = None
    for candidate in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(candidate, host)
        except OSError:
            continue
        family = candidate
        break
    if family is None:
        raise DialFailed("dns", f"UDP targets are addresses, not names: {host!r}")
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        if mark is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
            except OSError as exc:
                raise DialFailed("mark", f"cannot set SO_MARK {mark} (needs "
                                         f"CAP_NET_ADMIN): {exc.strerror}") from None
        size_buffers(sock, FLOW_BUFFER)
        sock.connect((host, port))
    except DialFailed:
        sock.close()
        raise
    except OSError as exc:
        sock.close()
        cause: DialCause = "unreachable" if exc.errno in _UNREACHABLE else "refused"
        raise DialFailed(cause, f"{host}:{port}: {exc.strerror or exc}") from None
    return sock


class SocketFlow:
    """One flow joined to its connected UDP socket: a tunnel.stream.DatagramSink for the
    datagrams from the tunnel, `readable()` for those from the socket. It holds no task
    and, on the hot path, asks for no clock: `active` says it carried something since
    the poller's last sweep, which moves the idle deadline then."""

    __slots__ = ("active", "bytes_in", "bytes_out", "datagrams_in", "datagrams_out",
                 "deadline", "drops", "gso", "held", "idle_timeout", "on_end", "poller",
                 "sock", "stream")

    def __init__(self, poller: FlowPoller, stream: TunnelStream, sock: socket.socket,
                 idle_timeout: float, on_end: Callable[[FlowCounters], None] | None) -> None:
        self.poller = poller
        self.stream = stream
        self.sock = sock
        self.idle_timeout = idle_timeout
        self.deadline = trio.current_time() + idle_timeout
        self.active = False
        self.on_end = on_end
        self.datagrams_in = self.datagrams_out = self.bytes_in = self.bytes_out = 0
        self.drops: Counter[str] | None = None  # made at the first drop
        # What one read of the tunnel delivered, sent when the reader ends that step.
        self.held: list[bytes] | None = None
        self.gso = True  # until the kernel or the device refuses it for this socket

    def drop(self, reason: str, count: int = 1) -> None:
        if self.drops is None:
            self.drops = Counter()
        self.drops[reason] += count

    def on_datagram(self, data: bytes) -> None:
        """From the tunnel: held until the reader's step ends (on_datagrams_end), so
        one read's datagrams of this flow leave together."""
        if self.held is None:
            self.held = [data]
        else:
            self.held.append(data)

    def on_datagrams_end(self) -> None:
        """To the socket now, or dropped (never buffered past the reader's step): with
        UDP GSO when several datagrams are held, else one send each."""
        batch = self.held
        if batch is None:
            return
        self.held = None
        if len(batch) == 1 or not self.gso:
            for data in batch:
                if not self.send(data):
                    return
            return
        level = socket.SOL_UDP
        for start, end in gso_runs(batch):
            if end - start == 1 or not self.gso:
                for data in batch[start:end]:
                    if not self.send(data):
                        return
                continue
            run = batch[start:end]
            size = len(run[0])
            try:
                self.sock.sendmsg(run, [(level, UDP_SEGMENT,
                                         size.to_bytes(2, sys.byteorder))])
            except BlockingIOError:
                self.drop("socket_full", end - start)
                continue
            except ConnectionRefusedError:
                self.drop("refused", end - start)
                self.poller.end(self, "refused")
                return
            except OSError:
                # The kernel (before 4.18), the device (no checksum offload) or the
                # path (a datagram past its MTU) refused the segments: one send each,
                # from now on, for this flow.
                self.gso = False
                for data in run:
                    if not self.send(data):
                        return
                continue
            self.datagrams_in += end - start
            self.bytes_in += sum(map(len, run))
            self.active = True

    def send(self, data: bytes) -> bool:
        """One datagram to the socket, or dropped; False once the flow has ended."""
        try:
            self.sock.send(data)
        except BlockingIOError:
            self.drop("socket_full")
            return True
        except ConnectionRefusedError:
            # An ICMP port unreachable from an earlier datagram: the target is not there.
            self.drop("refused")
            self.poller.end(self, "refused")
            return False
        except OSError:
            self.drop("send_error")
            return True
        self.datagrams_in += 1
        self.bytes_in += len(data)
        self.active = True
        return True

    def on_reset(self, error: StreamResetError) -> None:
        self.poller.end(self, "reset")

    def readable(self) -> None:
        """From the socket: up to RECV_BATCH datagrams into the flow (the rest wait for
        the next wake-up, so a flood on one flow cannot starve the others)."""
        recv = self.sock.recv
        send = self.stream.send_datagram
        carried = size = 0
        try:
            for _ in range(RECV_BATCH):
                try:
                    data = recv(RECV_SIZE)
                except BlockingIOError:
                    return
                except ConnectionRefusedError:
                    self.drop("refused")
                    self.poller.end(self, "refused")
                    return
                except OSError:
                    self.drop("recv_error")
                    return
                dropped = send(data, wake=False)  # the poller flushes after its wake-up
                if dropped is not None:
                    self.drop(dropped)
                    continue
                carried += 1
                size += len(data)
        finally:
            if carried:
                self.datagrams_out += carried
                self.bytes_out += size
                self.active = True
                self.poller.touched.add(self.stream.connection)

    def counters(self, ended_by: str) -> FlowCounters:
        return FlowCounters(self.datagrams_in, self.datagrams_out, self.bytes_in,
                            self.bytes_out, self.drops or Counter(), ended_by, self.stream)


class FlowPoller:
    """Many flows joined to their connected UDP sockets by one task: the sockets sit in
    one epoll set, and the task wakes when any is readable. An idle flow costs its
    socket and a small record, no task. A flow ends when the peer resets it, when it
    has been idle for its `idle_timeout` (RST CANCELLED), or when the target answers
    with ICMP port unreachable (RST REFUSED, so the other side learns the target
    refused); `on_end` gets its counters."""

    SWEEP = 1.0  # seconds between idle sweeps: expiry is exact to within this

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._flows: dict[int, SocketFlow] = {}
        # The tunnel connections that flows queued datagrams on in this wake-up: flushed
        # from this task after it (no wake-up of their writers on a DNS query's way).
        self.touched: set[StreamCarrier] = set()

    def __len__(self) -> int:
        return len(self._flows)

    def add(self, stream: TunnelStream, sock: socket.socket, *, idle_timeout: float,
            on_end: Callable[[FlowCounters], None] | None = None) -> None:
        """Take over an accepted flow and its connected, non-blocking socket."""
        flow = SocketFlow(self, stream, sock, idle_timeout, on_end)
        self._flows[sock.fileno()] = flow
        self._epoll.register(sock.fileno(), select.EPOLLIN)
        stream.attach_datagram_sink(flow)  # a reset that already came ends it at once

    def end(self, flow: SocketFlow, why: str) -> None:
        fd = flow.sock.fileno()
        if fd < 0 or self._flows.get(fd) is not flow:
            return  # already ended
        del self._flows[fd]
        self._epoll.unregister(fd)
        flow.sock.close()
        if flow.held:
            flow.drop("closed", len(flow.held))
            flow.held = None
        flow.stream.attach_datagram_sink(None)
        if why == "refused":
            flow.stream.abort_now(StreamReason.REFUSED,
                                  "the target refused (port unreachable)")
        elif why == "idle":
            flow.stream.abort_now(StreamReason.CANCELLED, "flow idle")
        else:
            flow.stream.abort_now(StreamReason.CANCELLED, "closed by the local side")
        if flow.on_end is not None:
            flow.on_end(flow.counters(why))

    def sweep(self, now: float) -> None:
        """Move the deadline of every flow active since the last sweep; end the idle."""
        idle = []
        for flow in self._flows.values():
            if flow.active:
                flow.active = False
                flow.deadline = now + flow.idle_timeout
            elif flow.deadline <= now:
                idle.append(flow)
        for flow in idle:
            self.end(flow, "idle")

    async def run(self) -> None:
        """Serve the flows until cancelled; then end every one."""
        flows = self._flows
        touched = self.touched
        try:
            next_sweep = trio.current_time() + self.SWEEP
            while True:
                with trio.move_on_at(next_sweep):
                    await trio.lowlevel.wait_readable(self._epoll.fileno())
                for fd, _ in self._epoll.poll(0, 256):
                    flow = flows.get(fd)
                    if flow is not None:
                        flow.readable()
                if touched:
                    for connection in touched:
                        connection.flush()
                    touched.clear()
                now = trio.current_time()
                if now >= next_sweep:
                    self.sweep(now)
                    next_sweep = now + self.SWEEP
        finally:
            for flow in list(flows.values()):
                self.end(flow, "cancelled")
            self._epoll.close()


class HeldFlow(Protocol):
    """A flow record of a table keyed by client address (what expire_flows reads)."""

    last_active: float
    failure: str | None  # why it failed (a drop reason), until retried
    failed_at: float
    stream: TunnelStream | None


_Flow = TypeVar("_Flow", bound=HeldFlow)


async def expire_flows(flows: Callable[[], Iterable[_Flow]], forget: Callable[[_Flow], None],
                       *, idle_timeout: float, failed_hold: float) -> None:
    """The idle timer of a flow table, one sweep for all its flows (no timer per flow):
    a flow with no datagram either way for `idle_timeout` is forgotten and its stream
    reset (CANCELLED, "flow idle"); a failed one is forgotten once held `failed_hold`
    seconds, so its client's next datagram tries again. Sweeps every quarter of the
    timeout (0.1 to 5 s) until cancelled."""
    interval = max(0.1, min(idle_timeout / 4, 5.0))
    while True:
        await trio.sleep(interval)
        now = trio.current_time()
        ended = [flow for flow in flows()
                 if now - flow.last_active >= idle_timeout
                 or (flow.failure is not None and now - flow.failed_at >= failed_hold)]
        for flow in ended:
            forget(flow)
            stream, flow.stream = flow.stream, None
            if stream is not None:
                stream.attach_datagram_sink(None)
                stream.abort_now(StreamReason.CANCELLED, "flow idle")
