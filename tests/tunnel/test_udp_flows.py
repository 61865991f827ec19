"""Flows in the trio shell (tunnel/udp.py, the endpoint's DATAGRAM path): two linked
tunnel connections in memory, a real UDP echo socket behind the accepting side.

FlowPoller serves flows without a task each: the handler accepts, hands the flow over
and returns; datagrams still flow both ways, an idle flow ends with a reset the opener
sees, and a port-unreachable target ends it as REFUSED.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable, Iterator

import pytest
import trio
import trio.testing

import tests.tunnel.test_endpoint
import tunnel.udp
from tests.tunnel.test_endpoint import linked
from tunnel import protocol as p
from tunnel.endpoint import IncomingStream, StreamResetError
from tunnel.stream import TunnelStream
from tunnel.udp import GSO_MAX_SEGMENTS, FlowCounters, FlowPoller, connect_udp, gso_runs


class Collect:
    """The opener's end of a flow: a datagram sink that keeps what arrives."""

    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.reset: StreamResetError | None = None
        self.arrived = trio.Event()

    def on_datagram(self, data: bytes) -> None:
        self.got.append(data)
        self.arrived.set()

    def on_datagrams_end(self) -> None:
        pass

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


def test_gso_runs_cut_a_batch_where_one_send_can_carry_it() -> None:
    def runs(sizes: list[int]) -> list[tuple[int, int]]:
        return gso_runs([b"x" * size for size in sizes])

    assert runs([1400] * 3) == [(0, 3)]
    assert runs([1400, 1400, 900]) == [(0, 3)]  # the last of a run may be shorter
    assert runs([1400, 900, 1400]) == [(0, 2), (2, 3)]  # ... and then ends it
    assert runs([900, 1400, 1400]) == [(0, 1), (1, 3)]  # a longer one starts a new run
    assert runs([1000] * 100) == [(0, GSO_MAX_SEGMENTS), (GSO_MAX_SEGMENTS, 100)]
    assert runs([1400] * 100) == [(0, 46), (46, 92), (92, 100)]  # 46 x 1,400 B fit
    assert runs([30_000] * 3) == [(0, 2), (2, 3)]  # one UDP payload's bytes at most
    assert runs([65_507, 10]) == [(0, 1), (1, 2)]
    assert runs([0, 0, 5]) == [(0, 1), (1, 2), (2, 3)]  # an empty datagram goes alone
    assert runs([]) == []


async def udp_sink(got: list[bytes], want: int, done: trio.Event,
                   task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    task_status.started(sock.getsockname()[1])
    try:
        while True:
            await trio.lowlevel.wait_readable(sock)
            while True:
                try:
                    got.append(sock.recv(65_535))
                except BlockingIOError:
                    break
            if len(got) >= want:
                done.set()
    finally:
        sock.close()


# A burst the opener queues at once, so the accepting side's reader gets it in one read:
# runs of one size, a shorter last one, a size change, a big one, an empty one.
BURST = ([b"a" * 1400] * 40 + [b"b" * 700] + [b"c" * 1400] * 30 + [b"d" * 1200]
         + [b"e" * 20_000] * 4 + [b""] + [b"f" * 10] * 5)


async def send_burst_and_collect(monkeypatch: pytest.MonkeyPatch,
                                 ) -> tuple[list[bytes], list[int], FlowPoller]:
    """Send BURST through a flow to a sink; what the sink got, the datagram counts of
    the sendmsg() calls the flow made (GSO), and the poller."""
    got: list[bytes] = []
    segments: list[int] = []
    plain_sendmsg = socket.socket.sendmsg

    def counting_sendmsg(self: socket.socket, buffers: list[bytes], *args: object) -> int:
        segments.append(len(buffers))
        return plain_sendmsg(self, buffers, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "sendmsg", counting_sendmsg)
    poller, ended = FlowPoller(), []
    async with trio.open_nursery() as outer:
        done = trio.Event()
        port = await outer.start(udp_sink, got, len(BURST), done)
        outer.start_soon(poller.run)
        async with linked(acceptor_handler=poller_handler(poller, ended)) as link:
            stream, _collect = await open_flow(link.dialer, port)
            for data in BURST:  # no checkpoint between: one write, one read
                assert stream.send_datagram(data) is None
            with trio.fail_after(30):
                await done.wait()
            await trio.sleep(0.1)  # nothing more arrives
        outer.cancel_scope.cancel()
    return got, segments, poller


async def test_a_burst_leaves_in_gso_sends_and_arrives_datagram_by_datagram(
        monkeypatch: pytest.MonkeyPatch) -> None:
    got, segments, _ = await send_burst_and_collect(monkeypatch)
    assert got == BURST  # every datagram, whole, in order, none merged or split
    assert segments and max(segments) > 1  # several datagrams per sendmsg: GSO was used
    assert sum(segments) < len(BURST)


async def test_a_kernel_that_refuses_gso_gets_one_send_per_datagram(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An option number no kernel knows: sendmsg fails as on a kernel before 4.18.
    monkeypatch.setattr(tunnel.udp, "UDP_SEGMENT", 0x7FFF)
    got, segments, _ = await send_burst_and_collect(monkeypatch)
    assert got == BURST  # nothing lost to the refusal
    assert segments == [41]  # one try (40 + the shorter last), refused; then one each


async def accept_into(collect: Collect) -> Callable[[IncomingStream], Awaitable[None]]:
    async def handler(incoming: IncomingStream) -> None:
        stream = await incoming.accept()
        stream.attach_datagram_sink(collect)
        incoming.hand_over()
    return handler


@pytest.fixture(params=["memory", "tls"])
def wire(request: pytest.FixtureRequest) -> Iterator[str]:
    """linked() over memory streams or over TLS on loopback (test_endpoint's wires)."""
    tests.tunnel.test_endpoint._WIRE = str(request.param)
    yield str(request.param)
    tests.tunnel.test_endpoint._WIRE = "memory"


async def test_datagrams_queued_without_waking_the_writer_leave_on_flush(wire: str) -> None:
    # What the UDP readers do per wake-up: queue (wake=False), then flush once. On a
    # real socket flush() writes from the calling task (the writer's fast path); in
    # memory it wakes the writer. Either way every datagram arrives.
    collect = Collect()
    async with linked(acceptor_handler=await accept_into(collect)) as link:
        stream = await link.dialer.open_stream(p.Target("127.0.0.1", 9, "udp"))
        await trio.testing.wait_all_tasks_blocked()
        written = link.dialer.bytes_out
        for i in range(5):
            assert stream.send_datagram(b"d%d" % i, wake=False) is None
        await trio.testing.wait_all_tasks_blocked()
        assert link.dialer.bytes_out == written  # queued: no writer woke for them
        link.dialer.flush()
        if wire == "tls":
            assert link.dialer.bytes_out > written  # on the wire before any task switch
        with trio.fail_after(10):
            while len(collect.got) < 5:
                await wait_for(collect)
        assert collect.got == [b"d%d" % i for i in range(5)]
        written = link.dialer.bytes_out
        link.dialer.flush()  # nothing queued: nothing written, nothing woken
        await trio.testing.wait_all_tasks_blocked()
        assert link.dialer.bytes_out == written


async def test_datagrams_held_when_the_flow_ends_in_the_same_read_are_counted_dropped(
        ) -> None:
    # A read that brings a flow's datagrams and then its reset: the reset ends the flow
    # before the reader's step ends, so what the flow held is dropped, and counted.
    poller, ended = FlowPoller(), []
    async with trio.open_nursery() as outer:
        port = await outer.start(udp_echo)
        outer.start_soon(poller.run)
        async with linked(acceptor_handler=poller_handler(poller, ended)) as link:
            await open_flow(link.dialer, port)
            await trio.testing.wait_all_tasks_blocked()  # the handler handed it over
            (flow,) = poller._flows.values()
            flow.on_datagram(b"one")
            flow.on_datagram(b"two")
            flow.on_reset(StreamResetError(p.StreamReason.CANCELLED, "gone"))
            flow.on_datagrams_end()  # the reader's step ends: nothing left to send
            assert [c.ended_by for c in ended] == ["reset"]
            assert ended[0].drops == {"closed": 2} and ended[0].datagrams_in == 0
        outer.cancel_scope.cancel()
