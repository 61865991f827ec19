"""The watch retries an unreachable controller within a second, however long it has been
away; a controller that answers and fails the watch is backed off from."""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.testing

from nodeagent.config import NodeConfig
from nodeagent.configstream.client import UNREACHABLE_MAXIMUM, WatchStatus, watch_config
from tunnel.backoff import Backoff


async def _attempt_times(failure: BaseException, seconds: float) -> list[float]:
    times: list[float] = []

    async def open_stream() -> trio.abc.Stream:
        times.append(trio.current_time())
        raise failure

    async def apply(config: NodeConfig) -> None:
        raise AssertionError("nothing to apply")

    with trio.move_on_after(seconds):
        await watch_config(open_stream=open_stream, host="controller", path="/v1/config/nodes/a",
                           model=NodeConfig, apply=apply, status=WatchStatus("https://c"),
                           backoff=Backoff(initial=0.2, maximum=10.0))
    return times


@pytest.mark.parametrize("failure", [ConnectionRefusedError(111, "Connection refused"),
                                     OSError(113, "No route to host")])
async def test_an_unreachable_controller_is_retried_within_a_second(
        failure: OSError, autojump_clock: trio.testing.MockClock) -> None:
    times = await _attempt_times(failure, 60.0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) > 50  # a 60 s outage: ~1 attempt a second, not a handful
    assert max(gaps) <= UNREACHABLE_MAXIMUM + 1e-9


async def test_a_controller_that_answers_with_an_error_is_backed_off_from(
        autojump_clock: trio.testing.MockClock) -> None:
    attempts: list[float] = []

    async def open_stream() -> trio.abc.Stream:
        attempts.append(trio.current_time())
        a, b = trio.testing.memory_stream_pair()
        nursery.start_soon(_answer_503, b)
        return a

    async def apply(config: NodeConfig) -> None:
        raise AssertionError("nothing to apply")

    async with trio.open_nursery() as nursery:
        with trio.move_on_after(60.0):
            await watch_config(open_stream=open_stream, host="controller",
                               path="/v1/config/nodes/a", model=NodeConfig, apply=apply,
                               status=WatchStatus("https://c"),
                               backoff=Backoff(initial=0.2, maximum=10.0))
        nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert max(gaps) > 4.0  # grew toward the 10 s maximum
    assert len(attempts) < 20


async def _answer_503(stream: trio.abc.Stream) -> None:
    await stream.receive_some(65536)
    await stream.send_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n"
                          b"connection: close\r\n\r\nno")
    await stream.aclose()
