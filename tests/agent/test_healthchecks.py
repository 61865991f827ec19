"""The agent's health checks against real sockets, and a server's stream of requests,
good and bad, through an in-memory stream."""

from __future__ import annotations

import functools
import json

import trio
import trio.testing

from nodeagent.agent.healthchecks import HealthChecks, probe, serve_health_stream
from nodeagent.config.health import CheckedTarget, CheckRequest, HealthCheck
from nodeagent.ops.logs import get_logger

LOG = get_logger("test.health")


async def http_service(nursery: trio.Nursery, status: int) -> int:
    """A one-response-per-connection HTTP service answering `status`."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                data += chunk
            await stream.send_all(f"HTTP/1.1 {status} X\r\ncontent-length: 0\r\n"
                                  f"connection: close\r\n\r\n".encode())

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0,
                                                      host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


def target(port: int, kind: str = "http", **check: object) -> CheckedTarget:
    return CheckedTarget(host="127.0.0.1", port=port, check=HealthCheck(
        kind=kind, interval=0.5, healthy_threshold=1, unhealthy_threshold=1, **check))


async def test_probes() -> None:
    async with trio.open_nursery() as nursery:
        ok, bad = await http_service(nursery, 204), await http_service(nursery, 500)
        assert await probe(target(ok), mark=None) is None
        assert await probe(target(bad), mark=None) == "GET /healthz answered 500"
        assert await probe(target(bad, kind="tcp"), mark=None) is None
        with trio.socket.socket() as unused:
            await unused.bind(("127.0.0.1", 0))
            closed = unused.getsockname()[1]
        assert await probe(target(closed, kind="tcp"), mark=None) is not None
        nursery.cancel_scope.cancel()


async def read_reports(stream: trio.abc.ReceiveStream, count: int) -> list[dict[str, object]]:
    data = b""
    with trio.fail_after(10):
        while data.count(b"\n") < count:
            data += await stream.receive_some(4096)
    return [json.loads(line) for line in data.splitlines()]


async def test_a_stream_of_requests_and_reports() -> None:
    registry = HealthChecks()
    server, agent = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        ok, bad = await http_service(nursery, 200), await http_service(nursery, 503)
        nursery.start_soon(lambda: serve_health_stream(
            agent, 3, registry, allows=lambda host, port: port != 1, mark=None, log=LOG))
        await server.send_all(CheckRequest(checks=(
            target(ok), target(bad), target(1))).line())
        reports = {r["port"]: r for r in await read_reports(server, 3)}
        assert reports[ok]["state"] == "healthy"
        assert reports[bad]["state"] == "unhealthy" and "503" in str(reports[bad]["detail"])
        assert reports[1] == {"host": "127.0.0.1", "port": 1, "state": "unhealthy",
                              "detail": "not allowed on this node"}
        assert {row["target"] for row in registry.as_list()} == {
            f"127.0.0.1:{ok}", f"127.0.0.1:{bad}", "127.0.0.1:1"}
        # A new request replaces the checks.
        await server.send_all(CheckRequest(checks=(target(bad),)).line())
        (report,) = await read_reports(server, 1)
        assert report["port"] == bad and report["state"] == "unhealthy"
        assert [row["target"] for row in registry.as_list()] == [f"127.0.0.1:{bad}"]
        # The server goes: the checks end, nothing is left behind.
        await server.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert not registry.streams
        nursery.cancel_scope.cancel()


async def test_bad_requests_close_the_stream_cleanly() -> None:
    for garbage in (b"not json\n", b'{"checks": [{"host": "x"}]}\n',
                    b"x" * (300 * 1024)):
        registry = HealthChecks()
        server, agent = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(
                serve_health_stream, agent, 1, registry, allows=lambda host, port: True,
                mark=None, log=LOG))
            try:
                await server.send_all(garbage)
            except trio.BrokenResourceError:
                pass
            with trio.fail_after(5):
                try:
                    assert await server.receive_some(100) == b""
                except trio.BrokenResourceError:
                    pass
            assert not registry.streams
