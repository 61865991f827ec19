"""The agent's task-free path for streams the server opens (`Agent.take_stream`), with a
real Agent behind a tunnel connection pair and a real TCP target: the allow list in
force decides every stream (a config applied later is obeyed for a target asked for
before), each outcome is counted in the status and in `nodeagent_streams_total`, the
bytes in `nodeagent_stream_bytes_total`, and `debug streams` says who opened a stream."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from nodeagent.agent.agent import Agent
from nodeagent.config import AgentConfig, NodeConfig
from nodeagent.ops.streamviews import stream_rows
from tests.tunnel.memtransport import memory_transport_pair
from tests.tunnel.test_dial_in_loop import accept, listener
from tests.tunnel.test_spliceloop import recv_exactly
from tunnel import protocol as p
from tunnel.endpoint import (
    EndpointSettings,
    IncomingStream,
    StreamRefusedError,
    TunnelConnection,
)
from tunnel.transports import PeerInfo

pytestmark = pytest.mark.needs("root")  # the agent marks its dials (SO_MARK)

SETTINGS = EndpointSettings(ping_interval=0)


def make_agent() -> Agent:
    return Agent(AgentConfig.model_validate({
        "node": "edge-1", "server": "tcp://127.0.0.1:9", "insecure": True,
        "token": "0123456789abcdef0", "debug_socket": ""}), ssl_context=None)


def allowing(port: int, version: int) -> NodeConfig:
    return NodeConfig.model_validate({"version": version, "allow": [f"127.0.0.1:{port}"]})


async def no_task(incoming: IncomingStream) -> None:
    raise AssertionError(f"left to the handler's task: {incoming.target}")


@asynccontextmanager
async def tunnel_to(agent: Agent) -> AsyncIterator[tuple[TunnelConnection, TunnelConnection]]:
    """(the server's connection, which opens streams; the agent's, whose reader hands
    each to `agent.take_stream`)."""
    ta, tb = memory_transport_pair()
    async with trio.open_nursery() as nursery:
        server = TunnelConnection(ta, p.Role.ACCEPTOR, SETTINGS)
        node = TunnelConnection(tb, p.Role.DIALER, SETTINGS, no_task,
                                take_stream=agent.take_stream)

        async def allow(hello: p.Hello, peer: PeerInfo) -> p.Hello:
            return p.Hello(identity={"server": "test"})

        nursery.start_soon(server.accept_handshake, allow)
        await node.dial_handshake(p.Hello(identity={"node": "edge-1"}))
        await nursery.start(node.run)
        await nursery.start(server.run)
        yield server, node
        nursery.cancel_scope.cancel()


def sample(agent: Agent, name: str, **labels: str) -> float:
    value = agent.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def test_the_config_in_force_decides_each_stream_and_each_is_counted() -> None:
    agent = make_agent()
    with listener() as target:
        port = target.getsockname()[1]
        address = p.Target("127.0.0.1", port)
        conns: list[socket.socket] = []
        async with tunnel_to(agent) as (server, node):

            async def relayed(payload: bytes) -> None:
                stream = await server.open_stream(address, {"origin": "198.51.100.7:4000"})
                conn = await accept(target)
                conns.append(conn)
                rows = stream_rows(node, agent.stream_notes, peer={"server_id": "s"})
                assert [(r["id"], r["opened_by"]) for r in rows] == [
                    (stream.stream_id, "client 198.51.100.7:4000")]
                await stream.send_all(payload)
                assert await recv_exactly(conn, len(payload)) == payload
                conn.send(b"back")
                conn.shutdown(socket.SHUT_WR)
                got = b""
                with trio.fail_after(10):
                    while chunk := await stream.receive_some():
                        got += chunk
                assert got == b"back"
                await stream.send_eof()

            async def forbidden() -> None:
                with trio.fail_after(10), pytest.raises(StreamRefusedError) as refused:
                    await server.open_stream(address, {"origin": "198.51.100.7:4001"})
                assert refused.value.reason is p.StreamReason.FORBIDDEN

            await forbidden()  # the config at start allows nothing
            await agent.apply_node_config(allowing(port, 1))
            await relayed(b"one")
            await relayed(b"three")
            # A config that no longer allows the target: the next stream is refused,
            # though the same target was allowed a moment ago.
            await agent.apply_node_config(allowing(port + 1, 2))
            await forbidden()
            await agent.apply_node_config(allowing(port, 3))
            await relayed(b"fifteen")
            with trio.fail_after(10):
                while node.open_streams():  # noqa: ASYNC110 (the loop ends them)
                    await trio.sleep(0.01)
        for conn in conns:
            conn.close()
    assert (agent.outcomes["accepted"], agent.outcomes["forbidden"]) == (3, 2)
    total = "nodeagent_streams_total"
    assert sample(agent, total, direction="inbound", outcome="accepted") == 3
    assert sample(agent, total, direction="inbound", outcome="forbidden") == 2
    carried = "nodeagent_stream_bytes_total"
    assert sample(agent, carried, direction="in") == len(b"onethreefifteen")
    assert sample(agent, carried, direction="out") == 3 * len(b"back")
