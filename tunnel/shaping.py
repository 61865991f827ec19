"""Bandwidth shaping of one tunnel: a transport wrapper that paces its bytes each way.

`ShapedTransport` wraps the transport of one node's tunnel; `Shaper` holds its rates
(bytes per second toward the peer and from it, None for unlimited), which the owner may
change at any time. Pacing is a token bucket that may go into debt (`ByteBucket`): a send
or receive of n bytes takes n tokens, and when the bucket is in debt the call sleeps until
it is not, so the average rate holds and a burst of `burst` bytes passes at once. The
sleep is in the task that sends or receives on *that* transport: another node's tunnel
has its own tasks and its own socket, so a slow (shaped) node never delays another's
traffic. A shaped transport also asks the endpoint to queue at most a tenth of a second
of output (`send_high_water`), so a keepalive PING's answer never waits seconds behind
the node's bulk. Slowing the receive side stops reading the socket, and TCP's flow
control then slows the peer's sends: nothing is dropped and nothing buffers here beyond
one receive; but what the peer already sent (up to the tunnel's window) is read at the
rate, so a low `from_node` rate delays the peer's PINGs too (docs/limits.md).

`ByteBucket` is pure (the clock is passed in) and tested with made-up times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from tunnel.transports import PeerInfo, Transport


class ByteBucket:
    """`rate` bytes a second, up to `burst` saved; `take(n, now)` may leave it in debt and
    returns how long until it is out of it (0.0: no wait)."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def take(self, n: int, now: float) -> float:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


@dataclass
class Shaper:
    """The rates of one tunnel, changeable while it runs (`set`), and what it moved."""

    rate_out: float | None = None  # bytes/s toward the peer
    rate_in: float | None = None  # bytes/s from the peer
    burst_seconds: float = 0.1
    """The burst, as seconds of the rate (at least 64 KiB: a tunnel frame passes whole)."""
    out_bucket: ByteBucket | None = field(default=None, repr=False)
    in_bucket: ByteBucket | None = field(default=None, repr=False)
    waited_out: float = 0.0  # seconds sends waited for the rate
    waited_in: float = 0.0

    def __post_init__(self) -> None:
        self.set(self.rate_out, self.rate_in)

    def set(self, rate_out: float | None, rate_in: float | None) -> None:
        now = trio.current_time() if _in_trio() else 0.0
        self.rate_out, self.rate_in = rate_out, rate_in
        self.out_bucket = None if rate_out is None else ByteBucket(
            rate_out, max(65536.0, rate_out * self.burst_seconds), now)
        self.in_bucket = None if rate_in is None else ByteBucket(
            rate_in, max(65536.0, rate_in * self.burst_seconds), now)

    def as_dict(self) -> dict[str, float | None]:
        return {"rate_out": self.rate_out, "rate_in": self.rate_in,
                "waited_out_seconds": round(self.waited_out, 3),
                "waited_in_seconds": round(self.waited_in, 3)}


def _in_trio() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


class ShapedTransport(Transport):
    """`inner`, paced by `shaper` (see the module docstring). Unshaped, one extra call."""

    def __init__(self, inner: Transport, shaper: Shaper | None = None) -> None:
        self.inner = inner
        self.shaper = shaper if shaper is not None else Shaper()

    @property
    def peer(self) -> PeerInfo:
        return self.inner.peer

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send(data)
        shaper = self.shaper
        bucket = shaper.out_bucket
        if bucket is not None and data:
            wait = bucket.take(len(data), trio.current_time())
            if wait:
                shaper.waited_out += wait
                await trio.sleep(wait)

    @property
    def send_high_water(self) -> int | None:
        # A tenth of a second of output queued at most: a PING's answer (and any stream's
        # frame) never waits long behind this node's bulk, whatever its rate.
        rate = self.shaper.rate_out
        return None if rate is None else int(max(16384.0, rate * 0.1))

    def can_send_nowait(self) -> bool:
        # Shaped: every send goes through send(), which paces.
        return self.shaper.out_bucket is None and self.inner.can_send_nowait()

    def send_nowait(self, data: bytes | bytearray | memoryview) -> bool:
        return self.inner.send_nowait(data)

    def send_pieces_nowait(self, pieces: list[bytes | memoryview]) -> bool:
        return self.inner.send_pieces_nowait(pieces)

    def unacknowledged_wait(self) -> float | None:
        return self.inner.unacknowledged_wait()

    async def receive(self) -> bytes:
        data = await self.inner.receive()
        shaper = self.shaper
        bucket = shaper.in_bucket
        if bucket is not None and data:
            wait = bucket.take(len(data), trio.current_time())
            if wait:
                shaper.waited_in += wait
                await trio.sleep(wait)
        return data

    async def receive_view(self) -> bytes | memoryview:
        if self.shaper.in_bucket is not None:  # paced: a wait follows the read
            return await self.receive()
        return await self.inner.receive_view()

    async def aclose(self) -> None:
        await self.inner.aclose()


__all__ = ["ByteBucket", "ShapedTransport", "Shaper"]
