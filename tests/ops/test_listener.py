"""The one listener interface (ops.listener): every kind starts through `Listeners`,
reports where it listens, describes itself for the debug socket and stops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry

from nodeagent.ops.debug import DebugServer
from nodeagent.ops.health import HealthServer
from nodeagent.ops.listener import Listener, Listeners


class Recording(Listener):
    kind = "recording"

    def __init__(self, name: str, events: list[str]) -> None:
        super().__init__(name)
        self.events = events

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.events.append(f"start {self.name}")
        self.addresses = [f"mem:{self.name}"]
        task_status.started(self.addresses)
        try:
            await trio.sleep_forever()
        finally:
            self.events.append(f"end {self.name}")

    def drain(self, *, close_idle: bool) -> None:
        self.events.append(f"drain {self.name} {close_idle}")


async def test_listeners_start_in_order_drain_and_stop() -> None:
    events: list[str] = []
    group = Listeners([Recording("a", events), Recording("b", events)])
    async with trio.open_nursery() as nursery:
        assert await group.start_all(nursery) == {"a": ["mem:a"], "b": ["mem:b"]}
        assert [d["running"] for d in group.describe()] == [True, True]
        group.drain(close_idle=False)
        group.stop_all()
    assert events[:4] == ["start a", "start b", "drain a False", "drain b False"]
    assert sorted(events[4:]) == ["end a", "end b"]  # trio wakes cancelled tasks in any order
    assert group.describe()[0] == {"name": "a", "kind": "recording",
                                   "addresses": ["mem:a"], "running": False}


def test_listener_names_are_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        Listeners([Recording("a", []), Recording("a", [])])


async def test_the_debug_socket_and_health_listener_are_listeners(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    debug = DebugServer(tmp_path / "debug.sock", {"/status": lambda: {"ok": True}},
                        registry=registry)
    health = HealthServer(registry, lambda: "warming up", host="127.0.0.1", port=0)
    group = Listeners([debug, health])
    async with trio.open_nursery() as nursery:
        bound = await group.start_all(nursery)
        assert bound["debug"] == [f"unix:{tmp_path / 'debug.sock'}"]
        [address] = bound["health"]
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"http://{address}/readyz")
        assert reply.status_code == 503
        assert reply.json() == {"ready": False, "reason": "warming up"}
        kinds = {d["name"]: d["kind"] for d in group.describe()}
        assert kinds == {"debug": "debug", "health": "health"}
        group.stop_all()
    assert not (tmp_path / "debug.sock").exists()
