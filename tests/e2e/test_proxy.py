"""An agent whose only way out is a forward proxy: real proxies, in network namespaces.

    edge: agent edge-1, its target (127.0.0.1:7000)
      ── 10.50.0.1 | 10.50.0.2 ── proxy: tinyproxy :3128 (HTTP CONNECT, Basic auth),
                                        microsocks :1080 (SOCKS5, user/password)
      ── 10.60.0.1 | 10.60.0.2 ── cloud: server (tls :8443 or wss :8443/tunnel),
                                         public TCP :2222 → edge-1 127.0.0.1:7000

Nothing forwards and the edge has no route to 10.60.0.0/24: the agent reaches its server
through the proxy or not at all. Each test passes traffic from the cloud through the
tunnel to the edge's target; the wrong-credential tests check one clear line, backoff,
and no crash or leaked password.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nodeagent import __version__
from nodeagent.testing.netns import Topology, in_netns, netns_available
from nodeagent.testing.procs import NodeagentProcess, kill_all, nodeagent_logs
from nodeagent.trust import pki

pytestmark = [pytest.mark.netns, pytest.mark.needs("tinyproxy", "microsocks")]
TOKEN = "proxy-token-0123456789abcdef"
USER, PASSWORD = "alice", "pr0xy-pass"
PROXIES = {"http": f"http://{USER}:{PASSWORD}@10.50.0.2:3128",
           "socks5": f"socks5://{USER}:{PASSWORD}@10.50.0.2:1080"}
REDACTED = {"http": f"http://{USER}:[redacted]@10.50.0.2:3128",
            "socks5": f"socks5://{USER}:[redacted]@10.50.0.2:1080"}
SERVER_URLS = {"tls": "tls://10.60.0.2:8443", "wss": "wss://10.60.0.2:8443/tunnel"}


@dataclass
class Lab:
    topo: Topology
    tmp: Path
    procs: list[Any] = field(default_factory=list)

    def start_server(self, scheme: str) -> NodeagentProcess:
        tmp = self.tmp
        listen = "tls://0.0.0.0:8443" if scheme == "tls" else "wss://0.0.0.0:8443/tunnel"
        server = NodeagentProcess("server", {
            "tunnel": listen,
            "tls": {"cert_file": str(tmp / "s.crt"), "key_file": str(tmp / "s.key")},
            "tokens": [{"node": "edge-1", "token": TOKEN}],
            "tcp": [{"name": "echo", "listen": "127.0.0.1:2222", "node": "edge-1",
                     "target": "127.0.0.1:7000"}],
            "debug_socket": str(tmp / "server.sock"),
        }, tmp, "server", netns=self.topo.ns("cloud")).start()
        self.procs.append(server)
        server.wait_ready()
        return server

    def start_agent(self, scheme: str, **extra: Any) -> NodeagentProcess:
        agent = NodeagentProcess("agent", {
            "node": "edge-1", "server": SERVER_URLS[scheme], "token": TOKEN,
            "tls": {"ca_file": str(self.tmp / "ca.crt")},
            "allow": ["127.0.0.1:7000"],
            "debug_socket": str(self.tmp / "agent.sock"),
            "reconnect": {"initial": 0.2, "maximum": 2},
            **extra,
        }, self.tmp, "agent", netns=self.topo.ns("edge")).start()
        self.procs.append(agent)
        agent.wait_ready()
        return agent

    def echo_from_cloud(self, payload: bytes) -> bytes:
        with in_netns(self.topo.ns("cloud")):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with sock:
            sock.settimeout(10)
            sock.connect(("127.0.0.1", 2222))
            greeting = b""
            while not greeting.endswith(b"\n"):
                chunk = sock.recv(1)
                assert chunk, f"closed before the greeting: {greeting!r}"
                greeting += chunk
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            echoed = b""
            while chunk := sock.recv(65536):
                echoed += chunk
            return echoed


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)
    topo = Topology()
    lab = Lab(topo, tmp_path)
    try:
        for name in ("edge", "proxy", "cloud"):
            topo.add(name)
        topo.link("edge", ["10.50.0.1/24"], "proxy", ["10.50.0.2/24"], forward=False)
        topo.link("proxy", ["10.60.0.1/24"], "cloud", ["10.60.0.2/24"], forward=False)
        # The edge's node-local target: greets with the peer it sees, then echoes.
        target = topo.popen("edge", [sys.executable, "-m", "tests.e2e.peerecho",
                                     "127.0.0.1:7000"],
                            stdout=subprocess.PIPE, cwd=str(Path(__file__).parents[2]))
        lab.procs.append(target)
        assert target.stdout is not None and target.stdout.readline().strip() == b"ready"
        (tmp_path / "tinyproxy.conf").write_text(
            "Port 3128\nListen 10.50.0.2\nTimeout 60\nMaxClients 20\nLogLevel Info\n"
            f"BasicAuth {USER} {PASSWORD}\n")
        for cmd in (["tinyproxy", "-d", "-c", str(tmp_path / "tinyproxy.conf")],
                    ["microsocks", "-i", "10.50.0.2", "-p", "1080", "-u", USER,
                     "-P", PASSWORD]):
            log = (tmp_path / f"{cmd[0]}.log").open("wb")
            lab.procs.append(topo.popen("proxy", cmd, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        ca = pki.create_ca("proxy lab CA")
        ca.write(tmp_path / "ca.crt", tmp_path / "ca.key")
        pki.issue_server_certificate(ca, [], ["10.60.0.2"]).write(
            tmp_path / "s.crt", tmp_path / "s.key")
        yield lab
    finally:
        kill_all(lab.procs)
        topo.close()
        for logs in nodeagent_logs(lab.procs):
            assert "Traceback" not in logs, logs
            assert PASSWORD not in logs, "a proxy password reached the log"


def connected(status: dict[str, Any]) -> bool:
    return any(a["node"] == "edge-1" for a in status["agents"])


@pytest.mark.parametrize("kind", ["http", "socks5"])
@pytest.mark.parametrize("scheme", ["tls", "wss"])
def test_agent_reaches_its_server_only_through_the_proxy(lab: Lab, kind: str,
                                                         scheme: str) -> None:
    server = lab.start_server(scheme)
    agent = lab.start_agent(scheme, proxy=PROXIES[kind])
    server.wait_for(connected, what="edge-1 connected through the proxy", timeout=15)
    payload = bytes(range(256)) * 1024
    assert lab.echo_from_cloud(payload) == payload
    tunnel = agent.status()["tunnel"]
    assert tunnel["state"] == "connected"
    assert tunnel["proxy"] == f"proxy {REDACTED[kind]}"
    assert tunnel["peer"] == f"10.60.0.2:8443 via 10.50.0.2:{PROXIES[kind][-4:]}"
    # The server sees the proxy as the agent's address: the stream really went through it.
    agents = server.status()["agents"]
    assert any(a["node"] == "edge-1" and a.get("peer", "").startswith("10.60.0.1")
               for a in agents), agents
    assert [a["agent_version"] for a in agents] == [__version__]


def test_https_proxy_from_the_environment(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    server = lab.start_server("wss")
    monkeypatch.setenv("HTTPS_PROXY", PROXIES["http"])
    monkeypatch.setenv("NO_PROXY", "localhost,.cluster.local,10.96.0.0/12")
    agent = lab.start_agent("wss")
    server.wait_for(connected, what="edge-1 connected through HTTPS_PROXY", timeout=15)
    assert lab.echo_from_cloud(b"through the environment's proxy") == (
        b"through the environment's proxy")
    assert agent.status()["tunnel"]["proxy"] == f"HTTPS_PROXY {REDACTED['http']}"


def test_no_proxy_sends_the_agent_direct(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """NO_PROXY naming the server: the agent dials it directly, which this edge cannot."""
    lab.start_server("tls")
    monkeypatch.setenv("HTTPS_PROXY", PROXIES["http"])
    monkeypatch.setenv("NO_PROXY", "10.60.0.0/24")
    agent = lab.start_agent("tls")
    status = agent.wait_for(lambda s: s["tunnel"]["failures"] >= 1, what="a failed dial")
    assert "via" not in (status["tunnel"]["last_error"] or "")
    assert status["tunnel"]["proxy"] == f"HTTPS_PROXY {REDACTED['http']}"
    assert "proxy" not in status["tunnel"]["last_error"]


@pytest.mark.parametrize(("kind", "says"), [
    # tinyproxy answers a CONNECT with wrong credentials 401 (most proxies: 407)
    ("http", "refused CONNECT 10.60.0.2:8443 (401 Unauthorized): the credentials in the "
             "proxy URL were refused"),
    ("socks5", "refused the user name and password"),
])
def test_wrong_proxy_credentials_are_one_clear_line_and_backoff(
        lab: Lab, kind: str, says: str) -> None:
    lab.start_server("tls")
    wrong = PROXIES[kind].replace(PASSWORD, "not-the-password")
    agent = lab.start_agent("tls", proxy=wrong)
    status = agent.wait_for(lambda s: s["tunnel"]["failures"] >= 2, timeout=15,
                            what="two failed dials")
    tunnel = status["tunnel"]
    assert tunnel["state"] in ("backoff", "connecting")
    assert tunnel["last_failure"] == "rejected"  # the slowing schedule, not every second
    assert says in tunnel["last_error"], tunnel["last_error"]
    assert "not-the-password" not in str(status)
    lines = [line for line in agent.logs().splitlines() if "tunnel connect failed" in line]
    assert lines and says in lines[0]
    assert "not-the-password" not in agent.logs()
    assert agent.proc is not None and agent.proc.poll() is None  # still running


def test_proxy_down_is_unreachable_and_retried_fast(lab: Lab) -> None:
    lab.start_server("tls")
    agent = lab.start_agent("tls", proxy="http://10.50.0.2:3999")
    status = agent.wait_for(lambda s: s["tunnel"]["failures"] >= 2, what="two failed dials")
    assert status["tunnel"]["last_failure"] == "unreachable"
    assert "proxy http://10.50.0.2:3999: connection refused" in status["tunnel"]["last_error"]

