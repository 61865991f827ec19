"""A TCP mapping's connections opened without a task per connection: the mapping's accept
loop sends each OPEN and returns; the node's tunnel connection answers it from its reader
and, accepted, splices the client socket in its splice loop (tcpmappings.accept_loop,
spliceloop.open_in_loop). Real sockets for the clients and the target; the agent is an
in-memory tunnel connection whose reader answers (a StreamTaker), so neither side makes a
task per connection. The edges: the agent refuses, never answers (timeout), the client
resets first, half-closes first, the tunnel is lost with opens pending, 100 pending."""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from nodeagent.ops.listener import Listeners
from nodeagent.server.listeners import server_listeners
from nodeagent.server.server import Server
from nodeagent.testing.standalone import free_port
from tests.server.test_policy import SETTINGS, TOKEN, make_server
from tests.tunnel.memtransport import memory_transport_pair
from tests.tunnel.test_dial_in_loop import SpawnCounter, accept, listener
from tests.tunnel.test_spliceloop import recv_exactly, recv_until_closed
from tunnel import protocol as p
from tunnel.endpoint import EndpointSettings, IncomingStream, TunnelConnection
from tunnel.log import _FIELDS
from tunnel.relay import relay_incoming_now
from tunnel.splice import SpliceResult
from tunnel.spliceloop import loop_for

_RESET = struct.pack("ii", 1, 0)


@dataclass
class Agent:
    """The node's side: its reader hands each OPEN to `answer` (no task), or holds it."""

    target: tuple[str, int] = ("127.0.0.1", 1)
    hold: bool = False  # keep every OPEN unanswered in `held`
    refuse: bool = False
    held: list[IncomingStream] = field(default_factory=list)
    finished: list[SpliceResult] = field(default_factory=list)
    handler_tasks: int = 0
    connection: TunnelConnection | None = None

    def take(self, incoming: IncomingStream) -> bool:
        if self.refuse:
            incoming.refuse_now(p.StreamReason.REFUSED, "the target refused")
            return True
        if self.hold:
            self.held.append(incoming)
            return True
        return self.dial(incoming)

    def dial(self, incoming: IncomingStream) -> bool:
        return relay_incoming_now(incoming, *self.target, timeout=10, mark=None,
                                  on_accepted=lambda: None, on_refused=lambda _: None,
                                  on_finished=self.finished.append)

    def answer_held(self) -> None:
        """Dial the target for every held OPEN now, from the test's task (not the reader,
        which sends what its taker queued): the answers' output is sent here."""
        held, self.held = self.held, []
        for incoming in held:
            assert self.dial(incoming)
        assert self.connection is not None
        self.connection.flush()

    async def handler(self, incoming: IncomingStream) -> None:
        self.handler_tasks += 1
        await incoming.refuse(p.StreamReason.INTERNAL, "not expected")


@dataclass
class Mapping:
    server: Server
    agent: Agent
    address: tuple[str, int]
    nursery: trio.Nursery

    def outcome(self, name: str) -> int:
        return self.server.outcomes.counts[name]

    def streams_open(self) -> int:
        """Streams (and opens) the server's connection to the node still holds."""
        conn = self.server.tunnel.connection_for("edge-1")
        return conn.info().streams_open if conn is not None else 0

    def opening_rows(self) -> list[dict[str, Any]]:
        rows = self.server.streams()["streams"]
        return [r for r in rows if r["state"] == "opening"]


@asynccontextmanager
async def mapping(tmp_path: Path, agent: Agent, *, dial_timeout: float = 30,
                  connected: bool = True, balanced_port: int | None = None,
                  settings: EndpointSettings = SETTINGS, **extra: Any) -> AsyncIterator[Mapping]:
    target = f"{agent.target[0]}:{agent.target[1]}"
    balanced = {"load_balancer_host": "127.0.0.1", "load_balancers": [
        {"name": "apps/echo", "ports": [{"port": balanced_port, "backends": [
            {"node": "edge-1", "target": target}]}]}]} if balanced_port else {}
    server = make_server({"tcp": [{"name": "app", "listen": "127.0.0.1:0", "node": "edge-1",
                                   "target": target, **extra}], **balanced},
                         debug_socket=str(tmp_path / "server.sock"), dial_timeout=dial_timeout)
    listeners = server.listeners = Listeners(server_listeners(
        server, tunnel_context=None, reuse_port=False, runs_connect_front=False))
    async with trio.open_nursery() as nursery:
        bound = await listeners.start_all(nursery)
        host, port = bound["tcp:app"][0].rsplit(":", 1)
        if connected:
            ours, theirs = memory_transport_pair()
            nursery.start_soon(server.tunnel.handle_transport, theirs)
            conn = agent.connection = TunnelConnection(ours, p.Role.DIALER, settings,
                                                       agent.handler, take_stream=agent.take)
            await conn.dial_handshake(p.Hello(identity={"node": "edge-1", "token": TOKEN}))
            await nursery.start(conn.run)
            await trio.testing.wait_all_tasks_blocked()
        yield Mapping(server, agent, (host, int(port)), nursery)
        listeners.stop_all()
        nursery.cancel_scope.cancel()


def client_of(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=5)
    sock.setblocking(False)
    return sock


def reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    sock.close()


async def until(condition: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while not condition():  # noqa: ASYNC110 (callbacks and counters, polled)
            await trio.sleep(0.01)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_connections_are_opened_and_spliced_without_a_task_per_connection(
        tmp_path: Path) -> None:
    with listener() as target:
        agent = Agent(target.getsockname())
        async with mapping(tmp_path, agent) as m:

            async def round_trip(i: int) -> None:
                with client_of(m.address) as client:
                    client.send(b"ping %d" % i)
                    conn = await accept(target)
                    with conn:
                        assert await recv_exactly(conn, len(b"ping %d" % i)) == b"ping %d" % i
                        conn.send(b"pong")
                        assert await recv_exactly(client, 4) == b"pong"
                        client.shutdown(socket.SHUT_WR)  # the client closes first
                        assert await recv_until_closed(conn) == b""
                        conn.shutdown(socket.SHUT_WR)
                        assert await recv_until_closed(client) == b""

            await round_trip(0)  # the loops and timers of both sides start here
            counter = SpawnCounter()
            trio.lowlevel.add_instrument(counter)
            try:
                for i in range(1, 21):
                    await round_trip(i)
            finally:
                trio.lowlevel.remove_instrument(counter)
            # 20 connections accepted, opened, answered, spliced and ended: no task
            # spawned on either side.
            assert counter.spawned == 0
            await until(lambda: len(agent.finished) == 21)
            assert m.outcome("accepted") == 21
            assert agent.handler_tasks == 0
            setup = m.server.metrics.registry.get_sample_value(
                "nodeagent_stream_setup_seconds_count", {"direction": "to-node"})
            assert setup == 21
            sent = m.server.metrics.registry.get_sample_value(
                "nodeagent_stream_bytes_total", {"direction": "out"})
            assert sent is not None and sent >= sum(len(b"ping %d" % i) for i in range(21))


async def test_answered_opens_leave_the_deadline_heap_with_the_next_open(
        tmp_path: Path) -> None:
    """Every open waits on its connection's deadline heap until answered; answered, it
    leaves at the next open, not when the timer next wakes (the dial timeout later):
    the heap holds what is unanswered, not every open of the last 30 s."""
    with listener() as target:
        agent = Agent(target.getsockname())
        async with mapping(tmp_path, agent) as m:
            for _ in range(20):
                with client_of(m.address) as client:
                    client.send(b"hi")
                    with await accept(target) as conn:
                        assert await recv_exactly(conn, 2) == b"hi"
            await until(lambda: m.outcome("accepted") == 20)
            conn = m.server.tunnel.connection_for("edge-1")
            assert conn is not None
            assert len(loop_for(conn)._deadlines) <= 1


async def test_the_target_closing_first_reaches_the_client_and_the_client_can_still_send(
        tmp_path: Path) -> None:
    with listener() as target:
        async with mapping(tmp_path, Agent(target.getsockname())) as m:
            with client_of(m.address) as client:
                conn = await accept(target)
                with conn:
                    conn.send(b"banner")
                    conn.shutdown(socket.SHUT_WR)  # the target closes first
                    assert await recv_until_closed(client) == b"banner"
                    client.send(b"late words")
                    assert await recv_exactly(conn, 10) == b"late words"
                    client.shutdown(socket.SHUT_WR)
                    assert await recv_until_closed(conn) == b""


async def test_a_refused_open_resets_the_client_and_is_counted_and_logged_rate_limited(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with mapping(tmp_path, Agent(refuse=True)) as m:
        for _ in range(6):
            with client_of(m.address) as client, pytest.raises(ConnectionResetError):
                await recv_until_closed(client)
        await until(lambda: m.outcome("refused") == 6)
        # Anyone who reaches the port can cause a refusal per connection: each is
        # counted, but only a few lines per mapping and reason are logged every 10 s.
        lines = [vars(r)[_FIELDS] for r in caplog.records
                 if r.getMessage() == "connection refused"]
        assert len(lines) == 3
        assert lines[0]["reason"] == "refused" and lines[0]["node"] == "edge-1"
        assert lines[0]["error"] == "the target refused"
        assert m.opening_rows() == []


async def test_a_node_that_is_not_connected_resets_the_client(tmp_path: Path) -> None:
    async with mapping(tmp_path, Agent(), connected=False) as m:
        with client_of(m.address) as client, pytest.raises(ConnectionResetError):
            await recv_until_closed(client)
        await until(lambda: m.outcome("unreachable") == 1)


async def test_an_open_never_answered_times_out_and_resets_both_ends(tmp_path: Path) -> None:
    agent = Agent(hold=True)
    async with mapping(tmp_path, agent, dial_timeout=0.3) as m:
        with client_of(m.address) as client, pytest.raises(ConnectionResetError):
            await recv_until_closed(client)
        assert m.outcome("timeout") == 1
        # The abandoned open was reset toward the node too: its stream is gone there.
        await until(lambda: agent.held[0].stream.reset_reason is not None)
        assert m.opening_rows() == []
        assert m.streams_open() == 0  # nothing left on the books for the abandoned open


async def test_a_client_that_resets_before_the_answer_ends_its_open_at_once(
        tmp_path: Path) -> None:
    """Not at the dial timeout (30 s here): the loop watches the waiting socket for errors,
    resets the stream toward the node and counts the connection as cancelled."""
    agent = Agent(hold=True)
    async with mapping(tmp_path, agent) as m:
        client = client_of(m.address)
        await until(lambda: len(agent.held) == 1)
        assert len(m.opening_rows()) == 1
        reset(client)
        await until(lambda: agent.held[0].stream.reset_reason is not None)
        assert m.outcome("cancelled") == 1
        assert m.opening_rows() == []
        assert m.streams_open() == 0
        assert m.outcome("accepted") == 0


async def test_a_client_that_sends_and_half_closes_before_the_answer_is_carried_whole(
        tmp_path: Path) -> None:
    """A FIN before the ACCEPT is a half-close, not a reset: the bytes and the FIN wait in
    the kernel and reach the target once the node accepts."""
    with listener() as target:
        agent = Agent(target.getsockname(), hold=True)
        async with mapping(tmp_path, agent) as m:
            with client_of(m.address) as client:
                client.send(b"request")
                client.shutdown(socket.SHUT_WR)
                await until(lambda: len(agent.held) == 1)
                await trio.sleep(0.1)  # the FIN has reached the server's socket
                agent.answer_held()
                conn = await accept(target)
                with conn:
                    assert await recv_until_closed(conn) == b"request"
                    conn.send(b"response")
                    conn.shutdown(socket.SHUT_WR)
                    assert await recv_until_closed(client) == b"response"
            await until(lambda: len(agent.finished) == 1)
            assert m.outcome("accepted") == 1


async def test_the_tunnel_lost_with_opens_pending_resets_their_clients(
        tmp_path: Path) -> None:
    agent = Agent(hold=True)
    async with mapping(tmp_path, agent) as m:
        before = open_fds()
        clients = [client_of(m.address) for _ in range(5)]
        await until(lambda: len(agent.held) == 5)
        assert len(m.opening_rows()) == 5
        assert agent.connection is not None
        await agent.connection.aclose(p.ErrorCode.INTERNAL_ERROR, "cut")
        for client in clients:
            with client, pytest.raises(ConnectionResetError):
                await recv_until_closed(client)
        await until(lambda: m.outcome("unreachable") == 5)
        await until(lambda: open_fds() <= before)  # no socket left behind


async def test_a_hundred_opens_pending_at_once_are_all_carried_once_answered(
        tmp_path: Path) -> None:
    with listener(256) as target:
        agent = Agent(target.getsockname(), hold=True)
        async with mapping(tmp_path, agent) as m:
            clients = [client_of(m.address) for _ in range(100)]
            await until(lambda: len(agent.held) == 100)
            rows = m.opening_rows()
            assert len(rows) == 100
            assert rows[0]["opened_by"].startswith("tcp mapping app client 127.0.0.1:")
            agent.answer_held()
            conns = [await accept(target) for _ in range(100)]
            # Which target connection is whose: each client says its number.
            for i, client in enumerate(clients):
                client.send(b"%03d" % i)
            by_number = {int(await recv_exactly(conn, 3)): conn for conn in conns}
            for i, client in enumerate(clients):
                by_number[i].send(b"hi %03d" % i)
                assert await recv_exactly(client, 6) == b"hi %03d" % i
            for sock in [*clients, *conns]:
                sock.close()
            await until(lambda: len(agent.finished) == 100)
            assert m.outcome("accepted") == 100
            assert m.opening_rows() == []


async def test_the_mapping_stopping_with_opens_pending_resets_their_clients(
        tmp_path: Path) -> None:
    agent = Agent(hold=True)
    async with mapping(tmp_path, agent) as m:
        clients = [client_of(m.address) for _ in range(3)]
        await until(lambda: len(agent.held) == 3)
        listeners = m.server.listeners
        next(lst for lst in listeners.all if lst.name == "tcp:app").stop()
        for client in clients:
            with client, pytest.raises(ConnectionResetError):
                await recv_until_closed(client)
        await until(lambda: all(i.stream.reset_reason is not None for i in agent.held))


async def test_a_proxy_protocol_mapping_sends_its_header_before_the_clients_bytes(
        tmp_path: Path) -> None:
    with listener() as target:
        async with mapping(tmp_path, Agent(target.getsockname()),
                           proxy_protocol="v1") as m:
            with client_of(m.address) as client:
                port = client.getsockname()[1]
                client.send(b"hello")
                conn = await accept(target)
                with conn:
                    header = (f"PROXY TCP4 127.0.0.1 127.0.0.1 {port} {m.address[1]}\r\n"
                              .encode())
                    assert await recv_exactly(conn, len(header) + 5) == header + b"hello"
            sent = m.server.metrics.registry.get_sample_value  # the client's bytes alone
            await until(lambda: sent("nodeagent_stream_bytes_total", {"direction": "out"})
                        == 5)


async def test_a_load_balancer_ports_connections_take_no_task_either(tmp_path: Path) -> None:
    """A LoadBalancer Service port picks the backend per connection and opens it as a
    mapping does; closing the port (its Service gone) resets the connections it carries."""
    balanced = free_port()
    with listener() as target:
        agent = Agent(target.getsockname())
        async with mapping(tmp_path, agent, balanced_port=balanced) as m:
            lb = m.server.load_balancers
            await until(lambda: lb.ports[("tcp", balanced)].state == "listening")
            with client_of(("127.0.0.1", balanced)) as first:  # the loops start here
                (await accept(target)).close()
                assert await recv_until_closed(first) == b""
            counter = SpawnCounter()
            trio.lowlevel.add_instrument(counter)
            try:
                clients, conns = [], []
                for i in range(10):
                    client = client_of(("127.0.0.1", balanced))
                    conn = await accept(target)
                    client.send(b"%d" % i)
                    assert await recv_exactly(conn, len(b"%d" % i)) == b"%d" % i
                    clients.append(client)
                    conns.append(conn)
            finally:
                trio.lowlevel.remove_instrument(counter)
            assert counter.spawned == 0
            assert lb.ports[("tcp", balanced)].accepted == 11
            lb.update(())  # the Service is gone: its port closes
            for client in clients:
                with client, pytest.raises(ConnectionResetError):
                    await recv_until_closed(client)
            for conn in conns:
                conn.close()


async def test_opens_pending_when_the_agent_reconnects_go_through_its_new_connection(
        tmp_path: Path) -> None:
    """The agent's new connection replaces its old one (REPLACED) while OPENs wait on the
    old: each is sent again through the new one, once, as a task's open_stream does."""
    with listener() as target:
        old = Agent(target.getsockname(), hold=True)
        async with mapping(tmp_path, old) as m:
            clients = [client_of(m.address) for _ in range(3)]
            await until(lambda: len(old.held) == 3)
            new = Agent(target.getsockname())
            ours, theirs = memory_transport_pair()
            m.nursery.start_soon(m.server.tunnel.handle_transport, theirs)
            conn = TunnelConnection(ours, p.Role.DIALER, SETTINGS, new.handler,
                                    take_stream=new.take)
            await conn.dial_handshake(p.Hello(identity={"node": "edge-1", "token": TOKEN}))
            await m.nursery.start(conn.run)
            for i, client in enumerate(clients):
                client.send(b"%d" % i)
            conns = [await accept(target) for _ in range(3)]
            received = sorted([await recv_exactly(c, 1) for c in conns])
            assert received == [b"0", b"1", b"2"]
            for sock in [*clients, *conns]:
                sock.close()
            await until(lambda: len(new.finished) == 3)
            assert m.outcome("accepted") == 3
            assert m.outcome("unreachable") == 0


async def test_opens_beyond_the_nodes_stream_limit_are_refused_as_overloaded(
        tmp_path: Path) -> None:
    agent = Agent(hold=True)
    limited = EndpointSettings(ping_interval=0, protocol=p.Settings(max_streams=2))
    async with mapping(tmp_path, agent, settings=limited) as m:
        waiting = [client_of(m.address) for _ in range(2)]
        await until(lambda: len(agent.held) == 2)
        with client_of(m.address) as third, pytest.raises(ConnectionResetError):
            await recv_until_closed(third)
        assert m.outcome("overloaded") == 1
        assert len(m.opening_rows()) == 2
        for client in waiting:
            client.close()


async def test_a_node_draining_its_tunnel_refuses_new_connections_as_draining(
        tmp_path: Path) -> None:
    """The agent said GOAWAY (it is shutting down): no new OPEN on that connection; the
    client is reset at once and the refusal counted, as a task's open_stream did."""
    agent = Agent(hold=True)
    async with mapping(tmp_path, agent) as m:
        assert agent.connection is not None
        agent.connection.goaway("agent shutting down")
        await until(lambda: m.server.tunnel.connection_for("edge-1") is not None
                    and m.server.tunnel.connection_for("edge-1").goaway_received.is_set())
        with client_of(m.address) as client, pytest.raises(ConnectionResetError):
            await recv_until_closed(client)
        assert m.outcome("draining") == 1
        assert agent.held == []
