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

from nodeagent.testing.netns import Topology, in_netns
from tests.e2e.interceptlab import NODE_POD_IF, intercept_lab

pytestmark = [pytest.mark.netns, pytest.mark.needs("nft")]


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with intercept_lab(
        tmp_path,
        peer=["tests.e2e.peerudp", "10.30.0.2:7000", "10.30.0.3:7000", "0.0.0.0:7001",
              "[::]:7000", "--dns", "10.30.0.2:53", "--dns-asker", "10.30.0.3:53"],
        # udp/ rules: 7001 is caught by the agent but not allowed here (forbidden); a tcp
        # rule for 7001 must not let UDP out.
        egress=["udp/10.30.0.0/24:7000", "udp/10.30.0.2:53", "udp/[fd30::2]:7000",
                "10.30.0.0/24:7001"],
        intercept={"mode": "tproxy", "proxy_port": 15001, "rules": [
            {"name": "udp-to-remote", "protocol": "udp",
             "destinations": ["10.30.0.0/24", "fd30::/64"], "ports": [53, 7000, 7001],
             "source_interfaces": [NODE_POD_IF], "exclude": ["10.30.0.3/32"]},
            # DNS by zone: the pod's resolver is 10.30.0.3 (answers with who asked);
            # names in svc.cloud.internal go to the cloud-side one, 10.30.0.2.
            {"name": "dns-by-zone", "protocol": "UDP", "destinations": ["10.30.0.3/32"],
             "ports": [53], "source_interfaces": [NODE_POD_IF],
             "dns_zones": ["svc.cloud.internal"], "dns_resolver": "10.30.0.2:53"},
        ]},
    ) as lab:
        yield {"topo": lab.topo, "server": lab.server, "agent": lab.agent}


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
