"""The stream state table (tunnel/protocol/state.py) against the Connection that uses it.

Every (state, event) cell is driven through a real Connection: an allowed cell must lead
to exactly the state the table names, a missing one must fail the way the table's
docstring says (protocol error for a received frame, LocalProtocolError or
StreamClosedError for an action of ours, nothing sent for RST and WINDOW). A property
test then applies random sequences of frames and actions and checks each step against
the table, so no path reaches a state the table does not lead to.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tunnel.pair import Pair, handshake
from tunnel.protocol import (
    FLAG_FIN,
    HEADER,
    STREAM_TRANSITIONS,
    Connection,
    ConnectionTerminated,
    ErrorCode,
    Event,
    FrameType,
    LocalProtocolError,
    Settings,
    StreamClosedError,
    StreamEvent,
    StreamOpened,
    StreamReason,
    StreamState,
    Target,
)
from tunnel.protocol.state import LIVE_STATES, TRANSITIONS_BY_EVENT

S = StreamState
E = StreamEvent
T = Target("127.0.0.1", 8080)
# Datagram cells run on a flow (a stream whose target is udp): DATAGRAM is for flows only.
U = Target("127.0.0.1", 53, "udp")
DATAGRAM_EVENTS = {StreamEvent.SEND_DATAGRAM, StreamEvent.RECV_DATAGRAM}
# Small stream windows for the dialer (the side under test), so that acknowledging a
# few bytes is enough to send a WINDOW.
DIALER = Settings(initial_stream_window=8)
OPEN_PAYLOAD = b'{"proto":"tcp","host":"h","port":1,"meta":{}}'

SEND_ACTIONS = {E.SEND_ACCEPT, E.SEND_REFUSE, E.SEND_DATA, E.SEND_FIN, E.SEND_DATAGRAM}
QUIET_WHEN_MISSING = {E.SEND_RST, E.SEND_WINDOW, E.RECV_GOAWAY}
# open_stream() picks a fresh id itself, so it can only ever meet an IDLE one.
NOT_EXPRESSIBLE = {(state, E.SEND_OPEN) for state in S if state is not S.IDLE}


def frame(ftype: int, stream_id: int, payload: bytes = b"", flags: int = 0) -> bytes:
    return HEADER.pack(len(payload) << 8 | ftype, flags, stream_id) + payload


RECEIVED_FRAMES: dict[StreamEvent, Callable[[int], bytes]] = {
    E.RECV_OPEN: lambda sid: frame(FrameType.OPEN, sid, OPEN_PAYLOAD),
    E.RECV_ACCEPT: lambda sid: frame(FrameType.ACCEPT, sid),
    E.RECV_REFUSE: lambda sid: frame(FrameType.REFUSE, sid, bytes([StreamReason.REFUSED])),
    E.RECV_DATA: lambda sid: frame(FrameType.DATA, sid, b"x"),
    E.RECV_FIN: lambda sid: frame(FrameType.DATA, sid, b"x", FLAG_FIN),
    E.RECV_DATAGRAM: lambda sid: frame(FrameType.DATAGRAM, sid, b"dgram"),
    E.RECV_WINDOW: lambda sid: frame(FrameType.WINDOW, sid, struct.pack("!I", 1)),
    E.RECV_RST: lambda sid: frame(FrameType.RST, sid, bytes([StreamReason.CANCELLED])),
    # A drain that refuses every stream the dialer opened from `sid` on.
    E.RECV_GOAWAY: lambda sid: frame(FrameType.GOAWAY, 0, struct.pack("!IB", sid - 1, 0)),
}


def frames_for(data: bytes, stream_id: int) -> list[tuple[int, int]]:
    """(type, flags) of every frame for stream_id in `data`."""
    found, offset = [], 0
    while offset < len(data):
        word, flags, sid = HEADER.unpack_from(data, offset)
        if sid == stream_id:
            found.append((word & 0xFF, flags))
        offset += HEADER.size + (word >> 8)
    return found


def stream_in(pair: Pair, state: StreamState, target: Target = T) -> int:
    """Bring one stream of pair.dialer to `state`; returns its id."""
    d, a = pair.dialer, pair.acceptor
    if state is S.IDLE:
        return 2  # the acceptor's first id: the dialer has not seen it
    if state is S.OPEN_RECEIVED:
        sid = a.open_stream(target)
        pair.pump()
        return sid
    sid = d.open_stream(target)
    pair.pump()
    if state is S.OPEN_SENT:
        return sid
    a.accept_stream(sid)
    pair.pump()
    if state is S.HALF_CLOSED_LOCAL:
        d.end_stream(sid)
    elif state is S.HALF_CLOSED_REMOTE:
        a.end_stream(sid)
    elif state is S.CLOSED:
        d.reset_stream(sid)
    pair.pump()
    return sid


def give_dialer_unread_bytes(pair: Pair, size: int) -> None:
    """Data received on a stream of its own, so the dialer has `size` bytes to ack."""
    sid = pair.dialer.open_stream(T)
    pair.pump()
    pair.acceptor.accept_stream(sid)
    pair.acceptor.send_data(sid, b"y" * size)
    pair.pump()
    assert pair.dialer.unacked_bytes == size


def act(conn: Connection, event: StreamEvent, sid: int) -> list[Event]:
    """Do `event` for stream sid on conn; returns the events a received frame gave."""
    if event is E.SEND_OPEN:
        assert conn.open_stream(T) == sid
    elif event is E.SEND_ACCEPT:
        conn.accept_stream(sid)
    elif event is E.SEND_REFUSE:
        conn.refuse_stream(sid, StreamReason.REFUSED)
    elif event is E.SEND_DATA:
        conn.send_data(sid, b"x")
    elif event is E.SEND_FIN:
        conn.end_stream(sid)
    elif event is E.SEND_WINDOW:
        conn.acknowledge_received_data(sid, DIALER.initial_stream_window // 2)
    elif event is E.SEND_RST:
        conn.reset_stream(sid)
    elif event is E.SEND_DATAGRAM:
        assert conn.send_datagram(sid, b"dgram") is None
    else:
        return conn.receive_data(RECEIVED_FRAMES[event](sid))
    return []


CELLS = [cell for cell in itertools.product(S, E) if cell not in NOT_EXPRESSIBLE]


def test_the_table_is_consistent() -> None:
    assert set(STREAM_TRANSITIONS) == set(S)
    # A FIN frame carries data: FIN is allowed exactly where DATA is.
    assert set(TRANSITIONS_BY_EVENT[E.RECV_FIN]) == set(TRANSITIONS_BY_EVENT[E.RECV_DATA])
    assert set(TRANSITIONS_BY_EVENT[E.SEND_FIN]) == set(TRANSITIONS_BY_EVENT[E.SEND_DATA])
    # Nothing leads back to IDLE, CLOSED is left by nothing, every live state is reachable.
    targets = {nxt for row in STREAM_TRANSITIONS.values() for nxt in row.values()}
    assert S.IDLE not in targets and LIVE_STATES <= targets
    assert set(STREAM_TRANSITIONS[S.CLOSED].values()) == {S.CLOSED}
    # Only received frames may arrive for a closed stream (and they are dropped).
    assert all(event.name.startswith("RECV_") for event in STREAM_TRANSITIONS[S.CLOSED])


@pytest.mark.parametrize(("state", "event"), CELLS, ids=[f"{s.name}-{e.name}" for s, e in CELLS])
def test_every_cell_of_the_table(state: StreamState, event: StreamEvent) -> None:
    pair = handshake(dialer_settings=DIALER)
    d = pair.dialer
    if event is E.SEND_WINDOW:
        give_dialer_unread_bytes(pair, DIALER.initial_stream_window // 2)
    target = U if event in DATAGRAM_EVENTS else T
    sid = 1 if event is E.SEND_OPEN else stream_in(pair, state, target)
    assert d.stream_state(sid) is state
    d.data_to_send()
    expected = STREAM_TRANSITIONS[state].get(event)

    if expected is not None:
        events = act(d, event, sid)
        assert not any(isinstance(e, ConnectionTerminated) for e in events)
        assert d.is_open and d.stream_state(sid) is expected
        assert d.has_stream(sid) == (expected in LIVE_STATES)
        sent = frames_for(d.data_to_send(), sid)
        if event.name.startswith("SEND_"):
            assert sent, "an allowed action puts its frame on the wire"
        if state is S.CLOSED:
            assert not any(getattr(e, "stream_id", None) == sid for e in events)
        return

    if event in QUIET_WHEN_MISSING:
        act(d, event, sid)
        assert d.is_open and d.stream_state(sid) is state
        assert frames_for(d.data_to_send(), sid) == []
    elif event in SEND_ACTIONS:
        gone = state in (S.IDLE, S.CLOSED)
        with pytest.raises(LocalProtocolError) as info:
            act(d, event, sid)
        assert isinstance(info.value, StreamClosedError) == gone
        assert d.is_open and d.stream_state(sid) is state
        assert frames_for(d.data_to_send(), sid) == []
    else:
        (end,) = [e for e in act(d, event, sid) if isinstance(e, ConnectionTerminated)]
        assert end.code is ErrorCode.PROTOCOL_ERROR and not end.by_peer
        assert d.is_closed


def test_open_stream_always_takes_an_idle_id() -> None:
    pair = handshake()
    for _ in range(3):
        nxt = pair.dialer.stream_ids()[-1] + 2 if pair.dialer.stream_ids() else 1
        assert pair.dialer.stream_state(nxt) is S.IDLE
        assert pair.dialer.open_stream(T) == nxt
        assert pair.dialer.stream_state(nxt) is S.OPEN_SENT


# ------------------------------------------------------------------ random sequences

LOCAL_IDS = (1, 3, 5)
REMOTE_IDS = (2, 4, 6)
# SEND_WINDOW needs unread data and credit bookkeeping; the cell test covers it.
# The datagram events need flows (tests/tunnel/test_protocol_datagram.py); the cell test
# covers each of them.
RANDOM_EVENTS = [e for e in E if e is not E.SEND_WINDOW and e not in DATAGRAM_EVENTS]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(RANDOM_EVENTS),
                          st.sampled_from(LOCAL_IDS + REMOTE_IDS)), max_size=30))
def test_random_sequences_follow_the_table(steps: list[tuple[StreamEvent, int]]) -> None:
    """Model check: after each step every stream is where the table says, and a step the
    table forbids changed nothing or ended the connection with a protocol error."""
    d = handshake().dialer
    d.data_to_send()
    ids = LOCAL_IDS + REMOTE_IDS
    for event, sid in steps:
        if event is E.SEND_OPEN:
            # A drain forbids new streams on the whole connection, not per stream.
            if d.is_draining or d.stream_state(LOCAL_IDS[-1]) is not S.IDLE:
                continue
            sid = next(i for i in LOCAL_IDS if d.stream_state(i) is S.IDLE)
        before = {i: d.stream_state(i) for i in ids}
        expected = dict(before)
        nxt = STREAM_TRANSITIONS[before[sid]].get(event)
        if event is E.RECV_GOAWAY:
            for i in LOCAL_IDS:
                if i >= sid:
                    expected[i] = STREAM_TRANSITIONS[before[i]].get(event, before[i])
        elif nxt is not None:
            expected[sid] = nxt
            if event is E.RECV_OPEN and d.is_draining:
                # A draining connection answers the OPEN with REFUSE at once.
                refused = STREAM_TRANSITIONS[nxt][E.SEND_REFUSE]
                expected[sid] = refused
        if event is E.RECV_OPEN and nxt is not None and sid % 2 == 0:
            # Ids increase: opening one retires the unused lower ids of that side.
            for i in REMOTE_IDS:
                if i < sid and before[i] is S.IDLE:
                    expected[i] = S.CLOSED
        try:
            events = act(d, event, sid)
        except LocalProtocolError:
            assert event in SEND_ACTIONS and nxt is None
            assert {i: d.stream_state(i) for i in ids} == before
            continue
        if d.is_closed:
            (end,) = [e for e in events if isinstance(e, ConnectionTerminated)]
            assert end.code is ErrorCode.PROTOCOL_ERROR
            assert nxt is None or (event is E.RECV_OPEN and sid % 2 == 1)
            return
        assert event in QUIET_WHEN_MISSING or nxt is not None
        assert {i: d.stream_state(i) for i in ids} == expected
        assert set(d.stream_ids()) == {i for i in ids if expected[i] in LIVE_STATES}
        if event is E.RECV_OPEN:
            opened = [e.stream_id for e in events if isinstance(e, StreamOpened)]
            assert opened == ([sid] if expected[sid] is S.OPEN_RECEIVED else [])
        d.data_to_send()
