"""tunnel.relay.relay_incoming_now: a stream the peer opens is dialed, answered and spliced
by its connection's splice loop, called from the reader (a StreamTaker), with no task per
OPEN; against real sockets: a target that accepts, one that refuses (RST), one that never
answers (a listener whose backlog is full), a reset while the dial is pending, and the
connection ending with dials pending (no socket left behind)."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from tests.tunnel.memtransport import memory_transport_pair
from tests.tunnel.test_spliceloop import recv_exactly
from tunnel import protocol as p
from tunnel.endpoint import (
    EndpointSettings,
    IncomingStream,
    StreamRefusedError,
    StreamResetError,
    TunnelConnection,
)
from tunnel.errors import StreamFailed
from tunnel.relay import relay_incoming_now
from tunnel.splice import SpliceResult
from tunnel.stream import TunnelStream
from tunnel.tcp import DialFailed
from tunnel.transports import PeerInfo


@dataclass
class Taker:
    """Dials every stream to `address` from the reader; records what the callbacks say."""

    address: tuple[str, int]
    timeout: float = 10.0
    accepted: int = 0
    refused: list[StreamFailed] = field(default_factory=list)
    finished: list[SpliceResult] = field(default_factory=list)
    handler_tasks: int = 0  # streams left to the handler's task (none expected)

    def take(self, incoming: IncomingStream) -> bool:
        return relay_incoming_now(incoming, *self.address, timeout=self.timeout, mark=None,
                                  on_accepted=self.on_accepted, on_refused=self.refused.append,
                                  on_finished=self.finished.append)

    def on_accepted(self) -> None:
        self.accepted += 1

    async def handler(self, incoming: IncomingStream) -> None:
        self.handler_tasks += 1
        await incoming.refuse(p.StreamReason.INTERNAL, "not expected")


@dataclass
class Pair:
    opener: TunnelConnection  # the server's side: opens streams
    dialer: TunnelConnection  # the agent's side: its reader takes them
    nursery: trio.Nursery


@asynccontextmanager
async def connections(taker: Taker, *, sent: list[bytes] | None = None
                      ) -> AsyncIterator[Pair]:
    """`sent`: each write of the dialer's transport, appended as it happens."""
    settings = EndpointSettings(ping_interval=0)
    ta, tb = memory_transport_pair()
    if sent is not None:
        send = tb.send

        async def recorded(data: bytes | bytearray | memoryview) -> None:
            sent.append(bytes(data))
            await send(data)

        tb.send = recorded  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        opener = TunnelConnection(ta, p.Role.ACCEPTOR, settings)
        agent = TunnelConnection(tb, p.Role.DIALER, settings, taker.handler,
                                 take_stream=taker.take)

        async def allow(hello: p.Hello, peer: PeerInfo) -> p.Hello:
            return p.Hello(identity={"server": "test"})

        nursery.start_soon(opener.accept_handshake, allow)
        await agent.dial_handshake(p.Hello(identity={"node": "edge-1"}))
        await nursery.start(agent.run)
        await nursery.start(opener.run)
        yield Pair(opener, agent, nursery)
        nursery.cancel_scope.cancel()


@contextmanager
def listener(backlog: int = 128) -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


@contextmanager
def full_backlog() -> Iterator[tuple[str, int]]:
    """An address whose SYNs go unanswered: a listener (backlog 0) with its one pending
    connection taken and never accepted; the kernel drops further SYNs."""
    with listener(0) as sock:
        filler = socket.create_connection(sock.getsockname())
        try:
            yield sock.getsockname()
        finally:
            filler.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class SpawnCounter(trio.abc.Instrument):
    def __init__(self) -> None:
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


async def accept(sock: socket.socket) -> socket.socket:
    with trio.fail_after(10):
        await trio.lowlevel.wait_readable(sock)
    conn, _ = sock.accept()
    conn.setblocking(False)
    return conn


async def test_a_dial_that_connects_is_accepted_and_spliced_without_a_task_per_open() -> None:
    with listener() as target:
        taker = Taker(target.getsockname())
        accepted: list[socket.socket] = []
        async with connections(taker) as pair:

            async def open_and_prove(i: int) -> None:
                stream = await pair.opener.open_stream(p.Target(*taker.address))
                conn = await accept(target)
                accepted.append(conn)
                await stream.send_all(b"ping %d" % i)
                assert await recv_exactly(conn, len(b"ping %d" % i)) == b"ping %d" % i
                conn.send(b"pong")
                assert await stream.receive_some() == b"pong"
                await stream.send_eof()
                conn.shutdown(socket.SHUT_WR)
                assert await stream.receive_some() == b""

            await open_and_prove(0)  # the splice loop and its timer start here
            counter = SpawnCounter()
            trio.lowlevel.add_instrument(counter)
            try:
                for i in range(1, 21):
                    await open_and_prove(i)
            finally:
                trio.lowlevel.remove_instrument(counter)
            # 20 streams opened, dialed, answered, spliced and ended: no task spawned.
            assert counter.spawned == 0
            with trio.fail_after(10):
                while len(taker.finished) < 21:  # noqa: ASYNC110 (callbacks, polled)
                    await trio.sleep(0.01)
        for conn in accepted:
            conn.close()
    assert taker.handler_tasks == 0
    assert taker.accepted == 21
    assert taker.refused == []
    assert [(r.a_to_b, r.b_to_a, r.error) for r in taker.finished[1:]] == [
        (len(b"ping %d" % i), 4, None) for i in range(1, 21)]


async def test_a_dial_that_connects_later_is_answered_from_the_loop() -> None:
    """Not connected when connect() returns (a SYN the target dropped, retried by the
    kernel a second later): the loop answers when the socket turns writable."""
    with listener(0) as target:
        filler = socket.create_connection(target.getsockname())
        taker = Taker(target.getsockname(), timeout=30)
        async with connections(taker) as pair, trio.open_nursery() as nursery:
            opened: list[object] = []

            async def open_one() -> None:
                stream = await pair.opener.open_stream(p.Target(*taker.address))
                opened.append(stream)

            nursery.start_soon(open_one)
            await trio.testing.wait_all_tasks_blocked()
            assert (opened, taker.accepted) == ([], 0)  # pending: the backlog is full
            first = await accept(target)  # the filler's: room for the retried SYN
            with trio.fail_after(20):
                while not opened:  # noqa: ASYNC110 (a task of this test, polled)
                    await trio.sleep(0.05)
            conn = await accept(target)
            stream = opened[0]
            assert isinstance(stream, TunnelStream)
            await stream.send_all(b"late")
            assert await recv_exactly(conn, 4) == b"late"
            conn.close()
            first.close()
        filler.close()
    assert (taker.accepted, taker.refused, taker.handler_tasks) == (1, [], 0)


async def test_a_refused_dial_refuses_the_stream_with_the_reason() -> None:
    with listener() as closed:
        address = closed.getsockname()
    taker = Taker(address)
    async with connections(taker) as pair:
        with pytest.raises(StreamRefusedError) as caught:
            await pair.opener.open_stream(p.Target(*address))
    assert caught.value.reason is p.StreamReason.REFUSED
    assert "refused the connection" in caught.value.message
    assert len(taker.refused) == 1
    failure = taker.refused[0]
    assert isinstance(failure, DialFailed) and failure.cause == "refused"
    assert (taker.accepted, taker.finished, taker.handler_tasks) == (0, [], 0)


async def test_a_dial_with_no_answer_is_refused_as_timed_out() -> None:
    fds = open_fds()
    with full_backlog() as address:
        taker = Taker(address, timeout=0.5)
        async with connections(taker) as pair:
            with trio.fail_after(10), pytest.raises(StreamRefusedError) as caught:
                await pair.opener.open_stream(p.Target(*address))
            # A second round: the timer that refused the first refuses this one too.
            with trio.fail_after(10), pytest.raises(StreamRefusedError):
                await pair.opener.open_stream(p.Target(*address))
    assert caught.value.reason is p.StreamReason.TIMEOUT
    assert "timed out after 0.5s" in caught.value.message
    assert [f.reason for f in taker.refused] == [p.StreamReason.TIMEOUT] * 2
    assert (taker.accepted, taker.finished, taker.handler_tasks) == (0, [], 0)
    assert open_fds() == fds


async def test_a_reset_while_the_dial_is_pending_closes_its_socket() -> None:
    with full_backlog() as address:
        taker = Taker(address, timeout=60)
        async with connections(taker) as pair:
            # The opener gives up (its open times out: it resets the stream).
            pair.opener.settings.open_timeout = 1
            async with trio.open_nursery() as nursery:

                async def open_one() -> None:
                    with trio.fail_after(10), pytest.raises(StreamRefusedError):
                        await pair.opener.open_stream(p.Target(*address))

                nursery.start_soon(open_one)
                await trio.testing.wait_all_tasks_blocked()
                assert len(pair.dialer.open_streams()) == 1
                fds = open_fds()  # the connecting socket among them
            with trio.fail_after(10):
                while not taker.finished:  # noqa: ASYNC110 (callbacks, polled)
                    await trio.sleep(0.01)
            assert open_fds() == fds - 1  # the connecting socket is closed
            assert pair.dialer.open_streams() == []
    assert taker.finished[0].error is not None and "StreamResetError" in taker.finished[0].error
    assert (taker.accepted, taker.refused, taker.handler_tasks) == (0, [], 0)


async def test_the_connection_ending_with_dials_pending_leaves_no_socket() -> None:
    with full_backlog() as address:
        taker = Taker(address, timeout=60)
        fds = open_fds()
        async with connections(taker) as pair:
            async with trio.open_nursery() as openers:

                async def open_one() -> None:
                    with pytest.raises((StreamRefusedError, StreamResetError,
                                        trio.BrokenResourceError)):
                        await pair.opener.open_stream(p.Target(*address))

                for _ in range(10):
                    openers.start_soon(open_one)
                await trio.testing.wait_all_tasks_blocked()
                assert len(pair.dialer.open_streams()) == 10
                assert open_fds() > fds + 10  # ten sockets connecting
                await pair.dialer.aclose(p.ErrorCode.NO_ERROR, "bye")
        await trio.testing.wait_all_tasks_blocked()
        assert open_fds() == fds
    assert len(taker.finished) == 10
    assert all(r.error for r in taker.finished)
    assert (taker.accepted, taker.refused, taker.handler_tasks) == (0, [], 0)


async def test_a_name_is_left_to_the_handler_task() -> None:
    """A name needs the resolver, which may wait: relay_incoming_now declines it."""
    taker = Taker(("localhost", 9))
    async with connections(taker) as pair:
        with pytest.raises(StreamRefusedError) as caught:
            await pair.opener.open_stream(p.Target("localhost", 9))
    assert caught.value.reason is p.StreamReason.INTERNAL  # the handler's refusal
    assert taker.handler_tasks == 1


async def test_a_taker_that_raises_costs_its_stream_not_the_connection() -> None:
    with listener() as target:
        taker = Taker(target.getsockname())
        calls = 0
        take_as_usual = taker.take

        def take(incoming: IncomingStream) -> bool:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a bug")
            return take_as_usual(incoming)

        taker.take = take  # type: ignore[method-assign]
        async with connections(taker) as pair:
            with pytest.raises(StreamRefusedError) as caught:
                await pair.opener.open_stream(p.Target(*taker.address))
            assert caught.value.reason is p.StreamReason.INTERNAL
            stream = await pair.opener.open_stream(p.Target(*taker.address))  # still serves
            conn = await accept(target)
            await stream.send_all(b"ok")
            assert await recv_exactly(conn, 2) == b"ok"
            conn.close()
    assert (taker.accepted, taker.handler_tasks) == (1, 0)


async def test_an_open_reset_in_the_same_read_is_answered_quietly(
        caplog: pytest.LogCaptureFixture) -> None:
    """An opener that gives up at once sends its RST in the same write as the OPEN, so the
    core has dropped the stream when the reader hands the OPEN to the taker: the dial
    ends as a reset, with no error logged and no socket left behind."""
    with listener() as target:
        taker = Taker(target.getsockname())
        async with connections(taker) as pair:
            first = await pair.opener.open_stream(p.Target(*target.getsockname()))
            (await accept(target)).close()  # the loop and its epoll exist from here on
            await first.aclose()
            with trio.fail_after(10):
                while pair.dialer.open_streams() or not taker.finished:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            fds = open_fds()
            for _ in range(20):
                with trio.CancelScope() as cancelled:
                    cancelled.cancel()  # open queued, then abandoned: OPEN + RST together
                    await pair.opener.open_stream(p.Target(*target.getsockname()))
            with trio.fail_after(10):
                while pair.dialer.open_streams() or len(taker.finished) < 21:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()
            while True:  # the target's side of the connections that got through
                try:
                    target.accept()[0].close()
                except BlockingIOError:
                    break
            assert open_fds() == fds
            assert pair.dialer.end_reason is None
    # Each abandoned open ended as a reset: answered first when its RST came in a later
    # read, or never answered when the RST came with the OPEN (the race under test).
    assert all(r.error and "StreamResetError" in r.error for r in taker.finished[1:])
    assert any("before it was answered" in (r.error or "") for r in taker.finished)
    assert (taker.refused, taker.handler_tasks) == ([], 0)
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [], [r.getMessage() for r in errors]


async def test_a_target_that_answers_and_closes_sends_data_and_fin_in_one_write() -> None:
    """The target's last bytes and its FIN are read in one loop round (EPOLLRDHUP says
    the FIN is there): they cross the tunnel in one write, not a round and a write each."""
    with listener() as target:
        taker = Taker(target.getsockname())
        sent: list[bytes] = []
        async with connections(taker, sent=sent) as pair:
            stream = await pair.opener.open_stream(p.Target(*taker.address))
            conn = await accept(target)
            await stream.send_all(b"request")
            assert await recv_exactly(conn, 7) == b"request"
            await trio.testing.wait_all_tasks_blocked()
            sent.clear()
            conn.send(b"answer")
            conn.shutdown(socket.SHUT_WR)  # both wait in the agent's socket now
            with trio.fail_after(10):
                got = b""
                while chunk := await stream.receive_some():
                    got += chunk
            assert got == b"answer"
            assert len(sent) == 1, sent
            await stream.send_eof()
            conn.close()
            with trio.fail_after(10):
                while not taker.finished:  # noqa: ASYNC110 (a callback, polled)
                    await trio.sleep(0.01)
    assert [(r.a_to_b, r.b_to_a, r.error) for r in taker.finished] == [(7, 6, None)]
