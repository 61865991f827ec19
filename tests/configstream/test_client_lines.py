"""How the watch reads the stream's lines: a valid config line is validated straight
from its bytes and carries its version; a heartbeat, a line that is not JSON and a config
that does not validate are still told apart and named; a reconnect whose first line has
the running content renumbered applies nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from nodeagent.config import AllowRule, NodeConfig, RoutesConfig
from nodeagent.configstream.client import WatchStatus, watch_config
from nodeagent.configstream.protocol import (
    HEARTBEAT_LINE,
    config_line,
    parse_config_line,
    parse_line,
)
from tunnel.backoff import Backoff

CONFIG = NodeConfig(allow=(AllowRule(host="10.1.0.5"), AllowRule.model_validate("10.0.0.0/8:80")),
                    server_replicas=2)


def test_a_config_line_is_validated_from_its_bytes_with_its_version() -> None:
    parsed = parse_config_line(config_line(7, CONFIG).rstrip(b"\n"), NodeConfig)
    assert parsed is not None
    version, config = parsed
    assert version == 7 and config.version == 7
    assert config == CONFIG.model_copy(update={"version": 7})
    # The same result as the document's way (json, then the model).
    doc = parse_line(config_line(7, CONFIG))
    assert config == NodeConfig.model_validate({**doc["config"], "version": 7})
    routes = RoutesConfig(egress=(AllowRule(host="10.1.0.1"),))
    assert parse_config_line(config_line(3, routes), RoutesConfig) == (
        3, routes.model_copy(update={"version": 3}))


@pytest.mark.parametrize("line", [
    HEARTBEAT_LINE, b"not json", b"[1]", b'{"version": "x", "config": {}}',
    b'{"config": {}}', b'{"version": 1}', b'{"version": 1, "config": {"allow": ["nope"]}}',
    b'{"version": 1, "config": {"unknown_field": 1}}',
])
def test_anything_but_a_valid_config_line_is_left_to_the_documents_way(line: bytes) -> None:
    assert parse_config_line(line, NodeConfig) is None


def _line(version: int, doc: Any) -> bytes:
    return json.dumps({"version": version, "config": doc}).encode() + b"\n"


async def _controller(stream: trio.abc.Stream, lines: list[bytes]) -> None:
    """Answers the watch with `lines`, each a chunk, then keeps the stream open."""
    await stream.receive_some(65536)
    await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                          b"transfer-encoding: chunked\r\n\r\n")
    for line in lines:
        await stream.send_all(b"%x\r\n%s\r\n" % (len(line), line))
    await trio.sleep_forever()


async def _watch(connections: list[list[bytes]], *, until: Any,
                 running: dict[str, Any] | None = None, idle_timeout: float = 45.0,
                 apply_takes: float = 0.0, within: float = 5.0
                 ) -> tuple[list[NodeConfig], WatchStatus]:
    """A watch over in-memory streams: connection i answers `connections[i]`, and is
    broken once `until(applied, i)` holds (the watch reconnects)."""
    applied: list[NodeConfig] = []
    status = WatchStatus("https://c")
    served: list[trio.abc.Stream] = []

    async def open_stream() -> trio.abc.Stream:
        if len(served) == len(connections):
            await trio.sleep_forever()
        a, b = trio.testing.memory_stream_pair()
        nursery.start_soon(_controller, b, connections[len(served)])
        served.append(b)
        return a

    async def apply(config: NodeConfig) -> None:
        await trio.sleep(apply_takes)
        applied.append(config)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: watch_config(
            open_stream=open_stream, host="c", path="/v1/config/nodes/a", model=NodeConfig,
            apply=apply, status=status, backoff=Backoff(initial=0.01, maximum=0.01),
            running=running, idle_timeout=idle_timeout))
        with trio.fail_after(within):
            for i in range(len(connections)):
                while not until(applied, status, i):  # noqa: ASYNC110 (plain data)
                    await trio.sleep(0.01)
                if i + 1 < len(connections):
                    await served[i].aclose()
        nursery.cancel_scope.cancel()
    return applied, status


async def test_lines_of_every_kind_are_read_as_before() -> None:
    good = CONFIG.model_dump(mode="json", exclude={"version"})
    lines = [config_line(1, CONFIG), HEARTBEAT_LINE,
             _line(2, {"allow": ["not a rule"]}),  # does not validate: named, not applied
             _line(3, good)]  # the same content with another version: applied
    applied, status = await _watch([lines], until=lambda a, s, i: len(a) == 2)
    assert [c.version for c in applied] == [1, 3]
    assert applied[0] == CONFIG.model_copy(update={"version": 1})
    assert status.applied_version == 3 and status.received_version == 3


async def test_a_bad_config_is_named_and_the_running_one_kept() -> None:
    lines = [config_line(1, CONFIG), _line(2, {"allow": ["not a rule"]})]
    applied, status = await _watch(
        [lines], until=lambda a, s, i: s.received_version == 2 and s.last_error)
    assert [c.version for c in applied] == [1]
    assert status.applied_version == 1 and "allow" in (status.last_error or "")


async def test_a_line_that_is_not_json_breaks_the_watch_with_a_reason() -> None:
    applied, status = await _watch(
        [[b"{nope\n", config_line(1, CONFIG)]],
        until=lambda a, s, i: "not JSON" in (s.last_error or ""))
    assert applied == [] and status.state in ("backoff", "connecting")


async def test_a_reconnect_with_the_running_content_renumbered_applies_nothing() -> None:
    other = NodeConfig(allow=(AllowRule(host="10.9.9.9"),))
    applied, _ = await _watch(
        [[config_line(4, CONFIG)],  # applied
         [config_line(1, CONFIG)],  # a restarted controller: same content, version 1
         [config_line(2, other)]],  # then new content: applied, whatever its number
        until=lambda a, s, i: (len(a) == 1 if i == 0 else s.applied_version == 1 if i == 1
                               else len(a) == 2))
    assert [c.version for c in applied] == [4, 2]
    assert applied[1].allows("10.9.9.9", 80)


async def test_the_running_config_given_at_start_is_not_applied_again() -> None:
    running = CONFIG.model_dump(mode="json", exclude={"version"})
    applied, _ = await _watch([[config_line(9, CONFIG)]], running=running,
                                   until=lambda a, s, i: s.applied_version == 9)
    assert applied == []


async def test_a_controller_silent_for_the_idle_timeout_breaks_the_watch(
        autojump_clock: trio.abc.Clock) -> None:
    # One config line, then nothing (not even a heartbeat): the watch gives up on that
    # connection after its idle timeout and reconnects, where the next line comes.
    second: list[float] = []

    def until(a: list[NodeConfig], s: WatchStatus, i: int) -> bool:
        if len(a) == 2 and not second:
            second.append(trio.current_time())
        return bool(second)

    started = trio.current_time()
    other = NodeConfig(allow=(AllowRule(host="10.9.9.9"),))
    applied, status = await _watch([[config_line(1, CONFIG)], [config_line(2, other)]],
                                   idle_timeout=10.0, until=until, within=60)
    assert [c.version for c in applied] == [1, 2]
    assert 10.0 <= second[0] - started < 10.5
    assert status.applied_version == 2


async def test_the_idle_timeout_counts_only_the_wait_for_bytes(
        autojump_clock: trio.abc.Clock) -> None:
    # Applying a config may take longer than the idle timeout (netfilter on a busy
    # node): that is not the controller's silence, and the watch stays.
    lines = [config_line(1, CONFIG), config_line(2, CONFIG.model_copy(
        update={"server_replicas": 3}))]
    applied, status = await _watch(
        [lines, [config_line(9, CONFIG)]], idle_timeout=10.0, apply_takes=25.0,
        until=lambda a, s, i: len(a) == 2, within=120)
    assert [c.version for c in applied] == [1, 2]
    assert status.last_error is None and status.state == "watching"
