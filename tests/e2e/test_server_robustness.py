"""The server rides out what an operator or a client does to it: a second signal during
its drain, a reload of its file, a CONNECT client that goes away. Real server and agent
processes, real TLS, standalone."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    Certs,
    Upstream,
    agent_config,
    listen_port,
    server_config,
)

pytestmark = pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)


@pytest.fixture
def procs() -> Iterator[list[NodeagentProcess]]:
    started: list[NodeagentProcess] = []
    yield started
    for proc in started:
        proc.kill()
    for proc in started:
        assert "Traceback" not in proc.logs(), proc.logs()


def start(procs: list[NodeagentProcess], role: str, cfg: dict[str, Any], tmp: Path,
          name: str, *extra_args: str) -> NodeagentProcess:
    proc = NodeagentProcess(role, cfg, tmp, name, extra_args=extra_args).start()
    procs.append(proc)
    proc.wait_ready()
    return proc


# ------------------------------------------------------------------ a second signal


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_ends_the_servers_drain_at_once(
        tmp_path: Path, certs: Certs, upstream: Upstream, procs: list[NodeagentProcess],
        signum: int) -> None:
    scfg = server_config(tmp_path, certs, upstream)
    server = start(procs, "server", scfg, tmp_path, "server",
                   "--drain-seconds", "60", "--shutdown-delay", "0")
    start(procs, "agent", agent_config(tmp_path, certs, upstream, scfg["tunnel"]),
          tmp_path, "agent")
    server.wait_for(lambda s: s["agents"], what="agent connected")
    # A stream in flight keeps the drain waiting (up to its 60 s).
    with socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=10) as held:
        drain_ended_by_a_second_signal(server, held, signum)


def drain_ended_by_a_second_signal(server: NodeagentProcess, held: socket.socket,
                                   signum: int) -> None:
    held.sendall(b"in flight")
    assert held.recv(9) == b"in flight"

    assert server.proc is not None
    server.signal(signum)
    server.wait_for_log("draining agents")
    time.sleep(0.5)
    assert server.proc.poll() is None  # still draining: the stream is open
    started = time.monotonic()
    server.signal(signum)
    code = server.proc.wait(timeout=10)
    assert time.monotonic() - started < 3, server.logs()
    assert code == 0, server.logs()
    assert "Traceback" not in server.logs()
    assert "second signal: not waiting for the drain" in server.logs()
    # The stream left is ended, not kept half-alive.
    held.settimeout(5)
    try:
        assert held.recv(1) == b""
    except ConnectionResetError:
        pass
