"""Two protocol cores wired back to back in memory (like h11's tests/helpers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tunnel.protocol import (
    Connection,
    DataReceived,
    Event,
    Hello,
    HelloReceived,
    Role,
    Settings,
)


@dataclass
class Pair:
    dialer: Connection
    acceptor: Connection
    dialer_events: list[Event] = field(default_factory=list)
    acceptor_events: list[Event] = field(default_factory=list)

    def pump(self) -> tuple[list[Event], list[Event]]:
        """Move bytes both ways until quiet; return the new events of (dialer, acceptor)."""
        new_d: list[Event] = []
        new_a: list[Event] = []
        while True:
            to_a = self.dialer.data_to_send()
            to_d = self.acceptor.data_to_send()
            if not to_a and not to_d:
                break
            if to_a:
                new_a += self.acceptor.receive_data(to_a)
            if to_d:
                new_d += self.dialer.receive_data(to_d)
        self.dialer_events += new_d
        self.acceptor_events += new_a
        return new_d, new_a


def handshake(dialer_settings: Settings | None = None,
              acceptor_settings: Settings | None = None,
              receive_budget: int | None = None) -> Pair:
    dialer = Connection(Role.DIALER, dialer_settings, receive_budget=receive_budget)
    acceptor = Connection(Role.ACCEPTOR, acceptor_settings, receive_budget=receive_budget)
    dialer.start(Hello(identity={"node": "edge-1"}))
    pair = Pair(dialer, acceptor)
    _, ev = pair.pump()
    assert isinstance(ev[0], HelloReceived)
    acceptor.accept_handshake(Hello(identity={"server": "s1"}))
    pair.pump()
    assert dialer.is_open and acceptor.is_open
    return pair


def received_bytes(events: list[Event], stream_id: int) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, DataReceived)
                    and e.stream_id == stream_id)
