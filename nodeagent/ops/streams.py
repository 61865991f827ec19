"""Long-lived streams shown live in `nodeagent debug`: who, where, bytes so far, age.

`LiveStreams` is a table of the streams open right now (the server's CONNECT front and
the agent's control-plane streams fill it); `Metered` wraps a stream and counts the bytes
it carries as they move, so an exec session that has run for an hour shows its bytes
before it ends. An entry leaves the table when its stream ends.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio


@dataclass
class LiveStream:
    id: int
    client: str
    node: str
    target: str
    started: float = field(default_factory=time.monotonic)
    bytes_in: int = 0  # from the client / server side, toward the target
    bytes_out: int = 0  # from the target back

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
    def track(self, client: str, node: str, target: str) -> Iterator[LiveStream]:
        entry = LiveStream(next(self._ids), client, node, target)
        self._open[entry.id] = entry
        try:
            yield entry
        finally:
            del self._open[entry.id]

    def __len__(self) -> int:
        return len(self._open)

    def as_list(self) -> list[dict[str, Any]]:
        return [s.as_dict() for s in self._open.values()]


class Metered(trio.abc.HalfCloseableStream):
    """`inner` (a tunnel stream), counting into `entry` as bytes move: what is sent on it
    as bytes_in when `sends_toward_target` (the server side: the client's bytes go into the
    tunnel toward the target), else as bytes_out, and what is received the other way."""

    def __init__(self, inner: trio.abc.HalfCloseableStream, entry: LiveStream, *,
                 sends_toward_target: bool) -> None:
        self.inner = inner
        self._entry = entry
        self._forward = sends_toward_target

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.inner.receive_some(max_bytes)
        if self._forward:
            self._entry.bytes_out += len(data)
        else:
            self._entry.bytes_in += len(data)
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)
        if self._forward:
            self._entry.bytes_in += len(data)
        else:
            self._entry.bytes_out += len(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()
