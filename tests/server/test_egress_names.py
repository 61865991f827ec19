"""Egress rules that name a host, and an Ingress's direct backends, against the protected
floor: the server resolves the name itself, checks every address it gets, and dials
exactly those addresses. Real tunnel connection (in memory), real sockets and the real
resolver for `localhost`; a resolver the test injects stands for a public DNS name (and
for one that changes its answer between two lookups)."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from nodeagent.config import RoutesConfig
from nodeagent.http.errors import UpstreamUnavailable
from nodeagent.http.routetable import Backend, Route
from tests.server.test_policy import connect, make_server, refusals, refused
from tunnel import protocol as p


def global_ipv4() -> str:
    """A non-loopback address of this host (not in the protected floor)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        return line.split()[3].split("/")[0]
    pytest.fail("this host has no global IPv4 address to stand for a public one")


@asynccontextmanager
async def echo_on(host: str) -> AsyncIterator[int]:
    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                async for data in stream:
                    await stream.send_all(data)
            except trio.BrokenResourceError:
                pass  # the tunnel stream's end may reach us as a reset

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, echo, 0, host=host))
        yield int(listeners[0].socket.getsockname()[1])
        nursery.cancel_scope.cancel()


async def roundtrip(agent: object, host: str, port: int) -> bytes:
    stream = await agent.open_stream(p.Target(host, port))  # type: ignore[attr-defined]
    await stream.send_all(b"ping")
    data: bytes = await stream.receive_some()
    await stream.aclose()
    return data


async def test_a_name_resolving_to_loopback_is_protected_unless_cidr_rules_name_it() -> None:
    async with echo_on("127.0.0.1") as port, trio.open_nursery() as nursery:
        server = make_server({"egress": [f"localhost:{port}"]})
        agent = await connect(server, nursery, "edge-1")
        error = await refused(agent, "localhost", port)
        assert error.reason is p.StreamReason.FORBIDDEN
        assert "localhost resolves to" in error.message and "protected" in error.message
        assert refusals(server, "egress_protected") == 1
        # A name rule does not unlock its addresses: CIDR rules naming the ranges do.
        server.apply_routes(RoutesConfig.model_validate({"egress": [
            f"localhost:{port}", f"127.0.0.1/32:{port}",
            {"cidr": "::1/128", "ports": [str(port)]}]}))
        assert await roundtrip(agent, "localhost", port) == b"ping"
        nursery.cancel_scope.cancel()


async def test_a_public_name_is_dialed_at_the_address_checked() -> None:
    public = global_ipv4()
    async with echo_on(public) as port, trio.open_nursery() as nursery:
        server = make_server({"egress": [f"app.example.com:{port}"]})
        answers = [[public], ["127.0.0.1"]]  # the second lookup would rebind to loopback
        lookups: list[str] = []

        async def resolve(host: str, _port: int) -> list[str]:
            lookups.append(host)
            return answers.pop(0) if answers else ["169.254.169.254"]

        server.datapath.resolve = resolve
        agent = await connect(server, nursery, "edge-1")
        assert await roundtrip(agent, "app.example.com", port) == b"ping"
        assert lookups == ["app.example.com"]  # one lookup; the checked address dialed
        # The next stream resolves again and gets loopback: refused.
        error = await refused(agent, "app.example.com", port)
        assert "resolves to 127.0.0.1" in error.message
        assert refusals(server, "egress_protected") == 1
        nursery.cancel_scope.cancel()


async def test_a_name_with_one_protected_address_is_refused_whole() -> None:
    async with trio.open_nursery() as nursery:
        server = make_server({"egress": ["mixed.example.com:*"]})

        async def resolve(host: str, _port: int) -> list[str]:
            return [global_ipv4(), "169.254.169.254"]

        server.datapath.resolve = resolve
        agent = await connect(server, nursery, "edge-1")
        error = await refused(agent, "mixed.example.com", 80)
        assert error.reason is p.StreamReason.FORBIDDEN
        assert "169.254.169.254" in error.message
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "169.254.169.254", "10.96.0.1"])
async def test_direct_ingress_backends_never_reach_the_protected_floor(host: str) -> None:
    async with echo_on("127.0.0.1") as port:
        server = make_server({"protected": ["10.96.0.0/12"]},
                             controller="https://127.0.0.1:1")
        route = Route(name="shop/web", backends=())
        with pytest.raises(UpstreamUnavailable) as info:
            await server.http_backends.open_http_backend(
                Backend(node=None, host=host, port=port), route)
        assert info.value.status == 502
        assert "protected" in str(info.value)
        assert refusals(server, "backend_protected") == 1


async def test_a_direct_ingress_backend_with_a_public_address_is_served() -> None:
    public = global_ipv4()
    async with echo_on(public) as port:
        server = make_server({}, controller="https://127.0.0.1:1")

        async def resolve(host: str, _port: int) -> list[str]:
            return [public]

        server.datapath.resolve = resolve
        route = Route(name="shop/web", backends=())
        stream = await server.http_backends.open_http_backend(
            Backend(node=None, host="backend.example.com", port=port), route)
        await stream.send_all(b"ping")
        assert await stream.receive_some() == b"ping"
        await stream.aclose()
        assert refusals(server, "backend_protected") == 0
