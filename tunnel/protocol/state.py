"""Stream states as one declarative table, in the style of h11's _state.py.

Owns the life cycle of a stream: the states it can be in (`StreamState`), the frames sent
or received for it (`StreamEvent`), and `STREAM_TRANSITIONS`, which says for every state
which events are allowed and the state each one leads to. An event missing from a
state's row is not allowed there; the connection turns that into the right failure:

- a frame received (RECV_*): the peer broke the protocol (`unexpected_frame()` words the
  error), the connection ends with a PROTOCOL_ERROR GOAWAY;
- an action of ours (SEND_OPEN/ACCEPT/REFUSE/DATA/FIN): `StreamClosedError` when the
  stream is CLOSED or IDLE, `LocalProtocolError` otherwise;
- SEND_RST and SEND_WINDOW: nothing is sent (resetting a finished stream is a no-op;
  credit for a stream the peer finished sending on is pointless).

Only streams in the live states (between IDLE and CLOSED) have a `StreamRecord`; an id
without one is CLOSED if it was used before (late frames in flight are ignored: that is
the CLOSED row) and IDLE otherwise. The connection-level states (`ConnectionState`) are
few and linear, and stay plain assignments in connection.py.

The hot path (DATA) looks its transition up in `TRANSITIONS_BY_EVENT[event]`, one dict
lookup per frame and no call; everything else may use `next_stream_state()`.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import Any

from tunnel.protocol.errors import RemoteProtocolError


class ConnectionState(enum.Enum):
    HANDSHAKE = "handshake"
    OPEN = "open"
    CLOSED = "closed"


class StreamState(enum.Enum):
    IDLE = "idle"  # the id was never used
    OPEN_SENT = "open-sent"  # we sent OPEN; no ACCEPT or REFUSE yet
    OPEN_RECEIVED = "open-received"  # the peer sent OPEN; we have not answered
    OPEN = "open"  # accepted, data flows both ways
    HALF_CLOSED_LOCAL = "half-closed-local"  # we sent FIN; the peer may still send
    HALF_CLOSED_REMOTE = "half-closed-remote"  # the peer sent FIN; we may still send
    CLOSED = "closed"  # FIN both ways, RST either way, or refused

    # Enum.__hash__ is Python code (it hashes the name); members are singletons compared
    # by identity, so identity hashing is equivalent and keeps the per-frame table lookup
    # in C: measured 170-330 ns -> 45-95 ns per dict lookup.
    __hash__ = object.__hash__


class StreamEvent(enum.Enum):
    """A frame sent (SEND_*) or received (RECV_*) for one stream. A DATA frame with the
    FIN flag is a FIN event: it carries data, so FIN is allowed only where DATA is."""

    SEND_OPEN = "send OPEN"
    RECV_OPEN = "recv OPEN"
    SEND_ACCEPT = "send ACCEPT"
    RECV_ACCEPT = "recv ACCEPT"
    SEND_REFUSE = "send REFUSE"
    RECV_REFUSE = "recv REFUSE"
    SEND_DATA = "send DATA"
    RECV_DATA = "recv DATA"
    SEND_FIN = "send DATA+FIN"
    RECV_FIN = "recv DATA+FIN"
    SEND_WINDOW = "send WINDOW"
    RECV_WINDOW = "recv WINDOW"
    SEND_RST = "send RST"
    RECV_RST = "recv RST"
    # A DATAGRAM frame: one datagram on a flow (a stream whose target is udp). It
    # never changes the state; it is allowed exactly where DATA is.
    SEND_DATAGRAM = "send DATAGRAM"
    RECV_DATAGRAM = "recv DATAGRAM"
    # A draining GOAWAY whose last stream id is below a stream we opened: the peer will
    # never process it, so it counts as refused.
    RECV_GOAWAY = "recv GOAWAY"

    __hash__ = object.__hash__  # as StreamState's


_S = StreamState
_E = StreamEvent

STREAM_TRANSITIONS: dict[StreamState, dict[StreamEvent, StreamState]] = {
    _S.IDLE: {
        _E.SEND_OPEN: _S.OPEN_SENT,
        _E.RECV_OPEN: _S.OPEN_RECEIVED,
    },
    _S.OPEN_SENT: {
        _E.RECV_ACCEPT: _S.OPEN,
        _E.RECV_REFUSE: _S.CLOSED,
        _E.SEND_WINDOW: _S.OPEN_SENT,
        _E.RECV_WINDOW: _S.OPEN_SENT,
        _E.SEND_RST: _S.CLOSED,
        _E.RECV_RST: _S.CLOSED,
        _E.RECV_GOAWAY: _S.CLOSED,
    },
    _S.OPEN_RECEIVED: {
        _E.SEND_ACCEPT: _S.OPEN,
        _E.SEND_REFUSE: _S.CLOSED,
        _E.SEND_WINDOW: _S.OPEN_RECEIVED,
        _E.RECV_WINDOW: _S.OPEN_RECEIVED,
        _E.SEND_RST: _S.CLOSED,
        _E.RECV_RST: _S.CLOSED,
        # No RECV_GOAWAY: a GOAWAY only refuses streams we opened.
    },
    _S.OPEN: {
        _E.SEND_DATA: _S.OPEN,
        _E.RECV_DATA: _S.OPEN,
        _E.SEND_DATAGRAM: _S.OPEN,
        _E.RECV_DATAGRAM: _S.OPEN,
        _E.SEND_FIN: _S.HALF_CLOSED_LOCAL,
        _E.RECV_FIN: _S.HALF_CLOSED_REMOTE,
        _E.SEND_WINDOW: _S.OPEN,
        _E.RECV_WINDOW: _S.OPEN,
        _E.SEND_RST: _S.CLOSED,
        _E.RECV_RST: _S.CLOSED,
        _E.RECV_GOAWAY: _S.CLOSED,
    },
    _S.HALF_CLOSED_LOCAL: {
        _E.RECV_DATA: _S.HALF_CLOSED_LOCAL,
        _E.RECV_DATAGRAM: _S.HALF_CLOSED_LOCAL,
        _E.RECV_FIN: _S.CLOSED,
        _E.SEND_WINDOW: _S.HALF_CLOSED_LOCAL,
        _E.RECV_WINDOW: _S.HALF_CLOSED_LOCAL,
        _E.SEND_RST: _S.CLOSED,
        _E.RECV_RST: _S.CLOSED,
        _E.RECV_GOAWAY: _S.CLOSED,
    },
    _S.HALF_CLOSED_REMOTE: {
        _E.SEND_DATA: _S.HALF_CLOSED_REMOTE,
        _E.SEND_DATAGRAM: _S.HALF_CLOSED_REMOTE,
        _E.SEND_FIN: _S.CLOSED,
        _E.RECV_WINDOW: _S.HALF_CLOSED_REMOTE,
        _E.SEND_RST: _S.CLOSED,
        _E.RECV_RST: _S.CLOSED,
        _E.RECV_GOAWAY: _S.CLOSED,
    },
    # Frames the peer sent before it learnt that the stream ended are dropped.
    _S.CLOSED: {
        _E.RECV_ACCEPT: _S.CLOSED,
        _E.RECV_REFUSE: _S.CLOSED,
        _E.RECV_DATA: _S.CLOSED,
        _E.RECV_FIN: _S.CLOSED,
        _E.RECV_DATAGRAM: _S.CLOSED,
        _E.RECV_WINDOW: _S.CLOSED,
        _E.RECV_RST: _S.CLOSED,
    },
}

# The same table indexed by event first: {event: {state: next state}}.
TRANSITIONS_BY_EVENT: dict[StreamEvent, dict[StreamState, StreamState]] = {
    event: {
        state: row[event] for state, row in STREAM_TRANSITIONS.items() if event in row
    }
    for event in StreamEvent
}

# States with a StreamRecord: everything between IDLE and CLOSED.
LIVE_STATES = frozenset(StreamState) - {StreamState.IDLE, StreamState.CLOSED}


def next_stream_state(state: StreamState, event: StreamEvent) -> StreamState | None:
    """The state `event` leads to from `state`; None if the table does not allow it."""
    return STREAM_TRANSITIONS[state].get(event)


@dataclass(slots=True)
class StreamRecord:
    """What the connection keeps about one live stream."""

    id: int
    local: bool  # opened by this side
    state: StreamState
    send_window: int
    recv_window: int
    pending_credit: int = 0  # consumed bytes not yet returned to the peer as WINDOW
    datagram: bool = False  # a flow: its target is udp, its payload DATAGRAM frames
    # Datagrams waiting for connection credit (flows only; None while there are none).
    queue: collections.deque[bytes] | None = None
    queued_bytes: int = 0


class StreamTable(dict[int, StreamRecord]):
    """The live streams by id, keeping count of the locally opened ones so that the
    stream limits are checked in O(1) however many streams are open."""

    __slots__ = ("local",)

    def __init__(self) -> None:
        super().__init__()
        self.local = 0

    def __setitem__(self, key: int, stream: StreamRecord) -> None:
        old = super().get(key)
        if old is not None and old.local:
            self.local -= 1
        super().__setitem__(key, stream)
        if stream.local:
            self.local += 1

    def __delitem__(self, key: int) -> None:
        if super().__getitem__(key).local:
            self.local -= 1
        super().__delitem__(key)

    def pop(self, key: int, default: Any = None) -> Any:
        stream = super().pop(key, default)
        if isinstance(stream, StreamRecord) and stream.local:
            self.local -= 1
        return stream

    def clear(self) -> None:
        super().clear()
        self.local = 0


_FRAME_NAMES = {
    StreamEvent.RECV_OPEN: "OPEN",
    StreamEvent.RECV_ACCEPT: "ACCEPT/REFUSE",
    StreamEvent.RECV_REFUSE: "ACCEPT/REFUSE",
    StreamEvent.RECV_DATA: "DATA",
    StreamEvent.RECV_FIN: "DATA",
    StreamEvent.RECV_DATAGRAM: "DATAGRAM",
    StreamEvent.RECV_WINDOW: "WINDOW",
    StreamEvent.RECV_RST: "RST",
}


def unexpected_frame(event: StreamEvent, state: StreamState, stream_id: int) -> RemoteProtocolError:
    """The protocol error for a received frame the stream table does not allow."""
    frame = _FRAME_NAMES[event]
    if state is StreamState.IDLE:
        return RemoteProtocolError(f"{frame} for stream {stream_id}, which was never opened")
    if event is StreamEvent.RECV_OPEN:
        return RemoteProtocolError(f"OPEN reuses stream id {stream_id} (ids must increase)")
    if frame in ("DATA", "DATAGRAM"):
        if state is StreamState.HALF_CLOSED_REMOTE:
            return RemoteProtocolError(f"{frame} on stream {stream_id} after FIN")
        return RemoteProtocolError(f"{frame} on stream {stream_id} before it was accepted")
    return RemoteProtocolError(f"{frame} for stream {stream_id} not awaiting one")
