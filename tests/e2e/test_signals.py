"""Every role stops on SIGTERM or SIGINT with exit code 0 and no traceback, idle or not:
a DaemonSet rollout of an idle node must not log a crash. Real processes, standalone."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Certs, Upstream, start_pair

pytestmark = pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)


def _stopped_by(proc: NodeagentProcess, signum: int) -> int:
    assert proc.proc is not None
    proc.signal(signum)
    return proc.proc.wait(timeout=30)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("first", ["agent", "server"])
def test_an_idle_role_exits_0_without_a_traceback(tmp_path: Path, certs: Certs,
                                                  upstream: Upstream, signum: int,
                                                  first: str) -> None:
    server, agent = start_pair(tmp_path, certs, upstream)
    order = [agent, server] if first == "agent" else [server, agent]
    try:
        for proc in order:
            rc = _stopped_by(proc, signum)
            assert rc == 0, proc.logs()
            assert "Traceback" not in proc.logs(), proc.logs()
            assert "shutting down" in proc.logs()
    finally:
        for proc in order:
            proc.kill()
