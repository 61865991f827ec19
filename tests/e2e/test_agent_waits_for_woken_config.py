"""The agent's side of a woken backend's first dial (agent.CONFIG_WAIT): a stream the server
marks as for a Service that scales to zero (WAKE_KEY), to a target this node's config
does not allow yet, waits for a config that does and is then dialed; it is refused as
forbidden when no such config comes in time, when too many already wait, when it is not
so marked, or when it is a control-plane stream. The agent never dials a target its
config in force does not allow. In one process: a real Agent's stream handler behind a
real tunnel connection pair, a real TCP upstream."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import pytest
import trio

from nodeagent.agent import agent as agent_module
from nodeagent.agent.agent import Agent
from nodeagent.config import CONTROL_PLANE_PURPOSE, PURPOSE_KEY, AgentConfig, NodeConfig
from nodeagent.config.routes import WAKE_KEY
from tests.tunnel.test_endpoint import linked
from tunnel import protocol as p
from tunnel.endpoint import StreamRefusedError

pytestmark = pytest.mark.needs("root")  # the agent marks its dials (SO_MARK)


@pytest.fixture
async def upstream(nursery: trio.Nursery) -> AsyncIterator[int]:
    """A TCP upstream answering `ok:` and what it got; its port."""
    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            data = await stream.receive_some()
            await stream.send_all(b"ok:" + data)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, serve, 0,
                                                      host="127.0.0.1"))
    yield listeners[0].socket.getsockname()[1]


def make_agent() -> Agent:
    return Agent(AgentConfig.model_validate({
        "node": "edge-1", "server": "tcp://127.0.0.1:9", "insecure": True,
        "token": "0123456789abcdef0", "debug_socket": ""}), ssl_context=None)


def allowing(port: int, version: int) -> NodeConfig:
    return NodeConfig.model_validate({"version": version, "allow": [f"127.0.0.1:{port}"]})


async def exchange(stream: trio.abc.HalfCloseableStream) -> bytes:
    await stream.send_all(b"hi")
    await stream.send_eof()
    got = b""
    while chunk := await stream.receive_some():
        got += chunk
    return got


async def test_a_woken_target_waits_for_the_config_that_allows_it(upstream: int) -> None:
    agent = make_agent()
    target = p.Target("127.0.0.1", upstream)
    async with linked(acceptor_handler=agent.handle_stream) as link:

        async def config_arrives() -> None:
            await trio.sleep(0.2)
            await agent.apply_node_config(NodeConfig(version=1))  # not this one yet
            await trio.sleep(0.1)
            await agent.apply_node_config(allowing(upstream, 2))

        link.nursery.start_soon(config_arrives)
        started = trio.current_time()
        with trio.fail_after(10):
            stream = await link.dialer.open_stream(target, {"origin": "c", WAKE_KEY: "1"})
        assert trio.current_time() - started >= 0.3  # accepted only once allowed
        assert await exchange(stream) == b"ok:hi"
    assert agent.outcomes["allowed_after_wait"] == 1
    assert agent.outcomes["accepted"] == 1 and agent.outcomes["forbidden"] == 0


async def test_refused_at_once_unless_marked_or_when_control_plane(upstream: int) -> None:
    agent = make_agent()
    target = p.Target("127.0.0.1", upstream)
    async with linked(acceptor_handler=agent.handle_stream) as link:
        for metadata in ({"origin": "c"}, {"origin": "c", WAKE_KEY: "yes"},
                         {"origin": "c", WAKE_KEY: "1", PURPOSE_KEY: CONTROL_PLANE_PURPOSE}):
            with trio.fail_after(1.0), pytest.raises(StreamRefusedError) as refused:
                await link.dialer.open_stream(target, metadata)
            assert refused.value.reason is p.StreamReason.FORBIDDEN
    assert agent.outcomes["allowed_after_wait"] == 0


async def test_no_config_in_time_or_too_many_waiting_is_forbidden(
        upstream: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "CONFIG_WAIT", 0.3)
    monkeypatch.setattr(agent_module, "CONFIG_WAITERS", 2)
    agent = make_agent()
    target = p.Target("127.0.0.1", upstream)
    marked = {"origin": "c", WAKE_KEY: "1"}
    refusals: list[tuple[p.StreamReason, float]] = []
    async with linked(acceptor_handler=agent.handle_stream) as link:
        started = trio.current_time()

        async def one() -> None:
            try:
                await link.dialer.open_stream(target, marked)
            except StreamRefusedError as exc:
                refusals.append((exc.reason, trio.current_time() - started))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(one)
                    await trio.sleep(0.02)
                # A config that allows something else is not this target's.
                await agent.apply_node_config(allowing(upstream + 1, 1))
    reasons = sorted(refusals, key=lambda r: r[1])
    assert [r for r, _ in reasons] == [p.StreamReason.FORBIDDEN] * 3
    # The third found two waiting: refused at once; the two others at CONFIG_WAIT.
    assert reasons[0][1] < 0.25 and reasons[1][1] >= 0.3 and reasons[2][1] >= 0.3
    assert agent.outcomes["forbidden"] == 3 and agent.outcomes["accepted"] == 0
    assert agent._config_waiters == 0
