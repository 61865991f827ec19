"""TunnelClient.open_stream: the agent side's one way to open streams to the server."""

from __future__ import annotations

import pytest
import trio

from tests.tunnel.test_endpoint import linked
from tunnel import protocol as p
from tunnel.client import Tunnel, TunnelClient
from tunnel.endpoint import IncomingStream, StreamRefusedError
from tunnel.transports import Endpoint

T = p.Target("svc", 80)


def client() -> TunnelClient:
    return TunnelClient(Endpoint("tcp", "127.0.0.1", 9), hello=lambda: p.Hello(),
                        handler=None)


async def test_no_connection_is_unreachable() -> None:
    with pytest.raises(StreamRefusedError) as info:
        await client().open_stream(T)
    assert info.value.reason is p.StreamReason.UNREACHABLE


async def test_connection_ending_during_an_open_is_unreachable_not_a_crash() -> None:
    """Callers (the interceptor, the config watch) handle StreamRefusedError; a raw
    TunnelClosedError from a connection that died mid-OPEN would escape them."""
    answered = trio.Event()

    async def never_answers(incoming: IncomingStream) -> None:
        answered.set()
        await trio.sleep_forever()

    tc = client()
    async with linked(acceptor_handler=never_answers) as link:
        tc.tunnels.append(Tunnel(link.dialer, tc.endpoint, "s", 0.0))

        async def kill_when_pending() -> None:
            await answered.wait()
            await link.acceptor.aclose(p.ErrorCode.NO_ERROR, "server going away")

        link.nursery.start_soon(kill_when_pending)
        with pytest.raises(StreamRefusedError) as info:
            await tc.open_stream(T)
        assert info.value.reason is p.StreamReason.UNREACHABLE
        assert "server going away" in info.value.message


async def test_a_stream_moves_to_the_next_tunnel_at_once_when_one_ends_or_drains() -> None:
    """Several replicas: an OPEN on a tunnel that ends meanwhile, or one that drains
    (GOAWAY), is retried on the next live tunnel at once: no backoff, no error."""
    answered = trio.Event()

    async def never_answers(incoming: IncomingStream) -> None:
        answered.set()
        await trio.sleep_forever()

    tc = client()
    async with linked(acceptor_handler=never_answers) as dead, linked() as alive, \
            linked() as draining:
        tc.tunnels += [Tunnel(dead.dialer, tc.endpoint, "a", 0.0),
                       Tunnel(alive.dialer, tc.endpoint, "b", 0.0)]

        async def kill_when_pending() -> None:
            await answered.wait()
            await dead.acceptor.aclose(p.ErrorCode.NO_ERROR, "replica killed")

        dead.nursery.start_soon(kill_when_pending)
        with trio.fail_after(2):
            stream = await tc.open_stream(T)
        assert stream.connection is alive.dialer
        await stream.send_all(b"x")
        await stream.send_eof()
        assert await stream.receive_some() == b"x"
        assert [t.server_id for t in tc.live()] == ["b"]
        # A tunnel whose server sent GOAWAY takes no new streams; its peer still works.
        draining.acceptor.goaway("rolling out")
        with trio.fail_after(2):
            await draining.dialer.goaway_received.wait()
        tc.tunnels.insert(0, Tunnel(draining.dialer, tc.endpoint, "c", 0.0))
        assert [t.server_id for t in tc.live()] == ["b"]
        second = await tc.open_stream(T)
        assert second.connection is alive.dialer
