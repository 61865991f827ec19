"""The agent's dial of a stream's target, end to end (real server and agent processes, a
TCP mapping per case): a target the allow list does not name is never connected to (no
SYN reaches it), an allowed one that never answers is refused when `dial_timeout` passes,
one that refuses is refused as such, and one that accepts is relayed. These streams go
the agent's task-less way (tunnel.relay.relay_incoming_now from its reader); each
refusal is counted and logged as the handler task's always were."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    Certs,
    Upstream,
    agent_config,
    echo_through,
    free_port,
    server_config,
)
from tests.tunnel.test_dial_in_loop import full_backlog, listener

pytestmark = pytest.mark.needs("root")  # the agent's SO_MARK needs CAP_NET_ADMIN


def assert_reset(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"x")
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            data = sock.recv(10)
            raise AssertionError(f"expected a reset, got {data!r}")


def test_the_agent_dials_only_allowed_targets_and_refuses_failed_dials(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    # `denied` is looked into at the end: any connection that reached it is pending.
    with listener() as denied, full_backlog() as blackhole:
        closed_port = free_port()  # nothing listens there: the kernel answers RST
        scfg = server_config(tmp_path, certs, upstream)
        ports = {name: free_port() for name in ("denied", "blackhole", "closed")}
        targets = {"denied": f"127.0.0.1:{denied.getsockname()[1]}",
                   "blackhole": f"127.0.0.1:{blackhole[1]}",
                   "closed": f"127.0.0.1:{closed_port}"}
        scfg["tcp"] += [{"name": name, "listen": f"127.0.0.1:{port}", "node": "edge-1",
                         "target": targets[name]} for name, port in ports.items()]
        acfg = agent_config(tmp_path, certs, upstream, scfg["tunnel"], dial_timeout=0.5)
        acfg["allow"] += [targets["blackhole"], targets["closed"]]  # not "denied"
        server = NodeagentProcess("server", scfg, tmp_path, "server").start()
        agent = NodeagentProcess("agent", acfg, tmp_path, "agent")
        try:
            server.wait_ready()
            agent.start().wait_ready()
            server.wait_for(lambda s: s["agents"], what="agent connected")

            assert echo_through(int(scfg["tcp"][0]["listen"].rsplit(":", 1)[1]),
                                b"hello") == b"hello"
            for _ in range(3):
                assert_reset(ports["denied"])
            assert_reset(ports["blackhole"])
            assert_reset(ports["closed"])
            status = agent.wait_for(
                lambda s: s["streams_by_outcome"].get("forbidden", 0) >= 3
                and s["streams_by_outcome"].get("timeout", 0) >= 1
                and s["streams_by_outcome"].get("refused", 0) >= 1, what="refusals counted")
            assert status["streams_by_outcome"]["accepted"] == 1
            # Deny by default: not one connection reached the target not allowed.
            with pytest.raises(BlockingIOError):
                denied.accept()
            logs = agent.logs()
            assert "stream refused: target not allowed on this node" in logs
            assert "timed out after 0.5s" in logs
            assert "refused the connection" in logs
        finally:
            agent.stop()
            server.stop()
