"""The server's activity reports to the controller (server/wakeclient.py), on trio's
virtual clock."""

from __future__ import annotations

import itertools
from typing import Any

import trio
import trio.testing

from nodeagent.configstream.protocol import parse_activity
from nodeagent.http.holds import HeldRequests
from nodeagent.ops.logs import get_logger
from nodeagent.server.wakeclient import REPORT_RECHECK, WakeClient


async def test_a_shorter_interval_from_the_first_config_takes_effect_at_once(
        autojump_clock: trio.testing.MockClock) -> None:
    """A server starts on the default interval (10 s) and learns a shorter one from its
    first config: its first report follows the new interval, not the old one."""
    holds = HeldRequests()
    holds.in_flight["shop/web"] = 1  # a connection open since the server started
    reports: list[tuple[float, dict[str, Any]]] = []

    async def post(path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if path.endswith("/activity"):
            reports.append((trio.current_time(), parse_activity(body)))
        return 200, {}

    interval = {"seconds": 10.0}
    client = WakeClient(holds, post, "s1", lambda: interval["seconds"],
                        get_logger("test.wakeclient"))
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        await trio.sleep(1.0)
        interval["seconds"] = 0.3  # the first config's routes arrive
        await trio.sleep(REPORT_RECHECK + 0.7)  # room for the first report and two more
        nursery.cancel_scope.cancel()
    assert len(reports) >= 3, reports
    first_at, first = reports[0]
    assert first_at - started <= 1.0 + REPORT_RECHECK + 0.01, reports
    assert first["shop/web"][1] == 1
    # From then on, every 0.3 s.
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(reports)]
    assert all(abs(gap - 0.3) < 0.01 for gap in gaps), gaps


async def test_a_longer_interval_is_kept(autojump_clock: trio.testing.MockClock) -> None:
    """Rechecking the interval does not make reports more frequent than it says."""
    holds = HeldRequests()
    holds.in_flight["shop/web"] = 1
    times: list[float] = []

    async def post(path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        times.append(trio.current_time())
        return 200, {}

    client = WakeClient(holds, post, "s1", lambda: 5.0, get_logger("test.wakeclient"))
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        await trio.sleep(16.0)
        nursery.cancel_scope.cancel()
    assert [round(t - started, 3) for t in times] == [5.0, 10.0, 15.0]
