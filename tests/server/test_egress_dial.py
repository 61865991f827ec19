"""The server's dial of an agent's egress stream from the tunnel connection's reader
(`AgentStreams.take_agent_stream`, a StreamTaker): a tcp stream to an IP literal is
decided by the data-path policy at once and refused, or dialed by the connection's splice
loop with no task per OPEN. A real Server over an in-memory tunnel, real sockets for
what it dials: a target the policy denies is never connected to (no connection reaches
its listener), one that never answers is refused when `dial_timeout` passes, one that
refuses (RST) is refused as such, one that accepts is relayed; each counted by outcome,
the policy's refusals also by reason and in a rate-limited log line."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from nodeagent.server.server import Server
from tests.server.test_policy import connect, make_server, refusals
from tests.tunnel.test_dial_in_loop import SpawnCounter, accept, full_backlog, listener, open_fds
from tests.tunnel.test_spliceloop import recv_exactly
from tunnel import protocol as p
from tunnel.endpoint import StreamRefusedError, TunnelConnection

ORIGIN = {"origin": "10.1.0.9:4000", "intercepted": "to-remote"}


def outcomes(server: Server) -> dict[str, int]:
    return {k.removeprefix("agent_opened:"): v for k, v in server.outcomes.counts.items()
            if k.startswith("agent_opened:")}


def streams_metric(server: Server, outcome: str) -> float:
    return server.metrics.registry.get_sample_value(
        "nodeagent_streams_total", {"direction": "inbound", "outcome": outcome}) or 0.0


async def refused(agent: TunnelConnection, address: tuple[str, int]) -> StreamRefusedError:
    with trio.fail_after(20), pytest.raises(StreamRefusedError) as info:
        await agent.open_stream(p.Target(*address), ORIGIN)
    return info.value


class HandlerTasks(SpawnCounter):
    """Counts the tunnel handler tasks spawned (a stream left to the task path)."""

    def __init__(self) -> None:
        super().__init__()
        self.handlers = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        super().task_spawned(task)
        if "_run_handler" in task.name:
            self.handlers += 1


async def test_denied_targets_are_never_connected_to_and_refusals_are_counted_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    with listener() as target, listener() as protected:
        port = target.getsockname()[1]
        # 127.0.0.1 is protected: allowed only by a rule naming exactly its range, which
        # names `target`'s port and not `protected`'s; 10.0.0.0/8 allows only port 1.
        server = make_server({"egress": [f"127.0.0.1/32:{port}", "10.0.0.0/8:1",
                                         "0.0.0.0/0:*"]})
        counter = HandlerTasks()
        async with trio.open_nursery() as nursery:
            agent = await connect(server, nursery, "edge-1")
            trio.lowlevel.add_instrument(counter)
            try:
                for _ in range(3):
                    error = await refused(agent, protected.getsockname())
                    assert error.reason is p.StreamReason.FORBIDDEN
                    assert "protected" in error.message
                scoped = make_server({"egress": [f"127.0.0.1/32:{port + 1}"]})
                other = await connect(scoped, nursery, "edge-2")
                error = await refused(other, target.getsockname())
                assert error.reason is p.StreamReason.FORBIDDEN
                assert "not in node edge-2's egress allow list" in error.message
            finally:
                trio.lowlevel.remove_instrument(counter)
            nursery.cancel_scope.cancel()
        # Deny by default: not one connection reached either listener.
        for sock in (target, protected):
            with pytest.raises(BlockingIOError):
                sock.accept()
    assert counter.handlers == 0  # refused from the reader, no handler task
    assert refusals(server, "egress_protected") == 3
    assert outcomes(server) == {"forbidden": 3}
    assert streams_metric(server, "forbidden") == 3
    assert refusals(scoped, "egress_not_allowed") == 1
    # Three refusals, one log line (per reason and node, a minute).
    assert sum("protected destination" in r.getMessage() for r in caplog.records) == 1
    assert sum("destination not allowed" in r.getMessage() for r in caplog.records) == 1


async def test_an_allowed_target_is_dialed_and_spliced_without_a_task_per_open() -> None:
    with listener() as target:
        port = target.getsockname()[1]
        server = make_server({"egress": [f"127.0.0.1/32:{port}"]})
        accepted: list[socket.socket] = []
        async with trio.open_nursery() as nursery:
            agent = await connect(server, nursery, "edge-1")

            async def open_and_prove(i: int) -> None:
                stream = await agent.open_stream(p.Target("127.0.0.1", port), ORIGIN)
                conn = await accept(target)
                accepted.append(conn)
                await stream.send_all(b"ping %d" % i)
                assert await recv_exactly(conn, len(b"ping %d" % i)) == b"ping %d" % i
                if i == 0:  # the debug view names who opened it, as on the task path
                    (row,) = server.streams()["streams"]
                    assert row["opened_by"] == "intercepted pod 10.1.0.9:4000 (rule to-remote)"
                    assert row["target"] == f"tcp://127.0.0.1:{port}"
                conn.send(b"pong")
                assert await stream.receive_some() == b"pong"
                await stream.send_eof()
                conn.shutdown(socket.SHUT_WR)
                assert await stream.receive_some() == b""

            await open_and_prove(0)  # the splice loop and its timer start here
            counter = HandlerTasks()
            trio.lowlevel.add_instrument(counter)
            try:
                for i in range(1, 11):
                    await open_and_prove(i)
            finally:
                trio.lowlevel.remove_instrument(counter)
            nursery.cancel_scope.cancel()
        for conn in accepted:
            conn.close()
    # Ten streams opened, dialed, answered, spliced and ended: no task on the server.
    assert counter.spawned == 0
    assert outcomes(server) == {"egress": 11}
    assert streams_metric(server, "egress") == 11


async def test_a_target_that_refuses_or_never_answers_refuses_the_stream() -> None:
    with listener() as closed:
        closed_address = closed.getsockname()  # nothing listens there once closed
    with full_backlog() as blackhole:
        server = make_server({"egress": [f"127.0.0.1/32:{blackhole[1]}",
                                         f"127.0.0.1/32:{closed_address[1]}"],
                              "dial_timeout": 0.5})
        async with trio.open_nursery() as nursery:
            agent = await connect(server, nursery, "edge-1")
            error = await refused(agent, closed_address)
            assert error.reason is p.StreamReason.REFUSED
            assert "refused the connection" in error.message
            for _ in range(2):  # the timer that refused the first refuses the second too
                error = await refused(agent, blackhole)
                assert error.reason is p.StreamReason.TIMEOUT
                assert "timed out after 0.5s" in error.message
            nursery.cancel_scope.cancel()
    assert outcomes(server) == {"refused": 1, "timeout": 2}
    assert streams_metric(server, "timeout") == 2
    # A failed dial is no policy refusal.
    assert refusals(server, "egress_not_allowed") == refusals(server, "egress_protected") == 0


async def test_pending_dials_hold_no_task_and_leave_no_socket_when_the_tunnel_ends() -> None:
    with full_backlog() as blackhole:
        server = make_server({"egress": [f"127.0.0.1/32:{blackhole[1]}"],
                              "dial_timeout": 60})
        fds = open_fds()
        counter = HandlerTasks()
        async with trio.open_nursery() as nursery:
            agent = await connect(server, nursery, "edge-1")
            async with trio.open_nursery() as openers:

                async def open_one() -> None:
                    with pytest.raises((StreamRefusedError, trio.BrokenResourceError)):
                        await agent.open_stream(p.Target(*blackhole), ORIGIN)

                trio.lowlevel.add_instrument(counter)
                for _ in range(10):
                    openers.start_soon(open_one)
                await trio.testing.wait_all_tasks_blocked()
                trio.lowlevel.remove_instrument(counter)
                session = server.tunnel.sessions["edge-1"]
                assert len(session.connection.open_streams()) == 10
                assert all(row["state"] == "opening"
                           for row in server.streams()["streams"])
                assert open_fds() >= fds + 10  # ten sockets connecting
                await agent.aclose(p.ErrorCode.NO_ERROR, "bye")
            nursery.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert open_fds() == fds
    # The ten openers', the splice loop and its timer: none per dial on the server.
    assert counter.handlers == 0
    assert counter.spawned <= 10 + 2
    assert outcomes(server) == {}


async def test_what_may_wait_stays_on_the_handler_task() -> None:
    """A name (resolved by the task path, every address checked) and a relay through
    another node's tunnel are not the reader's to dial."""
    async def echo_b(incoming: object) -> None:
        from tunnel.endpoint import IncomingStream
        assert isinstance(incoming, IncomingStream)
        stream = await incoming.accept()
        async with stream:
            await stream.send_all(b"from b")

    with listener() as target:
        port = target.getsockname()[1]
        server = make_server({"egress": [f"localhost:{port}"],
                              "node_cidrs": {"node-b": ["10.2.0.0/24"]},
                              "scopes": [{"name": "r", "nodes": ["node-a"],
                                          "relays": ["10.2.0.0/24:8080"]}]})
        counter = HandlerTasks()
        async with trio.open_nursery() as nursery:
            await connect(server, nursery, "node-b", echo_b)
            agent = await connect(server, nursery, "node-a")
            trio.lowlevel.add_instrument(counter)
            try:
                # localhost resolves to the protected loopback: refused on the task path.
                error = await refused(agent, ("localhost", port))
                assert error.reason is p.StreamReason.FORBIDDEN
                stream = await agent.open_stream(p.Target("10.2.0.7", 8080), ORIGIN)
                assert await stream.receive_some() == b"from b"
            finally:
                trio.lowlevel.remove_instrument(counter)
            nursery.cancel_scope.cancel()
        with pytest.raises(BlockingIOError):
            target.accept()
    # The name's and the relay's on the server, and node-b's own for the relayed stream.
    assert counter.handlers == 3
    assert outcomes(server) == {"forbidden": 1, "relay": 1}
