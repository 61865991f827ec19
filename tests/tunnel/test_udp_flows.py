"""Flows in the trio shell (tunnel/udp.py, the endpoint's DATAGRAM path): two linked
tunnel connections in memory, a real UDP echo socket behind the accepting side.

FlowPoller serves flows without a task each: the handler accepts, hands the flow over
and returns; datagrams still flow both ways, an idle flow ends with a reset the opener
sees, and a port-unreachable target ends it as REFUSED.
"""

from __future__ import annotations

import socket

import trio

from tests.tunnel.test_endpoint import linked
from tunnel import protocol as p
from tunnel.endpoint import IncomingStream, StreamResetError
from tunnel.stream import TunnelStream
from tunnel.udp import FlowCounters, FlowPoller, connect_udp


class Collect:
    """The opener's end of a flow: a datagram sink that keeps what arrives."""

    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.reset: StreamResetError | None = None
        self.arrived = trio.Event()

    def on_datagram(self, data: bytes) -> None:
        self.got.append(data)
        self.arrived.set()

    def on_reset(self, error: StreamResetError) -> None:
        self.reset = error
        self.arrived.set()


async def udp_echo(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    task_status.started(sock.getsockname()[1])
    try:
        while True:
            await trio.lowlevel.wait_readable(sock)
            data, peer = sock.recvfrom(65_535)
            sock.sendto(data, peer)
    finally:
        sock.close()


async def wait_for(collect: Collect) -> None:
    with trio.fail_after(30):  # a hang guard: idle expiry sweeps every second
        await collect.arrived.wait()
    collect.arrived = trio.Event()


def poller_handler(poller: FlowPoller, ended: list[FlowCounters], idle: float = 30.0):  # type: ignore[no-untyped-def]
    async def handler(incoming: IncomingStream) -> None:
        target = incoming.target
        sock = connect_udp(target.host, target.port)
        stream = await incoming.accept()
        poller.add(stream, sock, idle_timeout=idle, on_end=ended.append)
        incoming.hand_over()  # the handler returns; the flow lives on in the poller
    return handler


async def open_flow(opener: object, port: int) -> tuple[TunnelStream, Collect]:
    stream: TunnelStream = await opener.open_stream(  # type: ignore[attr-defined]
        p.Target("127.0.0.1", port, "udp"))
    collect = Collect()
    stream.attach_datagram_sink(collect)
    return stream, collect


async def test_handed_over_flows_carry_datagrams_both_ways_without_a_task() -> None:
    poller, ended = FlowPoller(), []
    async with trio.open_nursery() as outer:
        port = await outer.start(udp_echo)
        outer.start_soon(poller.run)
        async with linked(acceptor_handler=poller_handler(poller, ended)) as link:
            flows = [await open_flow(link.dialer, port) for _ in range(3)]
            for i, (stream, collect) in enumerate(flows):
                payload = bytes([i]) * (1000 + 30_000 * i)
                assert stream.send_datagram(payload) is None
                await wait_for(collect)
                assert collect.got == [payload]
            assert len(poller) == 3  # the handlers returned; the flows did not end
            assert ended == []
        outer.cancel_scope.cancel()


async def test_an_idle_flow_ends_and_the_opener_sees_the_reset(
        autojump_clock: trio.abc.Clock) -> None:
    poller, ended = FlowPoller(), []
    async with trio.open_nursery() as outer:
        port = await outer.start(udp_echo)
        outer.start_soon(poller.run)
        async with linked(acceptor_handler=poller_handler(poller, ended, idle=5)) as link:
            _stream, collect = await open_flow(link.dialer, port)
            await wait_for(collect)  # nothing sent: only the reset can arrive
            assert collect.reset is not None
            assert collect.reset.reason is p.StreamReason.CANCELLED
            assert [c.ended_by for c in ended] == ["idle"] and len(poller) == 0
        outer.cancel_scope.cancel()


async def test_a_closed_port_ends_the_flow_as_refused() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    poller, ended = FlowPoller(), []
    async with trio.open_nursery() as outer:
        outer.start_soon(poller.run)
        async with linked(acceptor_handler=poller_handler(poller, ended)) as link:
            stream, collect = await open_flow(link.dialer, closed)
            for _ in range(20):  # the ICMP error arrives after the first send
                stream.send_datagram(b"anyone?")
                with trio.move_on_after(0.2):
                    await collect.arrived.wait()
                if collect.reset is not None:
                    break
            assert collect.reset is not None
            assert collect.reset.reason is p.StreamReason.REFUSED
        outer.cancel_scope.cancel()


async def test_a_flow_in_use_outlives_its_idle_timeout_and_ends_once_quiet(
        autojump_clock: trio.abc.Clock) -> None:
    # The poller reads no clock per datagram: a datagram marks the flow active, and the
    # next sweep moves its deadline. A flow used every 2 s with a 5 s timeout must live.
    poller, ended = FlowPoller(), []
    async with trio.open_nursery() as outer:
        port = await outer.start(udp_echo)
        outer.start_soon(poller.run)
        async with linked(acceptor_handler=poller_handler(poller, ended, idle=5)) as link:
            stream, collect = await open_flow(link.dialer, port)
            for i in range(10):  # 20 s of use, four times the idle timeout
                await trio.sleep(2)
                assert stream.send_datagram(b"ping %d" % i) is None
                await wait_for(collect)
                assert collect.reset is None, f"ended while in use, after {2 * i} s"
            assert ended == [] and len(poller) == 1
            quiet_since = trio.current_time()  # the last datagram, both ways
            await wait_for(collect)  # nothing sent: only the idle reset can arrive
            assert collect.reset is not None
            assert collect.reset.reason is p.StreamReason.CANCELLED
            # Within the sweep's precision: the timeout, plus up to two sweeps.
            assert 5 <= trio.current_time() - quiet_since <= 5 + 2 * FlowPoller.SWEEP + 0.1
            assert [c.ended_by for c in ended] == ["idle"]
            assert ended[0].datagrams_in == 10 and ended[0].datagrams_out == 10
        outer.cancel_scope.cancel()
