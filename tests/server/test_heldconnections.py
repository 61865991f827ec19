"""TCP connections for a sleeping Service (server/heldconnections.py), over real sockets:
held (nothing dialed, the Service wanted) until the target appears, its first refused
dials retried, then relayed both ways; closed with a reason over max-pending, at the
wake timeout and when the workload fails to start; activity counted while relayed."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest
import trio
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as MetricCounter

from nodeagent.config import RoutesConfig, TcpMapping
from nodeagent.http import HeldRequests, WakeSpec
from nodeagent.http.dispatch import Refusal
from nodeagent.ops.logs import get_logger
from nodeagent.ops.streamviews import StreamNotes
from nodeagent.server.datapath import DataPath
from nodeagent.server.heldconnections import HeldConnections, asleep
from nodeagent.server.openers import StreamOutcomes
from nodeagent.server.refusals import PolicyRefusals
from nodeagent.server.tcpmappings import TcpMappingRelay
from tunnel.errors import StreamRefusedError
from tunnel.protocol import StreamReason

NAME = "lb:shop/db:tcp/5432"
WAKE = WakeSpec("shop/db", timeout=10.0, max_pending=2)


class Node:
    """The node's side, dialing directly: refuses while `refusing` (its agent has not
    yet the woken endpoint in its allow list), counts the dials."""

    def __init__(self) -> None:
        self.refusing = False
        self.dials = 0

    async def __call__(self, node: str, target: Any, metadata: dict[str, str]) -> Any:
        self.dials += 1
        if self.refusing:
            raise StreamRefusedError(StreamReason.FORBIDDEN,
                                     f"{target} is not allowed on node {node}")
        return await trio.open_tcp_stream(target.host, target.port)


async def echo(stream: trio.SocketStream) -> None:
    async for data in stream:
        await stream.send_all(data)


def held_connections(node: Node) -> tuple[HeldConnections, HeldRequests]:
    registry = CollectorRegistry()
    log = get_logger("nodeagent.server")
    datapath = DataPath(routes=RoutesConfig, open_stream=cast(Any, node),
                        refusals=PolicyRefusals(registry, log), dial_timeout=5.0,
                        controller=None)
    relay = TcpMappingRelay(
        datapath=datapath, notes=StreamNotes(),
        outcomes=StreamOutcomes(MetricCounter("s", "s", ["d", "o"], registry=registry)),
        stream_bytes=MetricCounter("b", "b", ["d"], registry=registry), log=log)
    holds = HeldRequests()
    return HeldConnections(holds, relay, log), holds


async def listen(nursery: trio.Nursery, held: HeldConnections, wake: WakeSpec,
                 target: list[TcpMapping | None]) -> int:
    """A listener whose Service's one endpoint is `target[0]` (None: it sleeps)."""

    def pick() -> TcpMapping | Refusal:
        return target[0] if target[0] is not None else asleep(NAME, wake)

    async def handle(client: trio.SocketStream) -> None:
        await held.serve(NAME, wake, pick, client)

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    return int(listeners[0].socket.getsockname()[1])


async def pending(holds: HeldRequests, count: int) -> None:
    with trio.fail_after(5):
        while sum(holds.pending.values()) < count:  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_a_connection_is_held_until_the_service_wakes_then_relayed(
        nursery: trio.Nursery) -> None:
    echo_port = int((await nursery.start(trio.serve_tcp, echo, 0))[0].socket.getsockname()[1])
    node = Node()
    held, holds = held_connections(node)
    target: list[TcpMapping | None] = [None]
    port = await listen(nursery, held, WAKE, target)
    client = await trio.open_tcp_stream("127.0.0.1", port)
    await client.send_all(b"hello")  # waits in the socket buffer while held
    await pending(holds, 1)
    assert set(holds.wanted()) == {"shop/db"} and node.dials == 0
    # Woken: the route has its endpoint, but the node refuses the first dials.
    node.refusing = True
    target[0] = TcpMapping(name=NAME, listen="127.0.0.1:0", node="edge-1",
                           target=f"127.0.0.1:{echo_port}")
    holds.routes_changed()
    with trio.fail_after(5):
        while node.dials < 2:  # noqa: ASYNC110
            await trio.sleep(0.005)
    node.refusing = False
    with trio.fail_after(5):
        assert await client.receive_some(100) == b"hello"
        # Relayed: the Service's activity while it lasts.
        assert holds.activity()["shop/db"][1] == 1
        await client.send_all(b" again")
        assert await client.receive_some(100) == b" again"
        await client.aclose()
        while holds.activity()["shop/db"][1]:  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert holds.stats.held == 1 and holds.stats.forwarded == 1
    assert holds.pending == {} and holds.wanted() == {}


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """(reason, the part of its error the test looks for) of each "held connection
    closed" line."""
    out = []
    for record in caplog.records:
        if record.getMessage() == "held connection closed":
            fields = record.nodeagent_fields  # type: ignore[attr-defined]
            error = str(fields["error"])
            part = next((p for p in ("already wait", "did not wake within 0.5s",
                                     "CrashLoopBackOff: no password") if p in error), error)
            out.append((fields["reason"], part))
    return out


async def closed(port: int) -> bytes:
    """Connect, send, and read until the server closes the connection."""
    with trio.fail_after(5):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(b"x")
        data = await client.receive_some(100)
        await client.aclose()
        return bytes(data)


async def test_over_max_pending_at_the_wake_timeout_and_failing_the_connection_is_closed(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    node = Node()
    held, holds = held_connections(node)
    quick = WakeSpec("shop/db", timeout=0.5, max_pending=1)
    port = await listen(nursery, held, quick, [None])
    answers: list[bytes] = []

    async def wait_closed() -> None:
        answers.append(await closed(port))

    async with trio.open_nursery() as inner:
        inner.start_soon(wait_closed)
        await pending(holds, 1)
        # Over max-pending: closed at once (EOF: a clean close, not a reset).
        assert await closed(port) == b""
        assert holds.stats.overflowed == 1 and not answers
    assert answers == [b""] and holds.stats.timeouts == 1
    assert logged(caplog) == [("overflowed", "already wait"), ("timeout",
                                                             "did not wake within 0.5s")]
    # The workload fails to start: closed at once, with the reason logged.
    failing = WakeSpec("shop/db", timeout=10, max_pending=1,
                       failure="pod db-0: CrashLoopBackOff: no password")
    port = await listen(nursery, held, failing, [None])
    assert await closed(port) == b""
    assert logged(caplog)[2] == ("failed", "CrashLoopBackOff: no password")
    assert node.dials == 0 and holds.pending == {}
