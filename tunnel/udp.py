"""A flow (a tunnel stream whose target is udp) joined to a connected UDP socket: the
agent's end of a public UDP mapping and of intercepted UDP, as splice.py is for bytes.

Nothing here buffers a datagram. One from the tunnel goes to the socket at once
(non-blocking send; a full socket buffer drops it, counted as `socket_full`); one from
the socket goes to the flow at once (`TunnelStream.send_datagram`, which queues within
the core's bounds or drops). So a flow costs one task waiting for its socket, and a
burst on one flow never delays another. The flow ends when the peer resets it, when it
has been idle for `idle_timeout`, or when the target answers with ICMP port unreachable
(reset REFUSED, so the other side learns the target refused).

`bridge_flow` serves one flow with a task of its own; `FlowPoller` serves many with one
task (an epoll set of their sockets), for the agent, where idle flows add up.
"""

from __future__ import annotations

import errno
import select
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
import trio.lowlevel

from tunnel.errors import StreamResetError
from tunnel.protocol import StreamReason
from tunnel.stream import TunnelStream
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


@dataclass
class FlowCounters:
    """What one flow carried: "in" is toward the target, "out" back from it."""

    datagrams_in: int = 0
    datagrams_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    drops: Counter[str] = field(default_factory=Counter)
    ended_by: str = ""  # reset | idle | refused | cancelled


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


class _SocketSink:
    """The flow's datagrams to the socket, now or dropped (tunnel.stream.DatagramSink)."""

    def __init__(self, sock: socket.socket, counters: FlowCounters,
                 scope: trio.CancelScope, idle_timeout: float) -> None:
        self.sock = sock
        self.counters = counters
        self.scope = scope
        self.idle_timeout = idle_timeout
        self.reset: StreamResetError | None = None

    def on_datagram(self, data: bytes) -> None:
        counters = self.counters
        try:
            self.sock.send(data)
        except BlockingIOError:
            counters.drops["socket_full"] += 1
            return
        except ConnectionRefusedError:
            # An ICMP port unreachable from an earlier datagram: the target is not there.
            counters.drops["refused"] += 1
            counters.ended_by = "refused"
            self.scope.cancel()
            return
        except OSError:
            counters.drops["send_error"] += 1
            return
        counters.datagrams_in += 1
        counters.bytes_in += len(data)
        self.scope.deadline = trio.current_time() + self.idle_timeout

    def on_reset(self, error: StreamResetError) -> None:
        self.reset = error
        self.scope.cancel()


async def bridge_flow(stream: TunnelStream, sock: socket.socket, *,
                      idle_timeout: float) -> FlowCounters:
    """Carry datagrams between an accepted flow and a connected UDP socket until the
    flow is reset, idle for `idle_timeout` seconds, or refused by the target. Closes
    the socket and the flow (RST: CANCELLED when idle, REFUSED when refused)."""
    counters = FlowCounters()
    scope = trio.CancelScope(deadline=trio.current_time() + idle_timeout)
    sink = _SocketSink(sock, counters, scope, idle_timeout)
    try:
        with scope:
            stream.attach_datagram_sink(sink)
            while True:
                await trio.lowlevel.wait_readable(sock)
                for _ in range(RECV_BATCH):
                    try:
                        data = sock.recv(RECV_SIZE)
                    except BlockingIOError:
                        break
                    except ConnectionRefusedError:
                        counters.drops["refused"] += 1
                        counters.ended_by = "refused"
                        scope.cancel()
                        break
                    except OSError:
                        counters.drops["recv_error"] += 1
                        break
                    dropped = stream.send_datagram(data)
                    if dropped is not None:
                        counters.drops[dropped] += 1
                        continue
                    counters.datagrams_out += 1
                    counters.bytes_out += len(data)
                    scope.deadline = trio.current_time() + idle_timeout
    finally:
        stream.attach_datagram_sink(None)
        trio.lowlevel.notify_closing(sock)
        sock.close()
        if not counters.ended_by:
            counters.ended_by = ("reset" if sink.reset is not None
                                 else "idle" if scope.cancelled_caught else "cancelled")
        with trio.CancelScope(shield=True):
            if counters.ended_by == "refused":
                await stream.abort(StreamReason.REFUSED, "the target refused (port "
                                                         "unreachable)")
            elif counters.ended_by == "idle":
                await stream.abort(StreamReason.CANCELLED, "flow idle")
            else:
                await stream.aclose()
    return counters


class _PolledFlow:
    """One flow of a FlowPoller: its socket, its stream, when it was last active."""

    __slots__ = ("counters", "deadline", "idle_timeout", "on_end", "poller", "sock",
                 "stream")

    def __init__(self, poller: FlowPoller, stream: TunnelStream, sock: socket.socket,
                 idle_timeout: float, on_end: Callable[[FlowCounters], None] | None) -> None:
        self.poller = poller
        self.stream = stream
        self.sock = sock
        self.idle_timeout = idle_timeout
        self.deadline = trio.current_time() + idle_timeout
        self.counters = FlowCounters()
        self.on_end = on_end

    def on_datagram(self, data: bytes) -> None:
        counters = self.counters
        try:
            self.sock.send(data)
        except BlockingIOError:
            counters.drops["socket_full"] += 1
            return
        except ConnectionRefusedError:
            counters.drops["refused"] += 1
            self.poller.end(self, "refused")
            return
        except OSError:
            counters.drops["send_error"] += 1
            return
        counters.datagrams_in += 1
        counters.bytes_in += len(data)
        self.deadline = trio.current_time() + self.idle_timeout

    def on_reset(self, error: StreamResetError) -> None:
        self.poller.end(self, "reset")

    def readable(self) -> None:
        counters = self.counters
        stream = self.stream
        for _ in range(RECV_BATCH):
            try:
                data = self.sock.recv(RECV_SIZE)
            except BlockingIOError:
                return
            except ConnectionRefusedError:
                counters.drops["refused"] += 1
                self.poller.end(self, "refused")
                return
            except OSError:
                counters.drops["recv_error"] += 1
                return
            dropped = stream.send_datagram(data)
            if dropped is not None:
                counters.drops[dropped] += 1
                continue
            counters.datagrams_out += 1
            counters.bytes_out += len(data)
            self.deadline = trio.current_time() + self.idle_timeout


class FlowPoller:
    """Many flows joined to their connected UDP sockets by one task (bridge_flow's job
    without a task per flow): the sockets sit in one epoll set, and the task wakes when
    any is readable. An idle flow costs its socket and a small record. A flow ends as in
    bridge_flow: reset by the peer, idle past its timeout (RST CANCELLED), or refused by
    the target (RST REFUSED); `on_end` gets its counters."""

    SWEEP = 1.0  # seconds between idle sweeps

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._flows: dict[int, _PolledFlow] = {}

    def __len__(self) -> int:
        return len(self._flows)

    def add(self, stream: TunnelStream, sock: socket.socket, *, idle_timeout: float,
            on_end: Callable[[FlowCounters], None] | None = None) -> None:
        """Take over an accepted flow and its connected, non-blocking socket."""
        flow = _PolledFlow(self, stream, sock, idle_timeout, on_end)
        self._flows[sock.fileno()] = flow
        self._epoll.register(sock.fileno(), select.EPOLLIN)
        stream.attach_datagram_sink(flow)  # a reset that already came ends it at once

    def end(self, flow: _PolledFlow, why: str) -> None:
        fd = flow.sock.fileno()
        if fd < 0 or self._flows.get(fd) is not flow:
            return  # already ended
        del self._flows[fd]
        self._epoll.unregister(fd)
        flow.sock.close()
        flow.stream.attach_datagram_sink(None)
        counters = flow.counters
        counters.ended_by = why
        if why == "refused":
            flow.stream.abort_now(StreamReason.REFUSED,
                                  "the target refused (port unreachable)")
        elif why == "idle":
            flow.stream.abort_now(StreamReason.CANCELLED, "flow idle")
        else:
            flow.stream.abort_now(StreamReason.CANCELLED, "closed by the local side")
        if flow.on_end is not None:
            flow.on_end(counters)

    async def run(self) -> None:
        """Serve the flows until cancelled; then end every one."""
        try:
            while True:
                with trio.move_on_after(self.SWEEP):
                    await trio.lowlevel.wait_readable(self._epoll.fileno())
                for fd, _ in self._epoll.poll(0, 256):
                    flow = self._flows.get(fd)
                    if flow is not None:
                        flow.readable()
                now = trio.current_time()
                for flow in [f for f in self._flows.values() if f.deadline <= now]:
                    self.end(flow, "idle")
        finally:
            for flow in list(self._flows.values()):
                self.end(flow, "cancelled")
            self._epoll.close()
