"""Failure tests with real processes and sockets: a server down 5 s and 20 s, a server
rolled with SIGTERM while a stream is in flight, peers vanishing and resetting. What is
asserted is what an operator sees: when the node is back, which streams survive, and the
log lines (one per event, never a traceback).

Times are printed, never asserted (this machine is shared and noisy): what stands for
"back soon" is the retry delay the agent chose (its debug `tunnels` view), checked while
the server is still away; waits are generous hang guards. The figures come from
`python -m scripts.bench.reconnect_after_outage` over several runs."""

from __future__ import annotations

import signal
import socket
import ssl
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.testing.netns import Topology, netns_available
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    TOKEN,
    Certs,
    Upstream,
    agent_config,
    echo_through,
    free_port,
    listen_port,
    server_config,
)
from nodeagent.trust import pki
from tunnel import protocol as p

pytestmark = pytest.mark.needs("root")  # the agent marks its socket (SO_MARK)

# The agent as a new user runs it: the default reconnect policy.
DEFAULT_RECONNECT: dict[str, Any] = {}


def lines(proc: NodeagentProcess, message: str) -> list[str]:
    return [line for line in proc.logs().splitlines() if f" {message} " in f"{line} "]


def no_tracebacks(*procs: NodeagentProcess) -> None:
    for proc in procs:
        assert "Traceback" not in proc.logs(), proc.logs()


# The agent's retry delay while the server is unreachable is capped at this (the
# reconnect policy's unreachable_maximum): it is back within about that of the server.
UNREACHABLE_MAXIMUM = 1.0
# Hang guard for the agent's return: generous, the machine is shared.
BACK_TIMEOUT = 30.0


def debug_tunnels(agent: NodeagentProcess) -> dict[str, Any]:
    """The agent's debug `tunnels` view: a row per tunnel held or address being dialed."""
    transport = httpx.HTTPTransport(uds=str(agent.socket))
    with httpx.Client(transport=transport, timeout=5) as client:
        view: dict[str, Any] = client.get("http://debug/tunnels").json()
    return view


def dialing(agent: NodeagentProcess) -> dict[str, Any]:
    """The agent's one address being dialed (its debug `tunnels` view), failing so far."""
    (row,) = [r for r in debug_tunnels(agent)["tunnels"] if r["server_id"] is None]
    return dict(row)


def retrying_soon(agent: NodeagentProcess) -> dict[str, Any]:
    """Check the agent, while its server is away, retries on the unreachable schedule:
    the delay it chose after its last failed attempt is at most about a second."""
    status = agent.wait_for(lambda s: s["tunnel"]["failures"] >= 1, timeout=BACK_TIMEOUT,
                            what="a failed attempt")
    assert status["tunnel"]["last_failure"] == "unreachable", status["tunnel"]
    row = dialing(agent)
    assert 0 < row["retry_in_seconds"] <= UNREACHABLE_MAXIMUM, row
    return row


def wait_agent_on(server: NodeagentProcess, timeout: float = BACK_TIMEOUT) -> float:
    """Seconds until `server` (just ready) holds edge-1's tunnel."""
    started = time.monotonic()
    server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                    timeout=timeout, what="edge-1 connected")
    return time.monotonic() - started


@pytest.mark.parametrize("outage", [5, 20])
def test_agent_is_back_soon_after_an_outage_of_any_length(
        tmp_path: Path, certs: Certs, upstream: Upstream, outage: float) -> None:
    scfg = server_config(tmp_path, certs, upstream)
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    agent = NodeagentProcess("agent", agent_config(
        tmp_path, certs, upstream, scfg["tunnel"], reconnect=DEFAULT_RECONNECT),
        tmp_path, "agent")
    back: NodeagentProcess | None = None
    try:
        server.wait_ready()
        agent.start().wait_ready()
        wait_agent_on(server)
        server.kill()
        time.sleep(outage)
        # However long the outage, the agent still retries about every second (a growing
        # backoff would be at many seconds by now).
        row = retrying_soon(agent)
        back = NodeagentProcess("server", scfg, tmp_path, "server-back").start()
        back.wait_ready()
        elapsed = wait_agent_on(back)
        print(f"\noutage {outage}s: agent back {elapsed:.2f}s after the server was ready "
              f"(its retry delay then: {row['retry_in_seconds']}s)")
        assert echo_through(listen_port(back, 0), b"again") == b"again"
    finally:
        server.kill()
        agent.kill()
        if back is not None:
            back.kill()
    # One line for the loss and one for the failing retries (the next would come after
    # 30 s), however many attempts the outage took.
    assert len(lines(agent, "tunnel connection lost")) == 1, agent.logs()
    failed = lines(agent, "tunnel connect failed")
    assert len(failed) == 1 and "failure=unreachable" in failed[0], agent.logs()
    assert len(lines(agent, "tunnel connected")) == 2
    no_tracebacks(agent, *([back] if back else []))


def readyz(port: int) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_drains_a_stream_in_flight_while_the_agent_moves_to_the_new_server(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    """Server A is rolled: on SIGTERM its readiness fails, it stops accepting tunnels and
    sends GOAWAY; the agent dials at once and lands on B (same tunnel address) while its
    old tunnel carries A's stream in flight to its end; then A exits."""
    scfg = server_config(tmp_path, certs, upstream)
    scfg["metrics_listen"] = f"127.0.0.1:{free_port()}"
    tunnel_port = int(scfg["tunnel"].rsplit(":", 1)[1])
    health_port = int(scfg["metrics_listen"].rsplit(":", 1)[1])
    old = NodeagentProcess("server", scfg, tmp_path, "server-a",
                           extra_args=["--drain-seconds", "20"]).start()
    agent = NodeagentProcess("agent", agent_config(
        tmp_path, certs, upstream, scfg["tunnel"], reconnect=DEFAULT_RECONNECT),
        tmp_path, "agent")
    new: NodeagentProcess | None = None
    stream = None
    try:
        old.wait_ready()
        agent.start().wait_ready()
        wait_agent_on(old)
        assert readyz(health_port) == 200
        stream = socket.create_connection(("127.0.0.1", listen_port(old, 0)), timeout=5)
        stream.sendall(b"before")
        assert stream.recv(6) == b"before"

        old.signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while readyz(health_port) != 503:
            assert time.monotonic() < deadline, "readiness did not fail"
            time.sleep(0.05)
        assert refused(tunnel_port)  # no new tunnels on A
        agent.wait_for_log("server is draining this connection; dialing a new one")

        # B: the same tunnel address, its own public ports (A still holds its own).
        bcfg = server_config(tmp_path, certs, upstream, tunnel_port=tunnel_port)
        bcfg["debug_socket"] = str(tmp_path / "server-b.sock")
        new = NodeagentProcess("server", bcfg, tmp_path, "server-b").start()
        # Meanwhile its dials to A's closed port are refused: retried about every second.
        row = retrying_soon(agent)
        new.wait_ready()
        elapsed = wait_agent_on(new)
        print(f"\nagent on the new server {elapsed:.2f}s after it was ready "
              f"(its retry delay then: {row['retry_in_seconds']}s)")
        assert echo_through(listen_port(new, 0), b"new") == b"new"

        # The stream in flight on A still works through the draining tunnel.
        stream.sendall(b"during the drain")
        got = b""
        while len(got) < 16:
            got += stream.recv(64)
        assert got == b"during the drain"
        assert old.proc is not None and old.proc.poll() is None  # A waits for it
        stream.close()
        stream = None
        assert old.proc.wait(10) == 0  # A exits once its last stream is done
    finally:
        if stream is not None:
            stream.close()
        old.kill()
        agent.kill()
        if new is not None:
            new.kill()
    assert "drain grace period over" not in old.logs()
    no_tracebacks(old, agent, *([new] if new else []))


def test_a_stream_outliving_the_grace_period_is_reset_and_the_server_exits(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    scfg = server_config(tmp_path, certs, upstream)
    server = NodeagentProcess("server", scfg, tmp_path, "server",
                              extra_args=["--drain-seconds", "1.5"]).start()
    agent = NodeagentProcess("agent", agent_config(tmp_path, certs, upstream, scfg["tunnel"]),
                             tmp_path, "agent")
    try:
        server.wait_ready()
        agent.start().wait_ready()
        wait_agent_on(server)
        with socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=5) as s:
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            started = time.monotonic()
            server.signal(signal.SIGTERM)
            assert server.proc is not None and server.proc.wait(10) == 0
            took = time.monotonic() - started
            # It waited out the grace period (the stream was still open) and did not wait
            # for the stream: wait(10) above bounds that without timing a loaded machine.
            assert took >= 1.3, took
            s.settimeout(5)
            try:
                assert s.recv(10) == b""
            except ConnectionResetError:
                pass
    finally:
        server.kill()
        agent.kill()
    (line,) = lines(server, "drain grace period over; resetting streams left")
    assert "streams=1" in line
    no_tracebacks(server, agent)


# ------------------------------------------------------------------ log lines


def test_peers_vanishing_and_resetting_are_one_line_each(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    scfg = server_config(tmp_path, certs, upstream)
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    agent = NodeagentProcess("agent", agent_config(tmp_path, certs, upstream, scfg["tunnel"]),
                             tmp_path, "agent")
    port = int(scfg["tunnel"].rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    try:
        server.wait_ready()
        agent.start().wait_ready()
        wait_agent_on(server)
        # An agent SIGKILLed with streams running: one "agent disconnected" line.
        streams = [socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=5)
                   for _ in range(3)]
        for s in streams:
            s.sendall(b"y" * 100_000)
        time.sleep(0.3)
        agent.kill()
        server.wait_for(lambda st: not st["agents"], what="agent gone")
        for s in streams:
            s.close()

        # Twenty TLS connections reset mid-handshake (after the server's first flight):
        # five lines, then a count.
        for _ in range(20):
            incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            tls_object = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
            with pytest.raises(ssl.SSLWantReadError):
                tls_object.do_handshake()
            raw = socket.create_connection(("127.0.0.1", port), timeout=5)
            raw.sendall(outgoing.read())
            assert raw.recv(4096)  # ServerHello and the rest of its flight
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raw.close()

        # A HELLO with a frame pipelined behind it (the dialer must wait for our HELLO):
        # a protocol error answered with GOAWAY, one line, not a crashed handler.
        dialer = p.Connection(p.Role.DIALER)
        dialer.start(p.Hello(identity={"node": "edge-1", "token": TOKEN}))
        ping = p.HEADER.pack(8 << 8 | p.FrameType.PING, 0, 0) + b"12345678"
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5),
                             server_hostname="localhost") as tls:
            tls.sendall(dialer.data_to_send() + ping)
            answer = tls.recv(4096)
        (ended,) = dialer.receive_data(answer)
        assert isinstance(ended, p.ConnectionTerminated)
        assert ended.code is p.ErrorCode.PROTOCOL_ERROR
        time.sleep(0.5)
    finally:
        server.kill()
        agent.kill()
    (gone,) = lines(server, "agent disconnected")
    assert "node=edge-1" in gone
    failed_tls = [line for line in lines(server, "handshake failed") if "reason=tls" in line]
    assert len(failed_tls) == 5, server.logs()
    (bad,) = lines(server, "agent handshake failed")
    assert "code=protocol_error" in bad and "before the handshake completed" in bad
    assert "connection handler failed" not in server.logs()
    assert " error " not in server.logs()  # no error-level line for any of it
    no_tracebacks(server)


def test_server_vanishing_mid_stream_is_one_line_on_the_agent(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    scfg = server_config(tmp_path, certs, upstream)
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    agent = NodeagentProcess("agent", agent_config(tmp_path, certs, upstream, scfg["tunnel"]),
                             tmp_path, "agent")
    try:
        server.wait_ready()
        agent.start().wait_ready()
        wait_agent_on(server)
        streams = [socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=5)
                   for _ in range(3)]
        for s in streams:
            s.sendall(b"z" * 100_000)
        time.sleep(0.3)
        server.kill()
        agent.wait_for(lambda st: st["tunnel"]["state"] != "connected", what="agent notices")
        time.sleep(3)  # several failed dials meanwhile
        for s in streams:
            s.close()
    finally:
        server.kill()
        agent.kill()
    assert len(lines(agent, "tunnel connection lost")) == 1, agent.logs()
    assert len(lines(agent, "tunnel connect failed")) == 1, agent.logs()
    assert " error " not in agent.logs()
    no_tracebacks(agent)


# ------------------------------------------------------------------ a path that drops


@pytest.mark.netns
@pytest.mark.needs("nft")
def test_agent_is_back_soon_after_its_path_dropped_packets(tmp_path: Path) -> None:
    """The server's host drops the tunnel's packets for 6 s (nft, in its namespace): the
    agent's keepalive ends the tunnel, its dials time out (SYNs dropped), and within ~2 s
    of the path being back it is connected again: each TCP connect gives up after 2 s
    instead of waiting for the kernel's SYN retries at 1, 3, 7 s."""
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)
    topo = Topology()
    procs: list[NodeagentProcess] = []
    try:
        topo.add("edge")
        topo.add("cloud")
        topo.link("edge", ["10.77.0.1/24"], "cloud", ["10.77.0.2/24"])
        ca = pki.create_ca("drop CA")
        ca.write(tmp_path / "ca.crt", tmp_path / "ca.key")
        pki.issue_server_certificate(ca, [], ["10.77.0.2"]).write(
            tmp_path / "s.crt", tmp_path / "s.key")
        server = NodeagentProcess("server", {
            "tunnel": "tls://10.77.0.2:8443",
            "tls": {"cert_file": str(tmp_path / "s.crt"), "key_file": str(tmp_path / "s.key")},
            "tokens": [{"node": "edge-1", "token": TOKEN}],
            "keepalive": {"interval": 1, "timeout": 2},
            "debug_socket": str(tmp_path / "server.sock"),
        }, tmp_path, "server", netns=topo.ns("cloud")).start()
        procs.append(server)
        server.wait_ready()
        agent = NodeagentProcess("agent", {
            "node": "edge-1", "server": "tls://10.77.0.2:8443", "token": TOKEN,
            "tls": {"ca_file": str(tmp_path / "ca.crt")},
            "debug_socket": str(tmp_path / "agent.sock"),
            "keepalive": {"interval": 1, "timeout": 2},
        }, tmp_path, "agent", netns=topo.ns("edge")).start()
        procs.append(agent)
        agent.wait_ready()
        wait_agent_on(server)
        topo.exec("cloud", ["nft", "-f", "-"], input=(
            "table inet blackhole {\n chain input {\n  type filter hook input priority 0;\n"
            "  tcp dport 8443 drop\n }\n}\n"))
        agent.wait_for(lambda s: s["tunnel"]["state"] != "connected", timeout=10,
                       what="agent notices the dead path")
        time.sleep(6)
        # Its TCP connect gave up on its own 2 s bound (not the kernel's SYN retries nor
        # the whole dial's timeout), and the next attempt is about a second away.
        agent.wait_for(lambda s: "no TCP connection within 2s" in
                       (s["tunnel"]["last_error"] or ""), timeout=BACK_TIMEOUT,
                       what="a TCP connect given up after 2 s")
        row = retrying_soon(agent)
        topo.exec("cloud", ["nft", "delete", "table", "inet", "blackhole"])
        back = time.monotonic()
        agent.wait_for(lambda s: s["tunnel"]["state"] == "connected", timeout=BACK_TIMEOUT,
                       what="agent back")
        elapsed = time.monotonic() - back
        print(f"\npath dropped 6 s: agent back {elapsed:.2f}s after it was restored "
              f"(its retry delay then: {row['retry_in_seconds']}s)")
    finally:
        for proc in procs:
            proc.kill()
        topo.close()
    failed = lines(agent, "tunnel connect failed")
    assert len(failed) == 1 and "failure=unreachable" in failed[0], agent.logs()
    no_tracebacks(*procs)


def test_agent_sigterm_finishes_the_stream_in_flight_and_new_ones_fail_fast(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    """An agent restarting (DaemonSet rollout): on SIGTERM it sends GOAWAY, the stream the
    server opened before carries on to its end, a new one is refused at once (not hung
    until a timeout), and the agent exits as soon as the last stream is done."""
    scfg = server_config(tmp_path, certs, upstream)
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    acfg = agent_config(tmp_path, certs, upstream, scfg["tunnel"], reconnect=DEFAULT_RECONNECT)
    acfg["drain_seconds"] = 30
    agent = NodeagentProcess("agent", acfg, tmp_path, "agent")
    stream = None
    try:
        server.wait_ready()
        agent.start().wait_ready()
        wait_agent_on(server)
        stream = socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=5)
        stream.sendall(b"before")
        assert stream.recv(6) == b"before"

        agent.signal(signal.SIGTERM)
        agent.wait_for_log("draining")
        assert "streams=1" in agent.logs()
        before = server.status()["streams_by_outcome"]
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=5) as new:
            new.sendall(b"x")
            try:
                assert new.recv(10) == b"", "refused: closed without data"
            except ConnectionResetError:
                pass
        refused_in = time.monotonic() - started
        print(f"\na new stream to the draining agent failed in {refused_in * 1000:.0f} ms")
        # Refused at once: the server knows the node's tunnel is draining (its GOAWAY)
        # and counts the refusal so, not as the open timeout running out.
        after = server.status()["streams_by_outcome"]
        assert after == {**before, "draining": before.get("draining", 0) + 1}, after

        stream.sendall(b"during the drain")
        got = b""
        while len(got) < 16:
            got += stream.recv(64)
        assert got == b"during the drain"
        assert agent.proc is not None and agent.proc.poll() is None, "exited while busy"
        stream.close()
        stream = None
        assert agent.proc.wait(10) == 0
        assert "drained: nothing left in flight" in agent.logs()
    finally:
        if stream is not None:
            stream.close()
        agent.kill()
        server.kill()
    no_tracebacks(server, agent)
