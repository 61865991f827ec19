"""What differs between a server's worker processes (nodeagent/server/workers.py), and the
shared-port listeners they use; the processes themselves: tests/e2e/test_workers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from nodeagent.config import ConfigError, RoutesConfig, ServerConfig, parse_config
from nodeagent.server.workers import WorkerSlot, check_worker_config, worker_socket
from tunnel.listeners import open_tcp_listeners


def _config(**extra: object) -> ServerConfig:
    return parse_config(ServerConfig, {
        "server_id": "cloud-a", "tunnel": {"url": "tcp://127.0.0.1:8443", "insecure": True},
        "tokens": [{"node": "edge-1", "token": "t" * 20}], **extra}, "test")


def test_each_worker_is_a_server_of_its_own_announcing_replicas_times_workers() -> None:
    config = _config(debug_socket="/run/nodeagent/server.sock",
                     metrics_listen="127.0.0.1:9090")
    one = WorkerSlot(1, 2).config(config)
    assert one.server_id == "cloud-a-w1"
    assert one.replicas == 2  # no count configured: this host's workers
    assert one.debug_socket == Path("/run/nodeagent/server-w1.sock")
    assert one.metrics_listen is None  # the parent serves it for all
    assert WorkerSlot(0, 2).config(_config(replicas=3, server_id="b")).replicas == 6
    # Routes from the controller (or a reloaded file) count pods; each worker announces
    # pods x workers, never more than an agent accepts.
    assert WorkerSlot(0, 2).routes(RoutesConfig(replicas=3)).replicas == 6
    assert WorkerSlot(0, 2).routes(RoutesConfig()).replicas == 2
    assert WorkerSlot(0, 16).routes(RoutesConfig(replicas=64)).replicas == 64
    assert WorkerSlot(0, 2).runs_connect_front and not WorkerSlot(1, 2).runs_connect_front
    assert worker_socket(Path("/x/agent.sock"), 3) == Path("/x/agent-w3.sock")


def test_workers_need_fixed_ports_and_a_sane_count() -> None:
    check_worker_config(_config(http=[{"listen": "127.0.0.1:0", "routes": []}]), 1, "s.yaml")
    with pytest.raises(ConfigError, match=r"s.yaml: http\[0\].listen: port 0 with "
                                          r"--workers 2"):
        check_worker_config(_config(http=[{"listen": "127.0.0.1:0", "routes": []}]), 2,
                            "s.yaml")
    with pytest.raises(ConfigError, match="--workers: 0 is not in 1-16"):
        check_worker_config(_config(), 0, "s.yaml")


async def test_reuse_port_listeners_share_one_port() -> None:
    first = await open_tcp_listeners(0, host="127.0.0.1", reuse_port=True)
    port = first[0].socket.getsockname()[1]
    second = await open_tcp_listeners(port, host="127.0.0.1", reuse_port=True)
    try:
        assert second[0].socket.getsockname()[1] == port
        with pytest.raises(OSError):  # without it, the port stays taken
            await open_tcp_listeners(port, host="127.0.0.1")
        # Connections reach the listeners (the kernel picks one per connection).
        for _ in range(4):
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.aclose()
    finally:
        for listener in first + second:
            await listener.aclose()
