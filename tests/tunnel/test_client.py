"""TunnelClient.open_stream: the agent side's one way to open streams to the server."""

from __future__ import annotations

import pytest
import trio

from tests.tunnel.test_endpoint import linked
from tunnel import protocol as p
from tunnel.client import TunnelClient
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
        tc.connection = link.dialer

        async def kill_when_pending() -> None:
            await answered.wait()
            await link.acceptor.aclose(p.ErrorCode.NO_ERROR, "server going away")

        link.nursery.start_soon(kill_when_pending)
        with pytest.raises(StreamRefusedError) as info:
            await tc.open_stream(T)
        assert info.value.reason is p.StreamReason.UNREACHABLE
        assert "server going away" in info.value.message
