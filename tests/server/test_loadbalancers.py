"""The server's LoadBalancer Service ports (nodeagent/server/loadbalancers.py) with real
sockets and no agent: opened, refused with no backends, retried while another process
holds the port, changed hands and closed as the routes change."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
import trio

from nodeagent.config import LoadBalancerService, ServerConfig
from nodeagent.server.loadbalancers import BIND_RETRY
from nodeagent.server.server import Server
from nodeagent.testing.standalone import free_port


def server() -> Server:
    return Server(ServerConfig.model_validate({
        "tunnel": {"url": "tcp://127.0.0.1:0", "insecure": True},
        "tokens": [{"node": "edge-1", "token": "t" * 32}],
        "load_balancer_host": "127.0.0.1", "debug_socket": "/nonexistent/s.sock"}))


def services(*ports: tuple[str, str, int]) -> tuple[LoadBalancerService, ...]:
    by_name: dict[str, list[dict[str, object]]] = {}
    for name, protocol, port in ports:
        by_name.setdefault(name, []).append({"protocol": protocol, "port": port})
    return tuple(LoadBalancerService.model_validate({"name": n, "ports": p})
                 for n, p in by_name.items())


def bind_failures(s: Server) -> float:
    for line in s.metrics.render().decode().splitlines():
        if line.startswith('nodeagent_loadbalancer_refusals_total{reason="bind_failed"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def until(check: Callable[[], bool], seconds: float = 5.0) -> None:
    with trio.fail_after(seconds):
        while True:
            if check():
                return
            await trio.sleep(0.02)


async def connect_outcome(port: int) -> str:
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return "refused"
    async with stream:
        with trio.fail_after(5):
            data = await stream.receive_some(10)
    return "closed" if data == b"" else "data"


async def test_ports_follow_updates_refuse_without_backends_and_retry_a_held_port() -> None:
    s = server()
    lb = s.load_balancers
    tcp_port, udp_port, held_port = free_port(), free_port(socket.SOCK_DGRAM), free_port()
    holder = socket.create_server(("127.0.0.1", held_port))
    lb.update(services(("apps/a", "tcp", tcp_port), ("apps/a", "udp", udp_port),
                       ("apps/b", "tcp", held_port)))
    async with trio.open_nursery() as nursery:
        await lb.start(nursery)
        await until(lambda: lb.ports[("tcp", held_port)].state == "failed" and all(
            p.state != "starting" for p in lb.ports.values()))
        rows = {(r["protocol"], r["port"]): r for r in lb.view()["ports"]}
        assert rows[("tcp", tcp_port)]["state"] == "listening"
        assert rows[("udp", udp_port)]["state"] == "listening"
        assert rows[("tcp", held_port)]["state"] == "failed"
        assert "already in use" in rows[("tcp", held_port)]["error"]
        # No backends: the connection is closed at once, and counted.
        assert await connect_outcome(tcp_port) == "closed"
        assert lb.ports[("tcp", tcp_port)].refused == 1
        metrics = s.metrics.render().decode()
        assert 'nodeagent_loadbalancer_refusals_total{reason="no_backends"} 1.0' in metrics
        assert 'nodeagent_loadbalancer_ports{protocol="tcp",state="failed"} 1.0' in metrics
        # The other process lets the port go: the next attempt takes it.
        holder.close()
        await until(lambda: lb.ports[("tcp", held_port)].state == "listening",
                    BIND_RETRY * 3)
        # Another Service takes a port over (binding once the old socket is closed, not
        # failing on it); a port nobody asks for closes.
        failed_binds = bind_failures(s)
        lb.update(services(("apps/c", "tcp", tcp_port), ("apps/c", "udp", udp_port)))
        await trio.sleep(0.1)
        assert await connect_outcome(held_port) == "refused"
        assert [r["service"] for r in lb.view()["ports"]] == ["apps/c", "apps/c"]
        await until(lambda: all(p.state == "listening" for p in lb.ports.values()))
        assert bind_failures(s) == failed_binds
        assert await connect_outcome(tcp_port) == "closed"
        lb.update(())
        await trio.sleep(0.1)
        assert await connect_outcome(tcp_port) == "refused"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("host", ["not-an-ip", "example.com"])
def test_the_load_balancer_host_must_be_an_address(host: str) -> None:
    with pytest.raises(ValueError, match="is not an IP address"):
        ServerConfig.model_validate({"tokens": [{"node": "edge-1", "token": "t" * 32}],
                                     "tunnel": {"url": "tcp://127.0.0.1:0",
                                                "insecure": True},
                                     "load_balancer_host": host})
