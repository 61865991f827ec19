"""`nodeagent debug tunnels` and `streams`: the rows read from live tunnel connections, the
notes of who opened a stream, the `?node=` routes, the renderers and `--watch`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, Histogram

from nodeagent.agent.agent import Agent
from nodeagent.config import AgentConfig, ConfigError, NodeConfig, RoutesConfig
from nodeagent.ops.debug import DebugServer
from nodeagent.ops.debugcli import render, route_for, run_debug
from nodeagent.ops.jsonhttp import QueryRoute
from nodeagent.ops.render import render_streams, render_tunnels
from nodeagent.ops.streamviews import (
    StreamNotes,
    direction,
    opener_from_metadata,
    stream_rows,
    tracked_opener,
)
from tests.server.test_policy import make_server
from tests.tunnel.test_endpoint import echo_handler, linked
from tunnel import protocol as p
from tunnel.endpoint import EndpointSettings, TunnelClosedError
from tunnel.errors import END_LABELS, end_label

TARGET = p.Target("10.0.0.7", 8080)


async def test_stream_rows_on_both_sides_name_the_stream_its_target_and_bytes() -> None:
    notes_agent, notes_server = StreamNotes(), StreamNotes()
    setup = Histogram("setup_seconds", "t", registry=CollectorRegistry())
    async with linked(dialer_handler=echo_handler) as link:
        # The server side (acceptor) opens a stream to a target on the node (to-node).
        open_to_node = tracked_opener(link.acceptor.open_stream, notes_server, setup.observe)
        stream = await open_to_node(TARGET, {"origin": "203.0.113.9:4242"})
        notes_server.note(stream, "tcp mapping echo client 203.0.113.9:4242")
        await stream.send_all(b"x" * 1000)
        got = 0
        while got < 1000:
            got += len(await stream.receive_some())
        server_rows = stream_rows(link.acceptor, notes_server, peer={"node": "edge-1"})
        agent_rows = stream_rows(link.dialer, notes_agent, peer={"server_id": "s1"})
    assert setup.collect()[0].samples[1].value == 1  # _count: one OPEN timed
    [srow] = server_rows
    assert srow["node"] == "edge-1" and srow["id"] % 2 == 0
    assert srow["direction"] == "to-node" and srow["target"] == "tcp://10.0.0.7:8080"
    assert srow["state"] == "open"
    assert srow["bytes_to_target"] == 1000 and srow["bytes_from_target"] == 1000
    assert srow["opened_by"] == "tcp mapping echo client 203.0.113.9:4242"
    assert srow["age_seconds"] is not None and srow["age_seconds"] >= 0
    # The agent never noted it: who opened it comes from the OPEN's metadata, the bytes
    # are the same stream's seen from the other end.
    [arow] = agent_rows
    assert arow["server_id"] == "s1" and arow["id"] == srow["id"]
    assert arow["direction"] == "to-node"
    assert arow["bytes_to_target"] == 1000 and arow["bytes_from_target"] == 1000
    assert arow["opened_by"] == "client 203.0.113.9:4242"
    assert arow["age_seconds"] is not None and 0 <= arow["age_seconds"] < 60


async def test_a_stream_waiting_for_its_accept_is_listed_as_opening() -> None:
    accept = trio.Event()

    async def slow_handler(incoming: Any) -> None:
        await accept.wait()
        await echo_handler(incoming)

    notes = StreamNotes()
    async with linked(acceptor_handler=slow_handler,
                      settings=EndpointSettings(ping_interval=0)) as link:
        async with trio.open_nursery() as nursery:
            opened: list[Any] = []

            async def opener() -> None:
                opened.append(await tracked_opener(link.dialer.open_stream, notes)(
                    TARGET, {"origin": "10.1.2.3:5", "intercepted": "pods"}))

            nursery.start_soon(opener)
            await trio.testing.wait_all_tasks_blocked()
            [row] = stream_rows(link.dialer, notes, peer={"server_id": "s1"})
            assert row["state"] == "opening" and row["direction"] == "from-node"
            assert row["id"] % 2 == 1
            # Not accepted yet, so not noted: who and since when, from the stream itself.
            assert row["opened_by"] == "intercepted pod 10.1.2.3:5 (rule pods)"
            assert row["age_seconds"] is not None and row["age_seconds"] >= 0
            [waiting] = stream_rows(link.acceptor, StreamNotes(), peer={"node": "edge-1"})
            assert waiting["state"] == "opening" and waiting["age_seconds"] is not None
            accept.set()
        [row] = stream_rows(link.dialer, notes, peer={"server_id": "s1"})
        assert row["state"] == "open"
        assert row["opened_by"] == "intercepted pod 10.1.2.3:5 (rule pods)"
        await opened[0].aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert link.dialer.open_streams() == []


def test_opener_from_metadata_says_who_asked() -> None:
    assert opener_from_metadata({}) == "-"
    assert opener_from_metadata({"origin": "1.2.3.4:5"}) == "client 1.2.3.4:5"
    assert opener_from_metadata({"origin": "apiserver", "purpose": "control-plane"}) == \
        "control-plane client apiserver"
    assert opener_from_metadata({"origin": "10.0.0.2:9", "intercepted": ""}) == \
        "intercepted pod 10.0.0.2:9"
    assert direction(1) == "from-node" and direction(2) == "to-node"


def test_end_labels_are_a_closed_set() -> None:
    assert end_label(None) == "cancelled"
    assert end_label(TunnelClosedError("x", p.ErrorCode.KEEPALIVE_TIMEOUT)) == \
        "keepalive_timeout"
    assert end_label(TunnelClosedError("x", p.ErrorCode.INTERNAL_ERROR)) == "connection_lost"
    assert end_label(TunnelClosedError("x", p.ErrorCode.NO_ERROR), drained=True) == "drained"
    for code in p.ErrorCode:
        assert end_label(TunnelClosedError("x", code)) in END_LABELS


AGENT_TUNNELS = {
    "role": "agent", "node": "edge-1", "state": "connected", "replicas": 2, "connects": 3,
    "reconnects": {"drained": 1, "keepalive_timeout": 1}, "last_error": None,
    "tunnels": [
        {"server_id": "server-a", "address": "wss://tunnel.example:443/tunnel",
         "peer": "198.51.100.1:443", "state": "open", "rtt_ms": 12.34, "streams_open": 2,
         "bytes_in": 5 * 1024 * 1024, "bytes_out": 2048, "since_seconds": 3723.0,
         "last_error": None},
        {"server_id": None, "address": "wss://tunnel.example:443/tunnel", "peer": None,
         "state": "backoff", "rtt_ms": None, "streams_open": 0, "bytes_in": 0,
         "bytes_out": 0, "since_seconds": 4.2,
         "last_error": "dial failed: connection refused"},
    ]}

SERVER_TUNNELS = {
    "role": "server", "server_id": "server-a", "node_filter": None, "connected": 1,
    "disconnects": {"keepalive_timeout": 2},
    "tunnels": [
        {"node": "edge-1", "peer": "203.0.113.5:40000", "state": "open", "rtt_ms": 1.5,
         "streams_open": 1, "bytes_in": 100, "bytes_out": 200, "since_seconds": 61.0,
         "last_error": None},
        {"node": "edge-2", "peer": "203.0.113.6:40000", "state": "disconnected",
         "rtt_ms": None, "streams_open": 0, "bytes_in": None, "bytes_out": None,
         "since_seconds": 30.0,
         "last_error": "keepalive_timeout: no PING answer within 10s"},
    ]}


def test_render_tunnels_agent_and_server() -> None:
    text = render_tunnels(AGENT_TUNNELS)
    lines = text.splitlines()
    assert lines[0] == ("agent edge-1: connected, 1 of 2 server(s) held; connects 3, "
                        "reconnects: drained 1, keepalive_timeout 1")
    assert lines[2].split() == ["SERVER", "ADDRESS", "STATE", "PEER", "RTT", "STREAMS",
                                "BYTES", "IN", "BYTES", "OUT", "SINCE", "LAST", "ERROR",
                                "/", "REASON"]
    assert "server-a" in lines[3] and "12.3 ms" in lines[3] and "5.0 MiB" in lines[3]
    assert "1h 02m 03s" in lines[3] and "2.0 KiB" in lines[3]
    assert "backoff" in lines[4] and "dial failed: connection refused" in lines[4]
    text = render_tunnels(SERVER_TUNNELS)
    assert text.startswith("server server-a: 1 node(s) connected; disconnects: "
                           "keepalive_timeout 2\n")
    row = next(line for line in text.splitlines() if line.startswith("edge-2"))
    assert "disconnected" in row and "keepalive_timeout: no PING answer" in row
    empty = render_tunnels({**SERVER_TUNNELS, "node_filter": "ghost", "tunnels": []})
    assert "node ghost has no tunnel to this server" in empty and "(none)" in empty


def test_render_streams_lists_each_stream() -> None:
    doc = {"role": "server", "server_id": "server-a", "node_filter": "edge-1", "streams": [
        {"node": "edge-1", "id": 6, "direction": "to-node", "target": "tcp://127.0.0.1:80",
         "state": "open", "opened_by": "http route web client 203.0.113.9:5000",
         "bytes_to_target": 512, "bytes_from_target": 3 * 1024 * 1024, "age_seconds": 75.0},
    ]}
    lines = render_streams(doc).splitlines()
    assert lines[0] == "server server-a: 1 stream(s) of node edge-1"
    assert lines[2].split()[:5] == ["NODE", "ID", "DIRECTION", "TARGET", "STATE"]
    assert lines[3].split()[:5] == ["edge-1", "6", "to-node", "tcp://127.0.0.1:80", "open"]
    assert "512 B" in lines[3] and "3.0 MiB" in lines[3] and "1m 15s" in lines[3]
    assert lines[3].endswith("http route web client 203.0.113.9:5000")
    agent = render_streams({"role": "agent", "node": "edge-1", "streams": []})
    assert agent.startswith("agent edge-1: 0 stream(s)") and "(none)" in agent
    assert json.loads(render("streams", doc, as_json=True)) == doc


def test_route_for_passes_the_node_filter_only_where_it_applies() -> None:
    assert route_for("tunnels", "edge-1") == "/tunnels?node=edge-1"
    assert route_for("streams", "a b/c") == "/streams?node=a%20b%2Fc"
    assert route_for("status", "edge-1") == "/status"
    assert route_for("streams", None) == "/streams"


async def test_query_routes_and_watch_until_interrupted(
        nursery: trio.Nursery, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "server.sock"
    seen: list[Any] = []

    def tunnels(query: Any) -> dict[str, Any]:
        seen.append(dict(query))
        node = (query.get("node") or [None])[-1]
        rows = [r for r in SERVER_TUNNELS["tunnels"]  # type: ignore[attr-defined]
                if node is None or r["node"] == node]
        return {**SERVER_TUNNELS, "node_filter": node, "tunnels": rows}

    server = DebugServer(path, {"/tunnels": QueryRoute(tunnels)})
    await nursery.start(server.run)

    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt  # what Ctrl-C does to the sleeping CLI

    code = await trio.to_thread.run_sync(
        lambda: run_debug("tunnels", path, as_json=False, node="edge-2", watch=0.5,
                          sleep=sleep))
    out = capsys.readouterr()
    # (stderr may hold the debug server's own log lines: only the CLI's are checked)
    assert code == 0 and sleeps == [0.5, 0.5, 0.5] and "nodeagent debug:" not in out.err
    assert out.out.count("\x1b[H\x1b[2J") == 3 and "every 0.5s" in out.out
    assert "edge-2" in out.out and "edge-1  open" not in out.out
    assert seen[-1] == {"node": ["edge-2"]}
    code = await trio.to_thread.run_sync(
        lambda: run_debug("tunnels", path, as_json=True, node=None, watch=None))
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["node"] for r in doc["tunnels"]] == ["edge-1", "edge-2"]
    # The socket gone while watching: one line, exit 1.
    sleeps.clear()

    def vanish(seconds: float) -> None:
        path.unlink()

    code = await trio.to_thread.run_sync(
        lambda: run_debug("tunnels", path, as_json=True, watch=1.0, sleep=vanish))
    out = capsys.readouterr()
    assert code == 1
    [line] = [ln for ln in out.err.splitlines() if ln.startswith("nodeagent debug:")]
    assert "nothing is listening on" in line
    assert len(out.out.splitlines()) == 1  # the one JSON line before it went away


def _sample(registry: Any, name: str, labels: dict[str, str] | None = None) -> float | None:
    value: float | None = registry.get_sample_value(name, labels or {})
    return value


def test_server_config_applies_are_timed_and_its_views_filter_by_node() -> None:
    server = make_server({})
    registry = server.metrics.registry
    server.apply_routes(RoutesConfig(version=2))
    assert _sample(registry, "nodeagent_config_apply_seconds_count", {"outcome": "ok"}) == 1
    assert _sample(registry, "nodeagent_config_version") == 2
    tcp = RoutesConfig.model_validate({"version": 3, "tcp": [
        {"listen": "127.0.0.1:1", "node": "edge-1", "target": "127.0.0.1:2"}]})
    with pytest.raises(ConfigError):
        server.apply_routes(tcp)  # listeners cannot change while running
    assert _sample(registry, "nodeagent_config_apply_seconds_count",
                   {"outcome": "failed"}) == 1
    assert _sample(registry, "nodeagent_config_version") == 2
    doc = server.tunnels("edge-1")
    assert doc["node_filter"] == "edge-1" and doc["tunnels"] == [] and doc["connected"] == 0
    assert server.streams()["streams"] == []
    text = render_tunnels(doc)
    assert "node edge-1 has no tunnel to this server" in text


async def test_agent_config_applies_are_timed_and_it_lists_the_server_it_dials() -> None:
    agent = Agent(AgentConfig.model_validate({
        "node": "edge-1", "server": "tcp://127.0.0.1:9", "insecure": True,
        "token": "0123456789abcdef0",
        "debug_socket": ""}), ssl_context=None)
    await agent.apply_node_config(NodeConfig(version=7))
    registry = agent.metrics.registry
    assert _sample(registry, "nodeagent_config_apply_seconds_count", {"outcome": "ok"}) == 1
    assert _sample(registry, "nodeagent_config_version") == 7
    doc = agent.tunnels()
    assert doc["state"] == "starting" and doc["reconnects"] == {}
    [row] = doc["tunnels"]  # not running yet: the address it is to dial, no failure
    assert row["address"] == "tcp://127.0.0.1:9" and row["state"] == "backoff"
    assert row["last_error"] is None
    assert agent.streams() == {"role": "agent", "node": "edge-1", "streams": []}
    assert "nodeagent_tunnel_reconnects" in agent.metrics.render().decode()


def test_debug_loadbalancers_renders_each_port_its_state_and_backends() -> None:
    doc = {"role": "server", "host": "0.0.0.0", "ports": [
        {"service": "apps/dns", "protocol": "udp", "port": 53, "state": "listening",
         "error": "", "accepted": 12, "refused": 0,
         "backends": ["edge-1/10.1.0.5:5353", "edge-2/10.2.0.7:5353"]},
        {"service": "apps/web", "protocol": "tcp", "port": 80, "state": "failed",
         "error": "address already in use", "accepted": 0, "refused": 3, "backends": []}]}
    text = render("loadbalancers", doc, as_json=False)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["SERVICE", "PORT", "STATE"]
    assert "apps/dns" in lines[1] and "udp/53" in lines[1] and \
        "edge-1/10.1.0.5:5353, edge-2/10.2.0.7:5353" in lines[1]
    assert "failed" in lines[2] and "(no ready endpoints)" in lines[2]
    assert "address already in use" in lines[3]
    assert "no LoadBalancer Service" in render("loadbalancers", {"ports": [], "host": "::"},
                                               as_json=False)
    assert json.loads(render("loadbalancers", doc, as_json=True)) == doc
