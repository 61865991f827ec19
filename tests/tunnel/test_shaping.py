"""Bandwidth shaping of a tunnel: the byte bucket with made-up times, and a shaped
transport on memory streams under trio's mock clock (virtual time: exact, no flakes):
a shaped tunnel moves about its rate each way, an unshaped one beside it is not slowed,
and rates change while the tunnel runs."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.tunnel.memtransport import memory_transport_pair
from tunnel.shaping import ByteBucket, ShapedTransport, Shaper


def test_bucket_goes_into_debt_and_says_how_long() -> None:
    bucket = ByteBucket(rate=1000.0, burst=500.0, now=0.0)
    assert bucket.take(500, 0.0) == 0.0  # the burst passes at once
    assert bucket.take(1000, 0.0) == pytest.approx(1.0)  # 1000 bytes of debt at 1000/s
    assert bucket.take(0, 0.5) == pytest.approx(0.5)  # half of it paid
    assert bucket.take(0, 10.0) == 0.0 and bucket.tokens == 500.0  # never above burst


async def _pump(sender: ShapedTransport, receiver: ShapedTransport, total: int,
                chunk: int = 16384) -> float:
    start = trio.current_time()

    async def send() -> None:
        for _ in range(total // chunk):
            await sender.send(b"x" * chunk)

    got, total = 0, total // chunk * chunk
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        while got < total:
            got += len(await receiver.receive())
    return trio.current_time() - start


async def test_a_shaped_tunnel_moves_its_rate_and_another_is_not_slowed(
        autojump_clock: trio.testing.MockClock) -> None:
    rate = 100_000.0
    a_out, a_in = memory_transport_pair()
    b_out, b_in = memory_transport_pair()
    shaped_send = ShapedTransport(a_out, Shaper(rate_out=rate))
    shaped_recv = ShapedTransport(a_in)
    free_send, free_recv = ShapedTransport(b_out), ShapedTransport(b_in)
    took: dict[str, float] = {}

    async def run(name: str, s: ShapedTransport, r: ShapedTransport) -> None:
        took[name] = await _pump(s, r, 1_000_000)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "shaped", shaped_send, shaped_recv)
        nursery.start_soon(run, "free", free_send, free_recv)
    # 1 MB at 100 kB/s, less the 64 KiB burst: about 9.3 s of virtual time.
    assert 8.5 < took["shaped"] < 10.5
    assert took["free"] < 0.1  # the other tunnel never waited for the shaped one
    assert shaped_send.shaper.waited_out > 8


async def test_the_receive_side_paces_and_rates_change_while_running(
        autojump_clock: trio.testing.MockClock) -> None:
    a, b = memory_transport_pair()
    sender, receiver = ShapedTransport(a), ShapedTransport(b, Shaper(rate_in=200_000.0))
    took = await _pump(sender, receiver, 1_000_000)
    assert 4.0 < took < 5.5
    receiver.shaper.set(None, None)  # lifted: no more waiting
    assert await _pump(sender, receiver, 1_000_000) < 0.1
    receiver.shaper.set(None, 1_000_000.0)
    assert 0.8 < await _pump(sender, receiver, 1_000_000) < 1.2


async def test_an_unshaped_transport_keeps_the_send_nowait_fast_path() -> None:
    a, _ = memory_transport_pair()
    shaped = ShapedTransport(a)
    assert shaped.can_send_nowait() == a.can_send_nowait()
    shaped.shaper.set(1e6, None)
    assert not shaped.can_send_nowait()
