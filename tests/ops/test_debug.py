"""The debug socket: server and client over a real Unix socket, and the text rendering."""
# ruff: noqa: ASYNC240 - quick checks of a temporary socket file on local disk

from __future__ import annotations

import dataclasses
import enum
import os
import socket
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry, Counter

from nodeagent.ops.debug import (
    DebugServer,
    DebugSocketInUse,
    DebugUnavailable,
    fetch_debug,
)
from nodeagent.ops.render import render_status, render_table


class State(enum.Enum):
    CONNECTED = "connected"


@dataclasses.dataclass
class Conn:
    server: str
    state: State


async def fetch(path: Path, route: str) -> Any:
    return await trio.to_thread.run_sync(fetch_debug, path, route)


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "agent.sock"


async def test_json_round_trip_and_errors(nursery: trio.Nursery, sock_path: Path) -> None:
    calls = 0

    def status() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return {"role": "agent", "calls": calls, "conn": Conn("s1", State.CONNECTED)}

    async def slow() -> list[int]:
        await trio.sleep(0.01)
        return [1, 2, 3]

    def broken() -> None:
        raise RuntimeError("boom")

    registry = CollectorRegistry()
    Counter("nodeagent_test_things", "things", registry=registry).inc(3)
    server = DebugServer(
        sock_path, {"/status": status, "/async": slow, "/broken": broken}, registry=registry
    )
    await nursery.start(server.run)

    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    doc = await fetch(sock_path, "/status")
    assert doc == {"role": "agent", "calls": 1, "conn": {"server": "s1", "state": "connected"}}
    assert (await fetch(sock_path, "status"))["calls"] == 2
    assert await fetch(sock_path, "/async") == [1, 2, 3]
    metrics = await fetch(sock_path, "/metrics")
    assert "nodeagent_test_things_total 3.0" in metrics
    assert await fetch(sock_path, "/") == {"routes": ["/async", "/broken", "/metrics", "/status"]}

    with pytest.raises(DebugUnavailable, match="no such route /nope"):
        await fetch(sock_path, "/nope")
    with pytest.raises(DebugUnavailable, match=r"/broken failed: RuntimeError\('boom'\)"):
        await fetch(sock_path, "/broken")
    # Still serving after a route failed; POST is refused with a JSON 405.
    assert (await fetch(sock_path, "/status"))["calls"] == 3

    def post() -> httpx.Response:
        transport = httpx.HTTPTransport(uds=str(sock_path))
        with httpx.Client(transport=transport, trust_env=False) as c:
            return c.post("http://x/status", content=b"{}")

    r = await trio.to_thread.run_sync(post)
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
    assert r.json()["error"] == "method POST not allowed"

    # Several requests on one keep-alive connection.
    def keep_alive() -> list[int]:
        transport = httpx.HTTPTransport(uds=str(sock_path))
        with httpx.Client(transport=transport, trust_env=False) as c:
            return [c.get("http://x/status").json()["calls"] for _ in range(3)]

    assert await trio.to_thread.run_sync(keep_alive) == [4, 5, 6]


async def test_socket_file_lifecycle(sock_path: Path) -> None:
    sock_path.parent.mkdir(parents=True)
    # A stale file left by a crashed agent: bound once, nobody listening.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock_path))
    stale.close()
    assert sock_path.exists()

    server = DebugServer(sock_path, {"/status": lambda: {"ok": True}}, mode=0o660)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o660
        assert await fetch(sock_path, "/status") == {"ok": True}
        # A second server on a live socket refuses instead of stealing it.
        with pytest.raises(DebugSocketInUse, match="another process is serving"):
            await DebugServer(sock_path, {}).run()
        assert await fetch(sock_path, "/status") == {"ok": True}
        nursery.cancel_scope.cancel()
    assert not sock_path.exists()

    sock_path.write_text("not a socket")
    with pytest.raises(DebugSocketInUse, match="a file that is not a socket is there"):
        await DebugServer(sock_path, {}).run()
    assert sock_path.read_text() == "not a socket"


async def test_unavailable_messages(sock_path: Path) -> None:
    with pytest.raises(DebugUnavailable) as info:
        await fetch(sock_path, "/status")
    assert str(info.value) == (
        f"nothing is listening on {sock_path}: is the agent or server running? "
        "(--socket to choose another)"
    )
    # A stale socket file (nobody listening) reads the same way.
    sock_path.parent.mkdir(parents=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_path))
    s.close()
    with pytest.raises(DebugUnavailable, match="nothing is listening on"):
        await fetch(sock_path, "/status")


def test_render_table_aligns_columns() -> None:
    rows = [
        {"server": "cloud-a:443", "state": "connected", "rtt_ms": 12.25, "streams": 3},
        {"server": "cloud-b:443", "state": "reconnecting", "rtt_ms": None, "streams": 120},
    ]
    text = render_table(rows, ["server", "state", ("rtt_ms", "RTT"), "streams"])
    assert text.splitlines() == [
        "SERVER       STATE         RTT      STREAMS",
        "cloud-a:443  connected     12.2 ms        3",
        "cloud-b:443  reconnecting        -      120",
    ]
    assert render_table([], ["a", "b"]) == "A  B\n(none)"


def test_render_status() -> None:
    doc = {
        "role": "agent",
        "node": "edge-1",
        "uptime": 3725,
        "config": {"version": 42, "applied": True},
        "bytes_in": 1536,
        "connections": [
            {"server": "s1", "state": "connected", "rtt_ms": 1.5, "streams": 2},
            {"server": "s2", "state": "connected", "rtt_ms": 20.0, "streams": 10},
        ],
    }
    text = render_status(doc)
    assert text == (
        "role            agent\n"
        "node            edge-1\n"
        "uptime          1h 02m 05s\n"
        "config.version  42\n"
        "config.applied  yes\n"
        "bytes_in        1.5 KiB\n"
        "\n"
        "connections (2)\n"
        "SERVER  STATE      RTT MS   STREAMS\n"
        "s1      connected   1.5 ms        2\n"
        "s2      connected  20.0 ms       10\n"
    )


def test_the_printed_program_command_runs_this_installation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the demos print: `nodeagent` only when PATH finds this installation's script;
    else the script's path (a venv not activated); else `python -m nodeagent`."""
    import shutil
    import sys

    from nodeagent.ops.debugcli import program_command

    here = Path(sys.executable).parent
    assert program_command(path=str(here)) == "nodeagent"
    # Another `nodeagent` first on PATH is not this installation.
    other = tmp_path / "nodeagent"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    assert program_command(path=f"{tmp_path}:{here}") == str(here / "nodeagent")
    assert program_command(path="/nonexistent") == str(here / "nodeagent")
    assert shutil.which("nodeagent", path=str(here))  # the venv has the script
    # An interpreter with no script beside it (a system Python running a checkout).
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setattr(sys, "executable", str(bare / "python3"))
    assert program_command(path=str(here)) == f"{bare / 'python3'} -m nodeagent"
