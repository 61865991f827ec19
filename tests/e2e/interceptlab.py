"""The interception lab the netns e2e tests share (TCP in test_intercept_netns, UDP in
test_intercept_udp_netns):

    pod (10.10.0.2) ── node: agent (10.10.0.1 | 10.20.0.1) ── cloud: server (10.20.0.2 |
    10.30.0.1) ── remote: destinations (10.30.0.2, 10.30.0.3, fd30::2)

with IPv6 beside IPv4 on every link, a peer process serving the destinations in
`remote`, the server in `cloud` (its `egress` list) and the agent in `node` (its
`intercept` section; `{node_pod_if}` in a rule's source_interfaces is the node's
interface toward the pod). Everything it started is stopped, and the namespaces
removed, however the test ends; a traceback in either process's log fails it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nodeagent.testing.netns import Topology, netns_available
from nodeagent.testing.procs import NodeagentProcess, kill_all, nodeagent_logs
from nodeagent.trust import pki

TOKEN = "netns-token-0123456789abcdef"
NODE_POD_IF = "{node_pod_if}"


@dataclass
class Lab:
    topo: Topology
    server: NodeagentProcess
    agent: NodeagentProcess
    node_pod_if: str


def _with_pod_if(value: Any, pod_if: str) -> Any:
    """`value` with NODE_POD_IF replaced by the real interface name, at any depth."""
    if value == NODE_POD_IF:
        return pod_if
    if isinstance(value, dict):
        return {k: _with_pod_if(v, pod_if) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_pod_if(v, pod_if) for v in value]
    return value


@contextmanager
def intercept_lab(tmp_path: Path, *, peer: list[str], egress: list[str],
                  intercept: dict[str, Any],
                  before_agent: Callable[[Topology], None] | None = None,
                  server_extra: dict[str, Any] | None = None) -> Iterator[Lab]:
    """The lab with `python -m PEER...` serving in `remote` (it prints "ready" once
    listening); `before_agent` runs once the server is up, before the agent starts;
    `server_extra`: more of the server's config (e.g. its dial_timeout)."""
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
        served = topo.popen("remote", [sys.executable, "-m", *peer], stdout=subprocess.PIPE,
                            cwd=str(Path(__file__).parents[2]))
        procs.append(served)
        assert served.stdout is not None and served.stdout.readline().strip() == b"ready"

        ca = pki.create_ca("netns CA")
        ca.write(tmp_path / "ca.crt", tmp_path / "ca.key")
        pki.issue_server_certificate(ca, [], ["10.20.0.2"]).write(
            tmp_path / "s.crt", tmp_path / "s.key")
        server = NodeagentProcess("server", {
            "tunnel": "tls://10.20.0.2:8443",
            "tls": {"cert_file": str(tmp_path / "s.crt"), "key_file": str(tmp_path / "s.key")},
            "tokens": [{"node": "edge-1", "token": TOKEN}],
            "egress": egress,
            "debug_socket": str(tmp_path / "server.sock"),
            **(server_extra or {}),
        }, tmp_path, "server", netns=topo.ns("cloud")).start()
        procs.append(server)
        server.wait_ready()
        if before_agent is not None:
            before_agent(topo)
        agent = NodeagentProcess("agent", {
            "node": "edge-1", "server": "tls://10.20.0.2:8443", "token": TOKEN,
            "tls": {"ca_file": str(tmp_path / "ca.crt")},
            "debug_socket": str(tmp_path / "agent.sock"),
            "reconnect": {"initial": 0.1, "maximum": 1},
            "intercept": _with_pod_if(intercept, node_pod_if),
        }, tmp_path, "agent", netns=topo.ns("node"))
        agent.start()
        procs.append(agent)
        agent.wait_ready()
        server.wait_for(lambda s: s["agents"], what="agent connected")
        yield Lab(topo, server, agent, node_pod_if)
    finally:
        kill_all(procs)
        topo.close()
        for logs in nodeagent_logs(procs):
            assert "Traceback" not in logs, logs
