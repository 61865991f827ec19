"""Flows in the protocol core: DATAGRAM frames on streams whose target is udp.

What the core promises (docs/udp.md): a datagram arrives whole or not at all, up to
MAX_DATAGRAM bytes, in the order its flow sent it; a flow without connection credit
queues up to its own bound and then drops (counted by reason), never blocking the
caller; queued flows are served round robin, so one flow's burst does not hold back
another's datagram; the receiver never buffers one. Sockets play no part: two cores
back to back in memory (pair.py), plus a hypothesis state machine.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.tunnel.pair import Pair, handshake
from tests.tunnel.test_protocol_state import frame
from tunnel.protocol import (
    FEATURE_DATAGRAM,
    MAX_DATAGRAM,
    Connection,
    ConnectionTerminated,
    DatagramReceived,
    DatagramsUnsupported,
    ErrorCode,
    FrameType,
    Hello,
    HelloReceived,
    LocalProtocolError,
    Role,
    Settings,
    StreamAccepted,
    StreamClosedError,
    StreamOpened,
    StreamReason,
    Target,
)

UDP = Target("10.96.0.10", 53, "udp")
TCP = Target("10.0.0.1", 80)


def flow(pair: Pair, target: Target = UDP) -> int:
    sid = pair.dialer.open_stream(target)
    _, ev = pair.pump()
    assert isinstance(ev[-1], StreamOpened) and ev[-1].target == target
    pair.acceptor.accept_stream(sid)
    dev, _ = pair.pump()
    assert StreamAccepted(sid) in dev
    return sid


def datagrams(events: list[object], sid: int) -> list[bytes]:
    return [e.data for e in events if isinstance(e, DatagramReceived) and e.stream_id == sid]


def test_both_cores_announce_the_feature() -> None:
    pair = handshake()
    assert pair.dialer.peer_carries_datagrams and pair.acceptor.peer_carries_datagrams
    assert pair.dialer.remote_hello is not None
    assert FEATURE_DATAGRAM in pair.dialer.remote_hello.features


def test_a_peer_without_the_feature_gets_no_flow() -> None:
    # An older peer: its HELLO lacks the feature (sent by hand, bypassing the core).
    acceptor = Connection(Role.ACCEPTOR)
    old = Hello(identity={"node": "old"}).encode()
    (ev,) = acceptor.receive_data(frame(FrameType.HELLO, 0, old))
    assert isinstance(ev, HelloReceived)
    acceptor.accept_handshake(Hello())
    assert not acceptor.peer_carries_datagrams
    with pytest.raises(DatagramsUnsupported):
        acceptor.open_stream(UDP)
    acceptor.open_stream(TCP)  # streams still work


def test_datagrams_keep_their_boundaries_both_ways() -> None:
    pair = handshake()
    sid = flow(pair)
    sizes = [0, 1, 512, 1400, 9000, MAX_DATAGRAM]
    for n in sizes:
        assert pair.dialer.send_datagram(sid, bytes([n % 251]) * n) is None
    _, ev = pair.pump()
    assert datagrams(ev, sid) == [bytes([n % 251]) * n for n in sizes]
    assert pair.acceptor.send_datagram(sid, b"reply") is None
    dev, _ = pair.pump()
    assert datagrams(dev, sid) == [b"reply"]
    assert pair.dialer.stats.datagrams_sent == len(sizes)
    assert pair.acceptor.stats.datagrams_received == len(sizes)


def test_the_largest_ipv4_datagram_passes_intact() -> None:
    pair = handshake()
    sid = flow(pair)
    payload = (bytes(range(256)) * 256)[:65_507]
    assert len(payload) == 65_507
    assert pair.dialer.send_datagram(sid, payload) is None
    _, ev = pair.pump()
    assert datagrams(ev, sid) == [payload]


def test_too_large_for_the_peer_is_dropped_and_counted() -> None:
    pair = handshake(acceptor_settings=Settings(max_frame_size=16 * 1024))
    sid = flow(pair)
    assert pair.dialer.send_datagram(sid, b"x" * (16 * 1024 + 1)) == "too_large"
    assert pair.dialer.send_datagram(sid, b"x" * (MAX_DATAGRAM + 1)) == "too_large"
    assert pair.dialer.stats.datagrams_dropped == {"too_large": 2}
    assert pair.dialer.data_to_send() == b""


def test_datagrams_are_for_flows_only() -> None:
    pair = handshake()
    tcp = flow(pair, TCP)
    with pytest.raises(LocalProtocolError, match="not a flow"):
        pair.dialer.send_datagram(tcp, b"x")
    # A peer that sends one on a TCP stream broke the protocol.
    events = pair.acceptor.receive_data(frame(FrameType.DATAGRAM, tcp, b"x"))
    (end,) = [e for e in events if isinstance(e, ConnectionTerminated)]
    assert end.code is ErrorCode.PROTOCOL_ERROR and "not a flow" in end.message


def test_no_datagram_before_accept_and_none_after_close() -> None:
    pair = handshake()
    sid = pair.dialer.open_stream(UDP)
    with pytest.raises(LocalProtocolError, match="not accepted"):
        pair.dialer.send_datagram(sid, b"x")
    pair.pump()
    pair.acceptor.accept_stream(sid)
    pair.pump()
    pair.dialer.reset_stream(sid, StreamReason.CANCELLED, "idle")
    with pytest.raises(StreamClosedError):
        pair.dialer.send_datagram(sid, b"x")
    # One the peer sent before it learnt of the reset is dropped quietly.
    assert pair.acceptor.send_datagram(sid, b"late") is None
    pair.acceptor.receive_data(b"")  # the acceptor's frames stay queued
    events = pair.dialer.receive_data(frame(FrameType.DATAGRAM, sid, b"late"))
    assert events == [] and pair.dialer.is_open


def test_receiving_returns_credit_without_the_app_acknowledging() -> None:
    small = Settings(connection_window=64 * 1024)
    pair = handshake(dialer_settings=small, acceptor_settings=small)
    sid = flow(pair)
    for _ in range(50):  # 50 x 60 KB through a 64 KiB connection window
        assert pair.dialer.send_datagram(sid, b"d" * 60_000) is None
        pair.pump()
    assert pair.acceptor.stats.datagrams_received == 50
    assert pair.acceptor.unacked_bytes == 0 and pair.dialer.datagrams_queued == 0


def window_blocked_pair() -> tuple[Pair, int, int]:
    """Two flows on a connection whose credit is used up: the next datagrams queue."""
    small = Settings(connection_window=64 * 1024)
    pair = handshake(dialer_settings=small, acceptor_settings=small)
    a, b = flow(pair), flow(pair)
    assert pair.dialer.send_datagram(a, b"w" * 65_000) is None  # the whole window
    return pair, a, b


def test_without_credit_a_flow_queues_up_to_its_bound_then_drops() -> None:
    pair, a, _ = window_blocked_pair()
    d = pair.dialer
    d.datagram_queue_per_flow = 10_000
    for _ in range(10):
        assert d.send_datagram(a, b"q" * 1000) is None
    assert d.send_datagram(a, b"q") == "queue_full"
    assert d.datagrams_queued == 10_000
    assert d.stats.datagrams_dropped == {"queue_full": 1}
    _, ev = pair.pump()  # the window returns; the queue drains in order
    got = datagrams(ev, a)
    assert got[0] == b"w" * 65_000 and got[1:] == [b"q" * 1000] * 10
    assert d.datagrams_queued == 0


def test_the_connection_wide_bound_drops_as_congested() -> None:
    pair, a, b = window_blocked_pair()
    d = pair.dialer
    d.datagram_queue_total = 3000
    assert d.send_datagram(a, b"a" * 2000) is None
    assert d.send_datagram(b, b"b" * 2000) == "congested"
    assert d.stats.datagrams_dropped == {"congested": 1}


def test_queued_flows_are_served_round_robin() -> None:
    """A burst queued on one flow does not hold back the other flow's datagram: when
    credit returns, the other's goes out after at most one of the burst."""
    pair, a, b = window_blocked_pair()
    d = pair.dialer
    for i in range(100):
        assert d.send_datagram(a, b"burst%03d" % i + b"." * 1000) is None
    assert d.send_datagram(b, b"dns-query") is None
    _, ev = pair.pump()
    order = [(e.stream_id, e.data[:9]) for e in ev if isinstance(e, DatagramReceived)]
    position = order.index((b, b"dns-query"))
    assert position <= 2, order[:4]  # the window-filling one, at most one of the burst
    assert len(datagrams(ev, a)) == 101


def test_a_reset_flow_frees_its_queue() -> None:
    pair, _a, b = window_blocked_pair()
    d = pair.dialer
    for _ in range(5):
        d.send_datagram(b, b"x" * 1000)
    assert d.datagrams_queued == 5000
    d.reset_stream(b, StreamReason.CANCELLED, "idle")
    assert d.datagrams_queued == 0
    _, ev = pair.pump()
    assert datagrams(ev, b) == []


def test_a_datagram_beyond_the_connection_window_is_a_flow_control_error() -> None:
    small = Settings(connection_window=64 * 1024)
    pair = handshake(dialer_settings=small, acceptor_settings=small)
    sid = flow(pair)
    events = pair.acceptor.receive_data(
        frame(FrameType.DATAGRAM, sid, b"z" * 60_000) * 2)
    (end,) = [e for e in events if isinstance(e, ConnectionTerminated)]
    assert end.code is ErrorCode.FLOW_CONTROL_ERROR


# ------------------------------------------------------------------ state machine

FUZZ = Settings(max_frame_size=16 * 1024, connection_window=64 * 1024, max_streams=8)


class Flows(RuleBasedStateMachine):
    """Random datagrams on random flows, both ways, with the wire pumped at random
    moments. Invariants: each flow's received datagrams are exactly its sent ones minus
    those dropped (dropped ones counted, the rest whole and in order); queued bytes
    stay within the bounds; nothing is ever unacknowledged."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = handshake(dialer_settings=FUZZ, acceptor_settings=FUZZ)
        for conn in (self.pair.dialer, self.pair.acceptor):
            conn.datagram_queue_per_flow = 40_000
            conn.datagram_queue_total = 100_000
        self.flows: list[int] = []
        self.sent: dict[tuple[str, int], list[bytes]] = {}
        self.got: dict[tuple[str, int], list[bytes]] = {}
        self.closed: set[int] = set()
        self.counter = 0

    def _conn(self, side: str) -> Connection:
        return self.pair.dialer if side == "d" else self.pair.acceptor

    def _collect(self, dev: list[object], aev: list[object]) -> None:
        for side, events in (("a", dev), ("d", aev)):  # who sent what arrived there
            for e in events:
                assert not isinstance(e, ConnectionTerminated), e
                if isinstance(e, DatagramReceived):
                    self.got.setdefault((side, e.stream_id), []).append(e.data)
                elif isinstance(e, StreamOpened):
                    self.pair.acceptor.accept_stream(e.stream_id)

    @rule()
    def open_flow(self) -> None:
        if len(self.flows) < 4:
            sid = self.pair.dialer.open_stream(Target("h", 53, "udp"))
            self._collect(*self.pair.pump())  # OPEN there, ACCEPT queued
            self._collect(*self.pair.pump())  # ACCEPT back
            self.flows.append(sid)

    @precondition(lambda self: self.flows)
    @rule(side=st.sampled_from("da"), size=st.integers(0, 20_000), data=st.data())
    def send(self, side: str, size: int, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.flows))
        if sid in self.closed:
            return
        self.counter += 1
        payload = self.counter.to_bytes(4, "big") + bytes(max(0, size - 4))
        if self._conn(side).send_datagram(sid, payload) is None:
            self.sent.setdefault((side, sid), []).append(payload)

    @precondition(lambda self: self.flows)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.flows))
        self.pair.dialer.reset_stream(sid, StreamReason.CANCELLED, "idle")
        self.closed.add(sid)
        self._collect(*self.pair.pump())

    @rule(rounds=st.integers(1, 3))
    def pump(self, rounds: int) -> None:
        for _ in range(rounds):
            self._collect(*self.pair.pump())

    @invariant()
    def bounded(self) -> None:
        for conn in (self.pair.dialer, self.pair.acceptor):
            assert 0 <= conn.datagrams_queued <= conn.datagram_queue_total
            assert conn.unacked_bytes == 0

    def teardown(self) -> None:
        self._collect(*self.pair.pump())
        for key, sent in self.sent.items():
            got = self.got.get(key, [])
            if key[1] in self.closed:
                assert got == sent[:len(got)]  # a prefix: the rest died with the flow
            else:
                assert got == sent, key


Flows.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
test_flows = Flows.TestCase
