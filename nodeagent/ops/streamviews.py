"""Streams shown live in `nodeagent debug`: who opened them, where to, bytes so far, age.

`stream_rows(connection, notes)` lists every stream a tunnel connection holds now, read from
the connection itself (its streams and their byte counters), so nothing is added per byte
or per frame. What the connection does not know, when a stream opened and what asked for
it in this process (an Ingress route, a TCP mapping), is in `StreamNotes`, written once
when the stream opens (`tracked_opener` for streams this side opens, `StreamNotes.note`
in the handlers of streams the peer opens) and forgotten with the stream (weak keys). A
stream without a note is shown by its OPEN's metadata and the time this side learnt of
it, which is all a note of a stream the peer opened would say (the agent's task-free
path notes none).
The metadata the opener sent with its OPEN (origin address, control-plane purpose,
interception rule) crosses the tunnel, so both sides can say who opened a stream.


`LiveStreams` is a table of the streams open right now (the server's CONNECT front and
the agent's control-plane streams fill it). An entry holds the tunnel stream itself and
reads its byte counters when the debug view asks, so an exec session that has run for an
hour shows its bytes before it ends, at no cost per byte and without wrapping the stream
(a wrapper would hide the tunnel stream from splice(), whose tunnel → socket direction
skips a task for a bare TunnelStream). An entry leaves the table when its stream ends.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ParamSpec, Protocol, TypeVar

from nodeagent.config import CONTROL_PLANE_PURPOSE, PURPOSE_KEY
from tunnel import protocol as p


class CountsBytes(Protocol):
    """A stream that counts what it carried (tunnel.stream.TunnelStream)."""

    @property
    def bytes_sent(self) -> int: ...

    @property
    def bytes_received(self) -> int: ...


@dataclass
class LiveStream:
    id: int
    client: str
    node: str
    target: str
    stream: CountsBytes
    # The server side sends the client's bytes into the tunnel toward the target; the
    # agent side receives them from the tunnel.
    sends_toward_target: bool
    started: float = field(default_factory=time.monotonic)

    @property
    def bytes_in(self) -> int:
        """From the client / server side, toward the target."""
        s = self.stream
        return s.bytes_sent if self.sends_toward_target else s.bytes_received

    @property
    def bytes_out(self) -> int:
        """From the target back."""
        s = self.stream
        return s.bytes_received if self.sends_toward_target else s.bytes_sent

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "client": self.client, "node": self.node,
                "target": self.target, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "age_seconds": round(time.monotonic() - self.started, 1)}


class LiveStreams:
    def __init__(self) -> None:
        self._open: dict[int, LiveStream] = {}
        self._ids = itertools.count(1)

    @contextmanager
    def track(self, client: str, node: str, target: str, stream: CountsBytes, *,
              sends_toward_target: bool) -> Iterator[LiveStream]:
        entry = LiveStream(next(self._ids), client, node, target, stream,
                           sends_toward_target)
        self._open[entry.id] = entry
        try:
            yield entry
        finally:
            del self._open[entry.id]

    def __len__(self) -> int:
        return len(self._open)

    def as_list(self) -> list[dict[str, Any]]:
        return [s.as_dict() for s in self._open.values()]


# -- every stream of a tunnel connection ---------------------------------------------------

# Stream ids: odd for streams the dialing side (the agent) opened, even for the server's.
TO_NODE, FROM_NODE = "to-node", "from-node"


def direction(stream_id: int) -> str:
    """`to-node`: the server opened it (Ingress, TCP mapping, CONNECT) and the target is
    on the node's side; `from-node`: the agent opened it (intercepted pod traffic, the
    controller) and the target is on the server's side. The same word on both sides."""
    return FROM_NODE if stream_id % 2 else TO_NODE


@dataclass(slots=True)
class StreamNote:
    opened: float  # time.monotonic()
    opened_by: str
    inner: Callable[[], list[dict[str, Any]]] | None = None
    """For a stream that carries a protocol with streams of its own (an h2c upstream
    connection): those streams now, read when the debug view asks."""


class StreamNotes:
    """When each stream opened and what asked for it, for as long as the stream lives."""

    def __init__(self) -> None:
        self._notes: weakref.WeakKeyDictionary[Any, StreamNote] = weakref.WeakKeyDictionary()

    def note(self, stream: Any, opened_by: str, opened: float | None = None) -> None:
        """Remember `stream`'s opener (replacing a vaguer note made when it opened)."""
        existing = self._notes.get(stream)
        when = opened if opened is not None else (
            existing.opened if existing is not None else time.monotonic())
        self._notes[stream] = StreamNote(when, opened_by)

    def describe(self, stream: Any, inner: Callable[[], list[dict[str, Any]]]) -> None:
        """Show what `stream` carries inside (`inner()`, read per debug request)."""
        existing = self._notes.get(stream)
        if existing is None:
            self._notes[stream] = StreamNote(time.monotonic(), "-", inner)
        else:
            existing.inner = inner

    def get(self, stream: Any) -> StreamNote | None:
        return self._notes.get(stream)

    def __len__(self) -> int:
        return len(self._notes)


def opener_from_metadata(metadata: Mapping[str, str]) -> str:
    """Who opened a stream, as its OPEN's metadata says (set by the opening side)."""
    origin = metadata.get("origin", "") or "?"
    if metadata.get(PURPOSE_KEY) == CONTROL_PLANE_PURPOSE:
        return f"control-plane client {origin}"
    if "intercepted" in metadata:
        rule = metadata.get("intercepted") or ""
        return f"intercepted pod {origin}" + (f" (rule {rule})" if rule else "")
    return f"client {origin}" if metadata.get("origin") else "-"


class TunnelStreams(Protocol):
    """tunnel.endpoint.TunnelConnection"""

    role: p.Role

    def open_streams(self) -> list[tuple[Any, bool]]: ...  # (TunnelStream, opening)


def stream_rows(connection: TunnelStreams, notes: StreamNotes, *,
                peer: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per stream `connection` holds now, `peer` (`{"node": ...}` on a server,
    `{"server_id": ...}` on an agent) first in each. Bytes are counted toward the target
    (what the opening side sent) and back from it."""
    now = time.monotonic()
    rows = []
    for stream, opening in connection.open_streams():
        sid = stream.stream_id
        opened_here = bool(sid % 2) == (connection.role is p.Role.DIALER)
        note = notes.get(stream)
        sent, received = stream.bytes_sent, stream.bytes_received
        rows.append({
            **peer,
            "id": sid,
            "direction": direction(sid),
            "target": str(stream.target),
            "state": "opening" if opening else "open",
            "opened_by": note.opened_by if note is not None
            else opener_from_metadata(stream.metadata),
            "bytes_to_target": sent if opened_here else received,
            "bytes_from_target": received if opened_here else sent,
            # Noted: from when the opener began (before its OPEN was sent); otherwise
            # from when this side learnt of the stream, so an opening one has an age too.
            "age_seconds": round(now - (note.opened if note is not None
                                        else stream.opened_at), 1),
        })
        if note is not None and note.inner is not None:
            rows[-1]["h2_streams"] = note.inner()
    return rows


_S = TypeVar("_S")
_P = ParamSpec("_P")


def tracked_opener(
    open_stream: Callable[_P, Awaitable[_S]], notes: StreamNotes,
    observe_setup: Callable[[float], None] | None = None,
) -> Callable[_P, Coroutine[Any, Any, _S]]:
    """`open_stream` that notes each stream it opens (the opener from its metadata) and
    reports how long the OPEN took to be accepted: once per stream, nothing per byte."""

    async def open_tracked(*args: _P.args, **kwargs: _P.kwargs) -> _S:
        started = time.monotonic()
        stream = await open_stream(*args, **kwargs)
        accepted = time.monotonic()
        if observe_setup is not None:
            observe_setup(accepted - started)
        metadata = getattr(stream, "metadata", None)
        notes.note(stream, opener_from_metadata(metadata) if metadata else "-", started)
        return stream

    return open_tracked
