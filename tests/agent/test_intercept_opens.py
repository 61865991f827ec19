"""The agent's intercept listener opens each connection's stream from its accept loop
(`Interceptor._take`, tunnel/spliceloop.py `open_in_loop`), with no task per connection,
against real sockets: a plain loopback client of the proxy port (not redirected, so its
original destination is the proxy's own address), the agent's tunnel connection over an
in-memory transport, and a peer that dials a real echo listener for every stream (or
refuses it). Accepted connections are spliced and counted; refused ones reset, counted
and logged once; none spawns a task."""

from __future__ import annotations

import functools
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest
import trio
import trio.testing

from nodeagent.agent.intercept.listener import Interceptor
from nodeagent.config import InterceptConfig
from nodeagent.ops.streamviews import StreamNotes
from tests.tunnel.memtransport import memory_transport_pair
from tests.tunnel.test_dial_in_loop import SpawnCounter, listener
from tunnel import protocol as p
from tunnel.endpoint import EndpointSettings, IncomingStream, TunnelConnection
from tunnel.relay import relay_incoming_now
from tunnel.transports import PeerInfo

SETTINGS = EndpointSettings(ping_interval=0)


async def no_handler(incoming: IncomingStream) -> None:
    await incoming.refuse(p.StreamReason.INTERNAL, "not expected")


@asynccontextmanager
async def intercepting(echo: tuple[str, int], *, refuse: bool = False
                       ) -> AsyncIterator[tuple[Interceptor, tuple[str, int]]]:
    """An Interceptor accepting on a loopback proxy port, its streams going through a
    tunnel connection whose peer dials `echo` for each (or refuses each)."""
    ta, tb = memory_transport_pair()

    def take(incoming: IncomingStream) -> bool:
        if refuse:
            incoming.refuse_now(p.StreamReason.FORBIDDEN, "not in the egress allow list")
            return True
        return relay_incoming_now(incoming, *echo, timeout=10, mark=None,
                                  on_accepted=lambda: None, on_refused=lambda f: None,
                                  on_finished=lambda r: None)

    with listener() as proxy:
        port = proxy.getsockname()[1]
        async with trio.open_nursery() as nursery:
            agent = TunnelConnection(ta, p.Role.DIALER, SETTINGS)
            server = TunnelConnection(tb, p.Role.ACCEPTOR, SETTINGS, no_handler,
                                      take_stream=take)

            async def allow(hello: p.Hello, peer: PeerInfo) -> p.Hello:
                return p.Hello(identity={"server": "test"})

            nursery.start_soon(server.accept_handshake, allow)
            await agent.dial_handshake(p.Hello(identity={"node": "edge-1"}))
            await nursery.start(agent.run)
            await nursery.start(server.run)

            async def no_task_path(target: p.Target, metadata: dict[str, str]) -> Any:
                raise AssertionError("the task path is not expected")

            interceptor = Interceptor(
                InterceptConfig(proxy_port=port), skip_mark=0x2000,
                open_tunnel=no_task_path, backend=cast(Any, object()),
                tunnel_now=lambda: agent, notes=StreamNotes())
            connections = await nursery.start(_connections)
            await nursery.start(interceptor._accept, [proxy], connections)
            yield interceptor, ("127.0.0.1", port)
            nursery.cancel_scope.cancel()


async def _connections(*, task_status: Any) -> None:
    async with trio.open_nursery() as connections:
        task_status.started(connections)
        await trio.sleep_forever()


async def echo_once(address: tuple[str, int], payload: bytes) -> bytes:
    sock = trio.socket.socket()
    await sock.connect(address)  # (not open_tcp_stream: its attempts are tasks)
    client = trio.SocketStream(sock)
    async with client:
        await client.send_all(payload)
        got = b""
        with trio.fail_after(10):
            while len(got) < len(payload):
                data = await client.receive_some()
                if not data:
                    break
                got += data
        return got


async def test_intercepted_connections_are_opened_and_spliced_without_a_task_each() -> None:
    async def serve_echo(stream: trio.SocketStream) -> None:
        async with stream:
            async for data in stream:
                await stream.send_all(data)

    async with trio.open_nursery() as echo_nursery:
        listeners = await echo_nursery.start(
            functools.partial(trio.serve_tcp, serve_echo, 0, host="127.0.0.1"))
        echo = listeners[0].socket.getsockname()[:2]
        async with intercepting(echo) as (interceptor, proxy):
            assert await echo_once(proxy, b"warm") == b"warm"  # loops and timer start
            counter = SpawnCounter()
            trio.lowlevel.add_instrument(counter)
            try:
                for i in range(10):
                    assert await echo_once(proxy, b"ping %d" % i) == b"ping %d" % i
            finally:
                trio.lowlevel.remove_instrument(counter)
            with trio.fail_after(10):
                while interceptor.active_connections:  # noqa: ASYNC110 (a counter)
                    await trio.sleep(0.01)
        echo_nursery.cancel_scope.cancel()
    # The echo's tasks (serve_tcp: one per connection) are the only ones spawned.
    assert counter.spawned == 10
    assert interceptor.outcomes == {"tunnel": 11}


async def test_a_refused_connection_is_reset_counted_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    async with intercepting(("127.0.0.1", 9), refuse=True) as (interceptor, proxy):
        for _ in range(3):
            with socket.create_connection(proxy, timeout=10) as sock:
                sock.sendall(b"x")
                with pytest.raises(ConnectionResetError):
                    await trio.to_thread.run_sync(sock.recv, 10)
        with trio.fail_after(10):
            while interceptor.outcomes["forbidden"] < 3:  # noqa: ASYNC110 (a counter)
                await trio.sleep(0.01)
        assert interceptor.active_connections == 0
    assert sum("intercepted connection refused" in r.getMessage()
               for r in caplog.records) == 1
