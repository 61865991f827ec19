"""`nodeagent server --workers 2` with real processes: a parent and two workers sharing the
public ports (SO_REUSEPORT), one agent.

What is asserted is what the workers are for: the agent holds a tunnel to each worker
(`<server_id>-w0`, `-w1`, replicas announced 2), requests on new connections land on both
workers and all succeed, a worker killed with SIGKILL is restarted by the parent and the
agent reconnects to it, the parent's /readyz and /metrics speak for both workers, and
SIGTERM stops the whole server (every worker drains, the parent exits 0).

Timeouts are generous on purpose: the kernel hashes each dial to a worker at random, and
a dial that reaches a worker the agent already holds is refused (ALREADY_CONNECTED) and
retried on the agent's paced backoff (1 s growing to 30 s), so the second tunnel usually
comes within a second or two but may take tens of seconds."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.server.workers import worker_socket
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    Certs,
    Upstream,
    agent_config,
    echo_through,
    free_port,
    http_port,
    listen_port,
    server_config,
)
from tests.e2e.test_failures import no_tracebacks

pytestmark = pytest.mark.needs("root")  # the agent marks its socket (SO_MARK)

TUNNELS_TIMEOUT = 150.0


def worker_view(parent: NodeagentProcess, index: int) -> NodeagentProcess:
    """Reads worker `index`'s debug socket; logs are the parent's (workers inherit its
    output)."""
    view = NodeagentProcess("server", {**parent.config, "debug_socket": str(
        worker_socket(Path(parent.config["debug_socket"]), index))}, parent.workdir,
        f"{parent.name}-w{index}")
    view.log_path = parent.log_path
    return view


def open_ids(status: dict[str, Any]) -> set[str]:
    return {t["server_id"] for t in status["tunnels"] if t["state"] == "open"}


@pytest.fixture
def workers(tmp_path: Path, certs: Certs, upstream: Upstream
            ) -> Iterator[tuple[NodeagentProcess, list[NodeagentProcess], NodeagentProcess]]:
    cfg = server_config(tmp_path, certs, upstream)
    cfg["metrics_listen"] = f"127.0.0.1:{free_port()}"
    parent = NodeagentProcess("server", cfg, tmp_path, "server",
                              # A restarted worker joins the public ports when the agent
                              # is back, or after the grace (then by design it answers 502
                              # for the missing node): a grace beyond the tunnel wait.
                              extra_args=["--workers", "2", "--drain-seconds", "5",
                                          "--ready-grace", str(TUNNELS_TIMEOUT + 60)])
    views = [worker_view(parent, k) for k in range(2)]
    agent = NodeagentProcess("agent", agent_config(tmp_path, certs, upstream, cfg["tunnel"]),
                             tmp_path, "agent")
    try:
        parent.start()
        for view in views:
            view.wait_ready(timeout=30)
        agent.start()
        agent.wait_ready()
        yield parent, views, agent
    finally:
        agent.kill()
        parent.kill()
        # A parent killed with SIGKILL: its workers see their pipe from it end and
        # drain; wait for their sockets to stop answering.
        deadline = time.monotonic() + 15
        for view in views:
            while view.socket.exists() and time.monotonic() < deadline:
                try:
                    view.status(timeout=0.5)
                except (httpx.HTTPError, OSError):
                    break
                time.sleep(0.1)


def wait_both(agent: NodeagentProcess, views: list[NodeagentProcess]) -> float:
    started = time.monotonic()
    status = agent.wait_for(lambda s: open_ids(s) == {"cloud-test-w0", "cloud-test-w1"},
                            timeout=TUNNELS_TIMEOUT, what="a tunnel to each worker")
    assert status["tunnel"]["replicas"] == 2
    for view in views:
        view.wait_for(lambda s: any(a["node"] == "edge-1" and not a["draining"]
                                    for a in s["agents"]), what="edge-1 on the worker")
    return time.monotonic() - started


def get(port: int) -> httpx.Response:
    # A new connection per request: each is hashed to a worker afresh.
    return httpx.get(f"http://127.0.0.1:{port}/w", headers={"host": "app.test",
                                                              "connection": "close"},
                     timeout=10)


@pytest.mark.timeout(TUNNELS_TIMEOUT + 120)  # see the restart test's timeout
def test_two_workers_each_hold_the_agent_and_both_serve_requests(
        workers: tuple[NodeagentProcess, list[NodeagentProcess], NodeagentProcess]) -> None:
    parent, views, agent = workers
    elapsed = wait_both(agent, views)
    print(f"\ntunnels to both workers {elapsed:.2f}s after the agent was ready")
    statuses = [v.status() for v in views]
    assert [s["server_id"] for s in statuses] == ["cloud-test-w0", "cloud-test-w1"]
    assert [s["replicas"] for s in statuses] == [2, 2]
    port = http_port(parent)
    for _ in range(60):
        r = get(port)
        assert r.status_code == 200, r.text
        assert "hello from upstream path=/w" in r.text
    served = [v.status()["http"]["http:public"]["requests"] for v in views]
    assert sum(served) == 60, served
    assert min(served) > 0, f"one worker took every connection: {served}"
    for _ in range(10):
        assert echo_through(listen_port(parent, 0), b"tcp") == b"tcp"

    # The parent speaks for the pod: ready with both workers up; every worker's metrics,
    # labelled.
    metrics_port = int(parent.config["metrics_listen"].rsplit(":", 1)[1])
    ready = httpx.get(f"http://127.0.0.1:{metrics_port}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    for k in (0, 1):
        assert f'worker="{k}"' in text
    assert text.count("# TYPE nodeagent_tunnel_handshakes_total") <= 1
    no_tracebacks(parent, agent)

    # The parent killed outright: no worker outlives it (they drain and exit).
    pids = [_worker_pid(parent, k) for k in (0, 1)]
    parent.kill()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, f"workers {pids} outlived their parent"
        time.sleep(0.1)
    assert "the server's parent process is gone; draining" in parent.logs()


# Two waits for the agent's tunnels to both workers (up to TUNNELS_TIMEOUT each: the
# kernel may hash its dials to the worker it holds, and it redials on its backoff up to
# 30 s); the suite's 120 s default cut one such run short while it was progressing.
@pytest.mark.timeout(2 * TUNNELS_TIMEOUT + 120)
def test_a_killed_worker_is_restarted_and_the_agent_reconnects_to_it(
        workers: tuple[NodeagentProcess, list[NodeagentProcess], NodeagentProcess]) -> None:
    parent, views, agent = workers
    wait_both(agent, views)
    victim = _worker_pid(parent, 1)
    os.kill(victim, signal.SIGKILL)
    started = time.monotonic()
    # Once the parent has reaped it, its sockets are closed and left the SO_REUSEPORT
    # group. (Not before: a connection the kernel queued on its listener in the moment of
    # the kill is reset with it; no server can answer that one.)
    parent.wait_for_log("worker exited; restarting it", timeout=10)
    # From then on the survivor takes every new connection, and the restarted worker
    # joins the group only once it holds the agent's tunnel again: every request succeeds
    # all through the restart, until the agent is back on both workers.
    port = http_port(parent)
    requests = 0
    deadline = time.monotonic() + TUNNELS_TIMEOUT
    while requests < 20 or open_ids(agent.status()) != {"cloud-test-w0", "cloud-test-w1"}:
        assert time.monotonic() < deadline, "the agent did not come back to worker 1"
        r = get(port)
        assert r.status_code == 200, (requests, r.text)
        requests += 1
        time.sleep(0.02)
    views[1].wait_for(lambda s: s["server_id"] == "cloud-test-w1", timeout=30,
                      what="worker 1 back")
    assert _worker_pid(parent, 1) != victim
    parent.wait_for_log("public listeners open (restarted worker ready)", timeout=30)
    elapsed = wait_both(agent, views)
    print(f"\nagent back on the restarted worker {time.monotonic() - started:.2f}s after "
          f"the kill ({elapsed:.2f}s after it was up)")
    served_before = views[1].status()["http"]["http:public"]["requests"]
    for _ in range(40):
        assert get(http_port(parent)).status_code == 200
    assert views[1].status()["http"]["http:public"]["requests"] > served_before

    # SIGTERM: every worker drains and exits, then the parent exits 0.
    assert parent.stop(timeout=30) == 0
    for view in views:
        with pytest.raises((httpx.HTTPError, OSError)):
            view.status(timeout=1)
    no_tracebacks(parent, agent)


def _worker_pid(parent: NodeagentProcess, index: int) -> int:
    """Worker `index`'s pid, from the process table: the parent's child whose command
    line ends with --worker-index INDEX --parent-fd FD."""
    assert parent.proc is not None
    tasks = Path(f"/proc/{parent.proc.pid}/task")  # trio starts processes from a thread
    for pid in (p for t in tasks.iterdir() for p in (t / "children").read_text().split()):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if cmdline[-5:-3] == [b"--worker-index", str(index).encode()]:
            return int(pid)
    raise AssertionError(f"no worker {index} under pid {parent.proc.pid}")


def test_port_zero_with_workers_is_refused_with_one_line(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    cfg = server_config(tmp_path, certs, upstream)
    cfg["http"][0]["listen"] = "127.0.0.1:0"
    server = NodeagentProcess("server", cfg, tmp_path, "server",
                              extra_args=["--workers", "2"]).start()
    assert server.proc is not None
    assert server.proc.wait(30) == 2
    assert "http[0].listen: port 0 with --workers 2" in server.logs()


def test_a_config_the_workers_cannot_use_stops_the_server_with_exit_code_2(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    # The parent reads only the config's fields; the workers load the key, and the first
    # one to fail at its first start stops the server: no restart loop.
    cfg = server_config(tmp_path, certs, upstream)
    cfg["tls"]["key_file"] = str(tmp_path / "missing.key")
    server = NodeagentProcess("server", cfg, tmp_path, "server",
                              extra_args=["--workers", "2"]).start()
    assert server.proc is not None
    assert server.proc.wait(60) == 2
    logs = server.logs()
    assert f"tls.key_file: {tmp_path}/missing.key: no such file" in logs
    assert "worker found the config invalid; stopping the server" in logs
    assert "restarting it" not in logs
