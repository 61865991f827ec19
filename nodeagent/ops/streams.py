"""Long-lived streams shown live in `nodeagent debug`: who, where, bytes so far, age.

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol


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
