"""The HELLO exchange that opens every tunnel connection, on a protocol core and a transport.

`dial_handshake()` (the agent: send our HELLO, wait for the acceptor's) and
`accept_handshake()` (the server: read the dialer's HELLO, let a vetting function decide,
answer or refuse) run before the connection's reader and writer tasks exist, so they do
their own reads and writes through a `HandshakeChannel` and bound them with one deadline.
Every failure is a HandshakeError; the connection the handshake was for is then closed.

`TunnelConnection` (endpoint.py) calls these with its core and transport and takes over
from the `Handshaken` result: the peer's HELLO and the events that arrived in the same
read after it (the peer may send frames right behind its HELLO).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from tunnel import protocol as p
from tunnel.errors import HandshakeError, HandshakeRefused
from tunnel.transports import PeerInfo, Transport, TransportError

# Vets the dialer's HELLO and returns ours, or raises HandshakeRefused.
Vetter = Callable[[p.Hello, PeerInfo], Awaitable[p.Hello]]


@dataclass
class Handshaken:
    """A completed handshake: the peer's HELLO, and events read behind it, to dispatch
    once the connection runs."""

    hello: p.Hello
    early_events: list[p.Event]


class HandshakeChannel:
    """A protocol core and its transport while no reader or writer task runs yet: reads
    turn into the core's events, the core's output is written at once. Counts the bytes
    either way (the connection adds them to its own)."""

    def __init__(self, core: p.Connection, transport: Transport) -> None:
        self.core = core
        self.transport = transport
        self.bytes_in = 0
        self.bytes_out = 0

    async def receive_events(self) -> list[p.Event]:
        try:
            data = await self.transport.receive()
        except TransportError as exc:
            raise HandshakeError(f"transport failed: {exc}", p.ErrorCode.INTERNAL_ERROR,
                                 transport=True) from None
        self.bytes_in += len(data)
        return self.core.receive_data(data)

    async def flush(self) -> None:
        data = self.core.data_to_send()
        if data:
            try:
                await self.transport.send(data)
            except TransportError as exc:
                raise HandshakeError(f"transport failed: {exc}",
                                     p.ErrorCode.INTERNAL_ERROR, transport=True) from None
            self.bytes_out += len(data)

    async def flush_and_close(self) -> None:
        """Send what the core queued last (a refusal, a GOAWAY) if the peer takes it
        within a second, then close the transport."""
        with trio.move_on_after(1):
            try:
                await self.flush()
            except HandshakeError:
                pass
        await self.transport.aclose()


async def dial_handshake(channel: HandshakeChannel, hello: p.Hello, *,
                         within: float) -> Handshaken:
    """Dialer: send our HELLO, wait up to `within` seconds for the acceptor's. Raises
    HandshakeError (a refusal carries the acceptor's code and retry-after)."""
    channel.core.start(hello)
    with trio.move_on_after(within) as scope:
        await channel.flush()
        while True:
            events = await channel.receive_events()
            for index, event in enumerate(events):
                if isinstance(event, p.HandshakeCompleted):
                    return Handshaken(event.hello, events[index + 1:])
                if isinstance(event, p.ConnectionTerminated):
                    await channel.flush_and_close()
                    raise HandshakeError(event.message, event.code, event.retry_after)
    assert scope.cancelled_caught
    raise HandshakeError(f"no answer to HELLO within {within}s",
                         p.ErrorCode.KEEPALIVE_TIMEOUT)


async def accept_handshake(channel: HandshakeChannel, vet: Vetter, *,
                           within: float) -> Handshaken:
    """Acceptor: read the dialer's HELLO within `within` seconds, let `vet` check it and return
    our HELLO (or raise HandshakeRefused, e.g. AuthenticationFailed), answer. Raises
    HandshakeError; the result holds the dialer's HELLO."""
    core = channel.core
    with trio.move_on_after(within):
        while True:
            events = await channel.receive_events()
            for index, event in enumerate(events):
                if isinstance(event, p.ConnectionTerminated):
                    await channel.flush_and_close()
                    raise HandshakeError(event.message, event.code)
                if isinstance(event, p.HelloReceived):
                    try:
                        ours = await vet(event.hello, channel.transport.peer)
                    except HandshakeRefused as exc:
                        if not core.is_closed:
                            core.refuse_handshake(exc.code, str(exc), exc.retry_after)
                        await channel.flush_and_close()
                        raise HandshakeError(str(exc), exc.code, exc.retry_after) from None
                    if core.is_closed:
                        # The read that brought the HELLO also broke the protocol (a
                        # frame before our answer): the core has ended the connection.
                        ended = next((e for e in events[index + 1:]
                                      if isinstance(e, p.ConnectionTerminated)), None)
                        await channel.flush_and_close()
                        raise HandshakeError(
                            ended.message if ended else "connection closed",
                            ended.code if ended else p.ErrorCode.PROTOCOL_ERROR)
                    core.accept_handshake(ours)
                    await channel.flush()
                    return Handshaken(event.hello, [])
    core.close(p.ErrorCode.KEEPALIVE_TIMEOUT, "no HELLO in time")
    await channel.flush_and_close()
    raise HandshakeError(f"no HELLO within {within}s", p.ErrorCode.KEEPALIVE_TIMEOUT)


__all__ = ["HandshakeChannel", "Handshaken", "Vetter", "accept_handshake", "dial_handshake"]
