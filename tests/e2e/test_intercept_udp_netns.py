"""Pods' UDP intercepted end to end in network namespaces, with the real kernel:

    pod (10.10.0.2) ── node: agent (10.10.0.1 | 10.20.0.1) ── cloud: server (10.20.0.2 |
    10.30.0.1) ── remote: UDP services (10.30.0.2, fd30::2)

A plain UDP client in `pod` sends to a destination's IP:port. The agent's TPROXY rule
catches the datagram; the agent learns the original destination from IP_RECVORIGDSTADDR,
carries it through the tunnel as a flow, and the server sends it from the cloud (egress
allow list, `udp/` rules), so the service sees it coming from 10.30.0.1. The reply comes
back through the tunnel and leaves the node from the original destination's address, so
the pod's *connected* socket (which drops datagrams from any other source) accepts it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.testing.netns import Topology, in_netns, netns_available
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.trust import pki

pytestmark = [pytest.mark.netns, pytest.mark.needs("nft")]
TOKEN = "netns-token-0123456789abcdef"


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[dict[str, Any]]:
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)
    topo = Topology()
    procs: list[Any] = []
    try:
        for name in ("pod", "node", "cloud", "remote"):
            topo.add(name)
        _pod_if, node_pod_if = topo.link("pod", ["10.10.0.2/24", "fd10::2/64"],
                                        "node", ["10.10.0.1/24", "fd10::1/64"])
        topo.link("node", ["10.20.0.1/24", "fd20::1/64"], "cloud", ["10.20.0.2/24", "fd20::2/64"])
        topo.link("cloud", ["10.30.0.1/24", "fd30::1/64"],
                  "remote", ["10.30.0.2/24", "10.30.0.3/24", "fd30::2/64"])
        for ns, routes in {
            "pod": [("default", "10.10.0.1"), ("default", "fd10::1")],
            "node": [("10.30.0.0/24", "10.20.0.2"), ("fd30::/64", "fd20::2")],
            "cloud": [("10.10.0.0/24", "10.20.0.1"), ("fd10::/64", "fd20::1")],
            "remote": [("default", "10.30.0.1"), ("default", "fd30::1")],
        }.items():
            for dest, via in routes:
                topo.exec(ns, ["ip", "-6" if ":" in via else "-4", "route", "replace", dest,
                               "via", via])
        peer = topo.popen("remote", [sys.executable, "-m", "tests.e2e.peerudp",
                                     "10.30.0.2:7000", "10.30.0.3:7000", "0.0.0.0:7001",
                                     "[::]:7000",
                                     "--dns", "10.30.0.2:53", "--dns-asker", "10.30.0.3:53"],
                          stdout=subprocess.PIPE, cwd=str(Path(__file__).parents[2]))
        procs.append(peer)
        assert peer.stdout is not None and peer.stdout.readline().strip() == b"ready"

        ca = pki.create_ca("netns CA")
        ca.write(tmp_path / "ca.crt", tmp_path / "ca.key")
        pki.issue_server_certificate(ca, [], ["10.20.0.2"]).write(
            tmp_path / "s.crt", tmp_path / "s.key")
        server = NodeagentProcess("server", {
            "tunnel": "tls://10.20.0.2:8443",
            "tls": {"cert_file": str(tmp_path / "s.crt"), "key_file": str(tmp_path / "s.key")},
            "tokens": [{"node": "edge-1", "token": TOKEN}],
            # udp/ rules: 7001 is caught by the agent but not allowed here (forbidden);
            # a tcp rule for 7001 must not let UDP out.
            "egress": ["udp/10.30.0.0/24:7000", "udp/10.30.0.2:53", "udp/[fd30::2]:7000",
                       "10.30.0.0/24:7001"],
            "debug_socket": str(tmp_path / "server.sock"),
        }, tmp_path, "server", netns=topo.ns("cloud")).start()
        procs.append(server)
        server.wait_ready()
        agent = NodeagentProcess("agent", {
            "node": "edge-1", "server": "tls://10.20.0.2:8443", "token": TOKEN,
            "tls": {"ca_file": str(tmp_path / "ca.crt")},
            "debug_socket": str(tmp_path / "agent.sock"),
            "reconnect": {"initial": 0.1, "maximum": 1},
            "intercept": {"mode": "tproxy", "proxy_port": 15001, "rules": [
                {"name": "udp-to-remote", "protocol": "udp",
                 "destinations": ["10.30.0.0/24", "fd30::/64"], "ports": [53, 7000, 7001],
                 "source_interfaces": [node_pod_if], "exclude": ["10.30.0.3/32"]},
                # DNS by zone: the pod's resolver is 10.30.0.3 (answers with who asked);
                # names in svc.cloud.internal go to the cloud-side one, 10.30.0.2.
                {"name": "dns-by-zone", "protocol": "UDP", "destinations": ["10.30.0.3/32"],
                 "ports": [53], "source_interfaces": [node_pod_if],
                 "dns_zones": ["svc.cloud.internal"], "dns_resolver": "10.30.0.2:53"},
            ]},
        }, tmp_path, "agent", netns=topo.ns("node"))
        agent.start()
        procs.append(agent)
        agent.wait_ready()
        server.wait_for(lambda s: s["agents"], what="agent connected")
        yield {"topo": topo, "server": server, "agent": agent}
    finally:
        for proc in procs:  # every process first: a failed check must not leak the others
            proc.kill()
            if not isinstance(proc, NodeagentProcess):
                proc.wait()
                proc.stdout.close()
        topo.close()
        for proc in procs:
            if isinstance(proc, NodeagentProcess):
                assert "Traceback" not in proc.logs(), proc.logs()


def ask(topo: Topology, host: str, port: int, payload: bytes, *, tries: int = 5,
        timeout: float = 1.0) -> bytes | None:
    """From the pod, through a *connected* UDP socket: a reply from any address but
    host:port would be dropped by the kernel, so an answer proves where it came from."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with in_netns(topo.ns("pod")):
        sock = socket.socket(family, socket.SOCK_DGRAM)
    with sock:
        sock.settimeout(timeout)
        sock.connect((host, port))
        for _ in range(tries):
            sock.send(payload)
            try:
                return sock.recv(65_535)
            except TimeoutError:
                continue
    return None


@pytest.mark.parametrize(("host", "cloud"), [("10.30.0.2", "10.30.0.1"),
                                             ("fd30::2", "fd30::1")], ids=["ipv4", "ipv6"])
def test_pod_udp_goes_through_the_tunnel_and_replies_come_from_the_destination(
        lab: dict[str, Any], host: str, cloud: str) -> None:
    topo = lab["topo"]
    answer = ask(topo, host, 7000, b"hello")
    assert answer == f"peer={cloud}\n".encode() + b"hello"
    big = bytes(range(256)) * 200  # 51,200 bytes, one datagram each way
    answer = ask(topo, host, 7000, big)
    assert answer is not None and answer.endswith(big)
    agent = lab["agent"]
    assert agent.metric("nodeagent_udp_datagrams_total", direction="out") >= 2
    out = subprocess.run([sys.executable, "-m", "nodeagent", "debug", "flows", "--socket",
                          str(agent.socket)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    destination = f"[{host}]:7000" if ":" in host else f"{host}:7000"
    assert "udp-to-remote" in out.stdout and destination in out.stdout


def test_excluded_destination_is_not_intercepted(lab: dict[str, Any]) -> None:
    # plain routing: the service sees the pod itself (the cloud forwards it unchanged)
    assert ask(lab["topo"], "10.30.0.3", 7000, b"x") == b"peer=10.10.0.2\nx"


def test_a_destination_outside_the_udp_egress_rules_is_refused(lab: dict[str, Any]) -> None:
    # caught by the agent (port 7001), allowed for TCP only on the server: never sent
    assert ask(lab["topo"], "10.30.0.2", 7001, b"x", tries=3, timeout=0.5) is None
    server = lab["server"]
    server.wait_for(lambda s: server.metric("nodeagent_server_refusals_total",
                                            reason="egress_not_allowed") >= 1,
                    what="the refusal counted")


@pytest.mark.needs("dig")
def test_dns_queries_from_the_pod_reach_the_cloud_side_resolver(lab: dict[str, Any]) -> None:
    topo = lab["topo"]
    out = topo.exec("pod", ["dig", "@10.30.0.2", "+short", "+tries=3", "+time=2",
                            "api.svc.cloud.internal", "A"], check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["10.20.30.40"]
    started = time.monotonic()
    with in_netns(topo.ns("pod")):
        from nodeagent.testing.udp import dns_query
        assert dns_query(53, "db.svc.cloud.internal.", host="10.30.0.2") == ["10.20.30.40"]
    assert time.monotonic() - started < 30


@pytest.mark.needs("dig")
def test_dns_by_zone_sends_only_the_zone_through_the_tunnel(lab: dict[str, Any]) -> None:
    """The pod asks its resolver (10.30.0.3, which answers every name with the address
    that asked). A name in svc.cloud.internal goes through the tunnel to the cloud-side
    resolver instead (10.20.30.40); any other name reaches the pod's resolver directly
    from the node (10.20.0.1: not through the cloud, whose address would be 10.30.0.1).
    Both answers come from 10.30.0.3, or dig would reject them."""
    topo = lab["topo"]

    def dig(name: str) -> list[str]:
        out = topo.exec("pod", ["dig", "@10.30.0.3", "+short", "+tries=3", "+time=2",
                                name, "A"], check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert dig("api.svc.cloud.internal") == ["10.20.30.40"]
    assert dig("example.org") == ["10.20.0.1"]
    assert dig("SVC.Cloud.Internal") == ["10.20.30.40"]  # names are case-insensitive
    assert lab["agent"].status()["intercepted_udp_by_outcome"].get("dns_zone", 0) >= 1
