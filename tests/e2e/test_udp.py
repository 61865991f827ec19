"""UDP through the tunnel end to end: real `nodeagent server` and `agent` processes, a
UDP echo and a real DNS server (dnslib) behind the node, public UDP mappings in front,
queried by Python clients and by `dig`.

What must hold (docs/udp.md): datagrams whole up to 65,507 bytes, each client address its
own flow with replies back to it, 1,000 flows at once, idle expiry, a burst on one flow
not starving another, refused and forbidden targets dropped and counted, recovery after
agent and server restarts, no amplification before a second datagram, and a
spoofed-source flood held to the flow caps with bounded memory.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nodeagent.ops.debug import fetch_debug
from nodeagent.testing.procs import NodeagentProcess, rss_kib
from nodeagent.testing.standalone import TOKEN, Certs, free_port
from nodeagent.testing.udp import (
    DnsServer,
    UdpEcho,
    dns_query,
    exchange,
    run_dns_server,
    run_udp_echo,
)

pytestmark = pytest.mark.needs("root")  # the agent marks its sockets (SO_MARK)

FLOOD_FLOWS = 200  # the flood mapping's max_flows
FLOOD_PER_CLIENT = 4


def free_udp_port() -> int:
    return free_port(socket.SOCK_DGRAM)


@dataclass
class UdpStack:
    server: NodeagentProcess
    agent: NodeagentProcess
    ports: dict[str, int]  # mapping name -> public port
    echo: UdpEcho
    dns: DnsServer

    def flows(self) -> dict[str, Any]:
        doc: dict[str, Any] = fetch_debug(self.server.socket, "/flows")
        return doc

    def drops(self, mapping: str) -> dict[str, int]:
        for m in self.flows()["mappings"]:
            if m["mapping"] == f"udp:{mapping}":
                return dict(m["drops"])
        raise AssertionError(f"no mapping {mapping}")


@pytest.fixture
def udp_stack(tmp_path: Path, certs: Certs) -> Iterator[UdpStack]:
    with run_udp_echo() as echo, run_udp_echo(amplify=10) as amplifier, \
            run_dns_server() as dns:
        closed = free_udp_port()  # allowed, but nothing listens: ICMP port unreachable
        ports = {name: free_udp_port() for name in
                 ("echo", "dns", "closed", "forbidden", "short", "flood", "amplify")}

        def mapping(name: str, target: int, **extra: Any) -> dict[str, Any]:
            return {"name": name, "listen": f"127.0.0.1:{ports[name]}", "node": "edge-1",
                    "target": f"127.0.0.1:{target}", **extra}

        tunnel = f"tls://127.0.0.1:{free_port()}"
        scfg = {
            "server_id": "cloud-test", "tunnel": tunnel,
            "tls": {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)},
            "tokens": [{"node": "edge-1", "token": TOKEN}],
            # 1,000 flows come from one test address: the per-client cap is raised here
            # (the flood mapping keeps a small one and checks it).
            "udp": [mapping("echo", echo.port, max_flows_per_client=2000),
                    mapping("dns", dns.port, idle_timeout=5),
                    mapping("closed", closed), mapping("forbidden", 9),
                    mapping("short", echo.port, idle_timeout=0.5),
                    mapping("flood", echo.port, max_flows=FLOOD_FLOWS,
                            max_flows_per_client=FLOOD_PER_CLIENT),
                    mapping("amplify", amplifier.port)],
            "debug_socket": str(tmp_path / "server.sock"),
            "keepalive": {"interval": 1, "timeout": 2},
        }
        acfg = {
            "node": "edge-1", "server": tunnel, "token": TOKEN,
            "tls": {"ca_file": str(certs.ca)},
            # udp/ rules only: a tcp rule for the same address must not let UDP through
            "allow": [f"udp/127.0.0.1:{echo.port}", f"udp/127.0.0.1:{dns.port}",
                      f"udp/127.0.0.1:{amplifier.port}",
                      f"udp/127.0.0.1:{closed}", "127.0.0.1:9"],
            "debug_socket": str(tmp_path / "agent.sock"),
            "keepalive": {"interval": 1, "timeout": 2},
            "reconnect": {"initial": 0.1, "maximum": 0.5},
        }
        server = NodeagentProcess("server", scfg, tmp_path, "server").start()
        agent = NodeagentProcess("agent", acfg, tmp_path, "agent")
        try:
            server.wait_ready()
            agent.start().wait_ready()
            server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                            what="edge-1 connected")
            yield UdpStack(server, agent, ports, echo, dns)
        finally:
            for proc in (server, agent):
                proc.kill()
            for proc in (server, agent):
                assert "Traceback" not in proc.logs(), proc.logs()


def test_echo_keeps_each_datagram_whole_up_to_65507_bytes(udp_stack: UdpStack) -> None:
    port = udp_stack.ports["echo"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for size in (0, 1, 1400, 9000, 32_768, 65_507):
            payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
            assert exchange(port, payload, sock=sock, tries=3) == payload, size
    assert udp_stack.server.metric("nodeagent_udp_datagrams_total", direction="out") >= 6


def test_replies_go_back_to_the_client_that_asked(udp_stack: UdpStack) -> None:
    port = udp_stack.ports["echo"]
    clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(20)]
    try:
        for i, sock in enumerate(clients):
            sock.sendto(b"client-%d" % i, ("127.0.0.1", port))
        for i, sock in enumerate(clients):
            sock.settimeout(5)
            assert sock.recvfrom(100)[0] == b"client-%d" % i
        rows = udp_stack.flows()["flows"]
        mine = {r["client"] for r in rows if r["mapping"] == "udp:echo"}
        assert {f"127.0.0.1:{s.getsockname()[1]}" for s in clients} <= mine
    finally:
        for sock in clients:
            sock.close()


def test_a_thousand_concurrent_flows(udp_stack: UdpStack) -> None:
    port = udp_stack.ports["echo"]
    clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(1000)]
    try:
        pending = set(range(len(clients)))
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for i in pending:  # (re)send to those without an answer yet
                clients[i].sendto(b"flow-%d" % i, ("127.0.0.1", port))
            time.sleep(0.2)
            for i in list(pending):
                clients[i].setblocking(False)
                try:
                    while True:
                        data = clients[i].recv(100)
                        assert data == b"flow-%d" % i
                        pending.discard(i)
                except BlockingIOError:
                    pass
        assert not pending, f"{len(pending)} flows got no answer"
        flows = [r for r in udp_stack.flows()["flows"] if r["mapping"] == "udp:echo"]
        assert len(flows) >= 1000
        # the agent holds each flow as a stream to the udp:// target
        streams = fetch_debug(udp_stack.agent.socket, "/streams")["streams"]
        assert sum(1 for s in streams if s["target"].startswith("udp://")) >= 1000
    finally:
        for sock in clients:
            sock.close()


def test_idle_flows_expire_on_both_sides(udp_stack: UdpStack) -> None:
    port = udp_stack.ports["short"]  # idle_timeout 0.5 s
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        assert exchange(port, b"ping", sock=sock, tries=3) == b"ping"
        me = f"127.0.0.1:{sock.getsockname()[1]}"

        def live() -> bool:
            return any(r["client"] == me and r["mapping"] == "udp:short"
                       for r in udp_stack.flows()["flows"])

        deadline = time.monotonic() + 10
        while live() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not live()

        def agent_flows() -> int:
            streams = fetch_debug(udp_stack.agent.socket, "/streams")["streams"]
            return sum(1 for s in streams if s["target"] == f"udp://127.0.0.1:"
                       f"{udp_stack.echo.port}" and "short" in str(s.get("opened_by")))

        deadline = time.monotonic() + 10
        while agent_flows() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert agent_flows() == 0
        # the same client address later gets a new flow
        assert exchange(port, b"again", sock=sock, tries=3) == b"again"


def test_a_burst_on_one_flow_does_not_starve_another(udp_stack: UdpStack) -> None:
    """One client floods 64 KB datagrams as fast as it can; another's small datagrams
    still get answers during the flood (drops land on the flooding flow)."""
    port = udp_stack.ports["echo"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as burst, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as quiet:
        assert exchange(port, b"warm", sock=quiet, tries=3) == b"warm"
        assert exchange(port, b"warm", sock=burst, tries=3) == b"warm"
        big = b"B" * 60_000
        burst.setblocking(False)
        answered = 0
        quiet.settimeout(1.0)
        for round_ in range(20):
            for _ in range(200):
                try:
                    burst.sendto(big, ("127.0.0.1", port))
                except BlockingIOError:
                    pass
            quiet.sendto(b"q%d" % round_, ("127.0.0.1", port))
            try:
                while True:
                    data = quiet.recv(100)
                    if data == b"q%d" % round_:
                        answered += 1
                        break
            except TimeoutError:
                pass
        assert answered >= 15, answered


def test_refused_and_forbidden_targets_are_dropped_and_counted(udp_stack: UdpStack) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        # Nothing listens on the target: the agent's socket gets port unreachable and
        # resets the flow REFUSED; the client's later datagrams are dropped as refused.
        for _ in range(10):
            assert exchange(udp_stack.ports["closed"], b"x", sock=sock,
                            timeout=0.2) is None
        # The target is allowed for TCP only: the agent refuses the flow (forbidden).
        assert exchange(udp_stack.ports["forbidden"], b"x", sock=sock, timeout=0.5) is None
        exchange(udp_stack.ports["forbidden"], b"x", sock=sock, timeout=0.2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
            udp_stack.drops("closed").get("refused")
            and udp_stack.drops("forbidden").get("forbidden")):
        time.sleep(0.1)
    assert udp_stack.drops("closed").get("refused", 0) >= 1
    assert udp_stack.drops("forbidden").get("forbidden", 0) >= 1
    assert udp_stack.server.metric("nodeagent_udp_drops_total", reason="forbidden") >= 1
    assert udp_stack.agent.status()["streams_by_outcome"].get("forbidden", 0) >= 1
    assert udp_stack.server.wait_for(lambda s: True)  # still serving
    assert exchange(udp_stack.ports["echo"], b"fine", tries=3) == b"fine"


def test_flows_recover_after_an_agent_restart(udp_stack: UdpStack) -> None:
    port = udp_stack.ports["echo"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        assert exchange(port, b"before", sock=sock, tries=3) == b"before"
        udp_stack.agent.kill()
        udp_stack.agent.start().wait_ready()
        # The same client address keeps sending; within a few retries its flow is
        # reopened through the new tunnel.
        answer = None
        deadline = time.monotonic() + 30
        while answer is None and time.monotonic() < deadline:
            answer = exchange(port, b"after", sock=sock, timeout=0.5)
        assert answer == b"after"


def test_flows_recover_after_a_server_restart(udp_stack: UdpStack) -> None:
    """The server's flows die with it; the same client address, sending again, gets a
    new flow once the agent has reconnected to the restarted server."""
    port = udp_stack.ports["echo"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        assert exchange(port, b"before", sock=sock, tries=3) == b"before"
        udp_stack.server.kill()
        udp_stack.server.start().wait_ready()
        answer = None
        deadline = time.monotonic() + 30
        while answer is None and time.monotonic() < deadline:
            answer = exchange(port, b"after", sock=sock, timeout=0.5)
        assert answer == b"after"
    # the agent's old flows ended with the old tunnel: only the new one is left
    streams = fetch_debug(udp_stack.agent.socket, "/streams")["streams"]
    assert sum(1 for s in streams if s["target"].startswith("udp://")) == 1


@pytest.mark.needs("dig")
def test_dns_through_the_tunnel_with_dig_and_a_python_client(udp_stack: UdpStack) -> None:
    port = udp_stack.ports["dns"]
    zone = udp_stack.dns.zone
    assert dns_query(port, f"db.{zone}") == [udp_stack.dns.address]
    assert dns_query(port, "elsewhere.example.") == []
    out = subprocess.run(["dig", "@127.0.0.1", "-p", str(port), "+short", "+tries=3",
                          "+time=2", f"api.{zone}", "A"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [udp_stack.dns.address]


def test_a_spoofed_source_flood_is_held_to_the_flow_caps(udp_stack: UdpStack) -> None:
    """Datagrams from 2,000 source addresses (127.1.x.y: loopback lets us send from any
    of them, as a spoofer would): flows stop at the mapping's caps, the rest are dropped
    and counted, and the server's memory stays bounded."""
    port = udp_stack.ports["flood"]
    # warm: one flow first, so the steady-state memory is the baseline
    assert exchange(port, b"warm", host="127.0.0.1", tries=3) == b"warm"
    # one address holds FLOOD_PER_CLIENT flows, whatever ports it sends from
    ports = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(10)]
    try:
        for s in ports:
            s.bind(("127.2.0.1", 0))
            s.sendto(b"mine", ("127.0.0.1", port))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and \
                udp_stack.drops("flood").get("client_flow_limit", 0) < 6:
            time.sleep(0.1)
        mine = [r for r in udp_stack.flows()["flows"]
                if r["mapping"] == "udp:flood" and r["client"].startswith("127.2.0.1:")]
        assert len(mine) == FLOOD_PER_CLIENT
        assert udp_stack.drops("flood")["client_flow_limit"] == 10 - FLOOD_PER_CLIENT
    finally:
        for s in ports:
            s.close()
    before = rss_kib(udp_stack.server.proc.pid)  # type: ignore[union-attr]
    sources = [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(2000)]
    for _ in range(3):
        for source in sources:
            for _ in range(2):  # two ports per address: the per-client cap is 4
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.bind((source, 0))
                    s.sendto(b"spoof" * 20, ("127.0.0.1", port))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and \
            udp_stack.drops("flood").get("flow_limit", 0) < 1000:
        time.sleep(0.1)
    flows = [r for r in udp_stack.flows()["flows"] if r["mapping"] == "udp:flood"]
    drops = udp_stack.drops("flood")
    assert len(flows) <= FLOOD_FLOWS
    assert drops.get("flow_limit", 0) >= 1000
    after = rss_kib(udp_stack.server.proc.pid)  # type: ignore[union-attr]
    assert after - before < 30 * 1024, (before, after)  # 12,000 datagrams, 200 flows


def test_no_amplification_before_a_second_datagram(udp_stack: UdpStack) -> None:
    """The target answers ten times the question's size. A single datagram (what a
    spoofer sends in a victim's name) gets nothing back beyond 3x its size; a client
    that sends again has shown it is there, and gets its answers."""
    port = udp_stack.ports["amplify"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        assert exchange(port, b"q" * 100, sock=sock, timeout=1.0) is None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and \
                not udp_stack.drops("amplify").get("amplification"):
            time.sleep(0.1)
        assert udp_stack.drops("amplify")["amplification"] == 1
        assert exchange(port, b"q" * 100, sock=sock, tries=3) == b"q" * 1000
    (row,) = [r for r in udp_stack.flows()["flows"] if r["mapping"] == "udp:amplify"]
    assert row["validated"] and row["bytes_out"] >= 1000
