"""Property tests: the protocol core under random and adversarial input.

Whatever bytes a peer sends, the core never raises, never buffers more than one frame
of input, never lets unread data exceed budget + window, and ends either still healthy
or with a ConnectionTerminated that queued a GOAWAY for the peer.
"""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.tunnel.pair import handshake
from tunnel.protocol import (
    HEADER,
    HEADER_SIZE,
    Connection,
    ConnectionTerminated,
    DataReceived,
    FrameType,
    Hello,
    Role,
    Settings,
    StreamAccepted,
    StreamEnded,
    StreamOpened,
    StreamReason,
    StreamRefused,
    StreamReset,
    StreamState,
    Target,
)

MIRROR = {
    StreamState.IDLE: StreamState.IDLE,
    StreamState.OPEN_SENT: StreamState.OPEN_RECEIVED,
    StreamState.OPEN_RECEIVED: StreamState.OPEN_SENT,
    StreamState.OPEN: StreamState.OPEN,
    StreamState.HALF_CLOSED_LOCAL: StreamState.HALF_CLOSED_REMOTE,
    StreamState.HALF_CLOSED_REMOTE: StreamState.HALF_CLOSED_LOCAL,
    StreamState.CLOSED: StreamState.CLOSED,
}
SETTINGS = Settings(max_frame_size=16 * 1024, initial_stream_window=64 * 1024,
                    connection_window=256 * 1024, max_streams=16)
BUDGET = 512 * 1024


def _frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload) << 8 | ftype, flags, sid) + payload


frames = st.builds(
    _frame,
    st.sampled_from([*list(range(10)), 66, 255]),
    st.integers(0, 255),
    st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)),
    st.one_of(
        st.binary(max_size=64),
        st.just(b'{"host":"h","port":80}'),
        st.just(b'{"proto":"udp","host":"h","port":53}'),
        st.just(struct.pack("!I", 1024)),
        st.just(bytes([StreamReason.REFUSED]) + b"no"),
        st.just(b"\x00" * 8),
    ),
)
streams_of_input = st.lists(st.one_of(frames, st.binary(max_size=200)), max_size=40)


def _check_bounds(conn: Connection) -> None:
    assert len(conn._inbuf) < HEADER_SIZE + SETTINGS.max_frame_size
    assert conn.unacked_bytes <= BUDGET + SETTINGS.connection_window


def _feed(conn: Connection, chunks: list[bytes], split: int) -> None:
    data = b"".join(chunks)
    for i in range(0, len(data), split):
        events = conn.receive_data(data[i:i + split])
        _check_bounds(conn)
        if any(isinstance(ev, ConnectionTerminated) for ev in events):
            # Terminated part-way through this batch: events before it are still
            # reported, but nothing may be answered any more.
            assert conn.is_closed and isinstance(events[-1], ConnectionTerminated)
            return
        for ev in events:
            if isinstance(ev, ConnectionTerminated):
                assert not ev.by_peer or ev.code is not None
                assert conn.is_closed
                return
            if isinstance(ev, StreamOpened):
                # As the endpoint does: a stream the peer reset later in the same read
                # is gone, and answering it is the caller's error (StreamClosedError).
                if conn.has_stream(ev.stream_id):
                    conn.accept_stream(ev.stream_id)
                else:
                    assert any(isinstance(later, StreamReset)
                               and later.stream_id == ev.stream_id for later in events)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams_of_input, st.integers(1, 64))
def test_random_input_after_handshake_never_crashes(chunks: list[bytes], split: int) -> None:
    pair = handshake(acceptor_settings=SETTINGS, receive_budget=BUDGET)
    pair.dialer.open_stream(Target("h", 1))
    pair.dialer.open_stream(Target("h", 53, "udp"))  # a flow: DATAGRAM frames meet one
    pair.pump()
    _feed(pair.acceptor, chunks, split)


@settings(max_examples=300, deadline=None)
@given(streams_of_input, st.integers(1, 64))
def test_random_input_before_handshake_never_crashes(chunks: list[bytes], split: int) -> None:
    conn = Connection(Role.ACCEPTOR, SETTINGS, receive_budget=BUDGET)
    _feed(conn, chunks, split)
    dialer = Connection(Role.DIALER, SETTINGS, receive_budget=BUDGET)
    dialer.start(Hello())
    dialer.data_to_send()
    _feed(dialer, chunks, split)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=4096))
def test_a_protocol_error_always_tells_the_peer(garbage: bytes) -> None:
    pair = handshake(acceptor_settings=SETTINGS, receive_budget=BUDGET)
    events = pair.acceptor.receive_data(garbage)
    if any(isinstance(e, ConnectionTerminated) for e in events):
        back = pair.dialer.receive_data(pair.acceptor.data_to_send())
        assert any(isinstance(e, ConnectionTerminated) and e.by_peer for e in back)


class TwoPeers(RuleBasedStateMachine):
    """Random API calls on both sides; every byte sent on a stream arrives once, in
    order, unless the stream was reset."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = handshake(dialer_settings=SETTINGS, acceptor_settings=SETTINGS,
                              receive_budget=BUDGET)
        self.sent: dict[tuple[str, int], bytearray] = {}
        self.got: dict[tuple[str, int], bytearray] = {}
        self.reset: set[int] = set()
        self.accepted: set[int] = set()
        self.fin_sent: set[tuple[str, int]] = set()

    def _side(self, name: str) -> Connection:
        return self.pair.dialer if name == "d" else self.pair.acceptor

    def _pump(self) -> None:
        while self._pump_once():
            pass

    def _pump_once(self) -> bool:
        dev, aev = self.pair.pump()
        for name, events in (("d", dev), ("a", aev)):
            other = "a" if name == "d" else "d"
            conn = self._side(name)
            for ev in events:
                assert not isinstance(ev, ConnectionTerminated), ev
                if isinstance(ev, StreamOpened):
                    conn.accept_stream(ev.stream_id)
                    self.accepted.add(ev.stream_id)
                elif isinstance(ev, StreamAccepted):
                    self.accepted.add(ev.stream_id)
                elif isinstance(ev, DataReceived):
                    self.got.setdefault((other, ev.stream_id), bytearray()).extend(ev.data)
                    conn.acknowledge_received_data(ev.stream_id, len(ev.data))
                elif isinstance(ev, StreamReset | StreamRefused):
                    self.reset.add(ev.stream_id)
                elif isinstance(ev, StreamEnded):
                    pass
        return bool(dev or aev)

    @rule(side=st.sampled_from(["d", "a"]))
    def open(self, side: str) -> None:
        conn = self._side(side)
        if conn.can_open_stream():
            conn.open_stream(Target("svc", 80))
        self._pump()

    @precondition(lambda self: self.accepted)
    @rule(side=st.sampled_from(["d", "a"]), n=st.integers(0, 100_000), data=st.data())
    def send(self, side: str, n: int, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.accepted)))
        conn = self._side(side)
        if (side, sid) in self.fin_sent or not conn.has_stream(sid):
            return
        n = min(n, conn.send_window(sid))
        payload = bytes([sid % 251]) * n
        fin = data.draw(st.booleans())
        if n or fin:
            conn.send_data(sid, payload, end_stream=fin)
            self.sent.setdefault((side, sid), bytearray()).extend(payload)
            if fin:
                self.fin_sent.add((side, sid))
        self._pump()

    @precondition(lambda self: self.accepted)
    @rule(side=st.sampled_from(["d", "a"]), data=st.data())
    def reset_one(self, side: str, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.accepted)))
        if self._side(side).has_stream(sid):
            self._side(side).reset_stream(sid, StreamReason.CANCELLED)
            self.reset.add(sid)
        self._pump()

    @invariant()
    def bytes_arrive_in_order(self) -> None:
        for key, sent in self.sent.items():
            if key[1] in self.reset:
                continue
            assert bytes(self.got.get(key, b"")) == bytes(sent)

    @invariant()
    def both_sides_agree_on_every_stream_state(self) -> None:
        # After a pump nothing is in flight, so each side's view of a stream mirrors
        # the other's (our FIN is their remote FIN).
        d, a = self.pair.dialer, self.pair.acceptor
        for sid in range(1, max(self.accepted | self.reset | {0}) + 1):
            assert a.stream_state(sid) is MIRROR[d.stream_state(sid)], sid

    @invariant()
    def nothing_unacked_after_pump(self) -> None:
        assert self.pair.dialer.unacked_bytes == 0
        assert self.pair.acceptor.unacked_bytes == 0


TwoPeers.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_two_peers = TwoPeers.TestCase
_ = FrameType
