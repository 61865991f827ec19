"""The config watch stream: ConfigStreamServer and watch_config over real sockets."""

from __future__ import annotations

import functools
from typing import Any

import httpx
import pytest
import trio

from nodeagent.config import AllowRule, NodeConfig, RoutesConfig
from nodeagent.configwatch import WatchStatus, watch_config
from nodeagent.controller.compute import ConfigVersions
from nodeagent.controller.stream import ConfigStreamServer
from tunnel.backoff import Backoff

TOKEN = "stream-token-0123456789"


async def start(nursery: trio.Nursery, versions: ConfigVersions, heartbeat: float = 15.0
                ) -> tuple[ConfigStreamServer, int]:
    server = ConfigStreamServer(versions, lambda: TOKEN, heartbeat=heartbeat)
    listeners = await nursery.start(server.run, "127.0.0.1", 0)
    return server, listeners[0].socket.getsockname()[1]


def watcher(port: int, path: str, model: Any, applied: list[Any], status: WatchStatus,
            token: str = TOKEN, apply: Any = None) -> Any:
    async def default_apply(config: Any) -> None:
        applied.append(config)
    return functools.partial(
        watch_config, open_stream=functools.partial(trio.open_tcp_stream, "127.0.0.1", port),
        host="controller", path=path, token=lambda: token, model=model,
        apply=apply or default_apply, status=status,
        backoff=Backoff(initial=0.05, maximum=0.2), idle_timeout=2.0)


async def wait_until(predicate: Any, within: float = 5.0) -> None:
    """Poll a condition on plain data the code under test updates (no event to wait on)."""
    with trio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_node_watch_gets_current_then_each_new_version(nursery: trio.Nursery) -> None:
    versions = ConfigVersions()
    server, port = await start(nursery, versions)
    applied: list[NodeConfig] = []
    status = WatchStatus("http://controller")
    nursery.start_soon(watcher(port, "/v1/config/nodes/edge-1", NodeConfig, applied, status))
    # Unknown node: an empty config at version 0 until the controller knows it.
    await wait_until(lambda: len(applied) == 1)
    assert applied[0].version == 0 and applied[0].allow == ()
    assert server.subscribers["node/edge-1"] == 1
    versions.update("node/edge-1", NodeConfig(allow=(AllowRule(host="10.1.0.5"),)))
    versions.update("node/other", NodeConfig(allow=(AllowRule(host="10.9.9.9"),)))
    server.notify()
    await wait_until(lambda: len(applied) == 2)
    assert applied[1].version == 1 and applied[1].allows("10.1.0.5", 80)
    assert status.as_dict()["config_version"] == 1 and status.state == "watching"


async def test_server_watch_stays_alive_on_heartbeats(nursery: trio.Nursery) -> None:
    versions = ConfigVersions()
    versions.update("servers", RoutesConfig(egress=(AllowRule(host="10.1.0.1"),)))
    server, port = await start(nursery, versions, heartbeat=0.1)
    applied: list[RoutesConfig] = []
    status = WatchStatus("http://controller")
    watch = watcher(port, "/v1/config/servers/s1", RoutesConfig, applied, status)
    nursery.start_soon(functools.partial(watch, idle_timeout=0.3))
    await wait_until(lambda: len(applied) == 1)
    # Quiet for longer than the client's idle timeout: heartbeats keep the watch alive.
    await trio.sleep(1.0)
    assert status.state == "watching" and server.subscribers["servers"] == 1
    versions.update("servers", RoutesConfig())
    server.notify()
    await wait_until(lambda: len(applied) == 2)
    assert [c.version for c in applied] == [1, 2]


async def test_wrong_token_is_refused_and_retried_with_backoff(nursery: trio.Nursery) -> None:
    versions = ConfigVersions()
    _, port = await start(nursery, versions)
    status = WatchStatus("http://controller")
    nursery.start_soon(watcher(port, "/v1/config/nodes/a", NodeConfig, [], status,
                               token="wrong-token-xxxxxxxx"))
    await wait_until(lambda: status.last_error is not None and "401" in status.last_error)
    assert status.applied_version == -1


async def test_a_config_that_fails_to_apply_is_not_retried(nursery: trio.Nursery) -> None:
    versions = ConfigVersions()
    versions.update("node/a", NodeConfig(allow=(AllowRule(host="10.1.0.5"),)))
    server, port = await start(nursery, versions, heartbeat=0.05)
    attempts: list[int] = []

    async def failing(config: NodeConfig) -> None:
        attempts.append(config.version)
        if config.version == 1:
            raise ValueError("interface cni0 does not exist")

    status = WatchStatus("http://controller")
    nursery.start_soon(watcher(port, "/v1/config/nodes/a", NodeConfig, [], status,
                               apply=failing))
    await wait_until(lambda: attempts == [1])
    await trio.sleep(0.3)  # heartbeats come and go: version 1 is not tried again
    assert attempts == [1] and "cni0" in (status.last_error or "")
    versions.update("node/a", NodeConfig())
    server.notify()
    await wait_until(lambda: attempts == [1, 2])
    assert status.applied_version == 2 and status.last_error is None


@pytest.mark.parametrize(("path", "headers", "code"), [
    ("/v1/config/nodes/a", {}, 401),
    ("/v1/config/bogus/a", {"authorization": f"Bearer {TOKEN}"}, 404),
    ("/v1/config/nodes/a?after=x", {"authorization": f"Bearer {TOKEN}"}, 400),
])
async def test_bad_requests_get_clear_statuses(nursery: trio.Nursery, path: str,
                                               headers: dict[str, str], code: int) -> None:
    _, port = await start(nursery, ConfigVersions())
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"http://127.0.0.1:{port}{path}", headers=headers)
    assert response.status_code == code and response.text
