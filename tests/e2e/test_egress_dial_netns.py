"""The server's dial of intercepted pod traffic, end to end in network namespaces (real
agent and server processes, the real kernel): the agent intercepts a pod's connection and
opens a stream; the server decides it by its egress policy and dials it from the
tunnel connection's reader and splice loop, with no task per connection
(`AgentStreams.take_agent_stream`). A destination the policy denies never sees a SYN (a
netfilter counter in `remote` says so), one that never answers is refused when the
server's `dial_timeout` passes, one that refuses (RST) is refused as such, one that
accepts is relayed; the pod's connection is reset for each refusal, and the server counts
each outcome and logs the policy's refusal."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.testing.netns import Topology, in_netns
from tests.e2e.interceptlab import NODE_POD_IF, Lab, intercept_lab
from tests.e2e.test_intercept_netns import _expect_reset, connect_from

pytestmark = [pytest.mark.netns, pytest.mark.needs("nft")]

# In remote (10.30.0.2): 8080 echoes; 7070 echoes but egress does not allow it; nothing
# listens on 5050 (RST); 4040's SYNs are dropped (no answer: the dial times out).
ECHO, DENIED, CLOSED, BLACKHOLE = 8080, 7070, 5050, 4040


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    def count_and_drop(topo: Topology) -> None:
        topo.exec("remote", ["nft", "-f", "-"], input=(
            "table inet probe {\n chain input {\n  type filter hook input priority 0;\n"
            f"  tcp dport {DENIED} tcp flags syn counter\n"
            f"  tcp dport {BLACKHOLE} drop\n"
            " }\n}\n"))

    with intercept_lab(
        tmp_path, peer=["tests.e2e.peerecho", f"0.0.0.0:{ECHO}", f"0.0.0.0:{DENIED}"],
        egress=[f"10.30.0.0/24:{port}" for port in (ECHO, CLOSED, BLACKHOLE)],
        intercept={"proxy_port": 15001, "rules": [
            {"name": "to-remote", "destinations": ["10.30.0.0/24"],
             "ports": [ECHO, DENIED, CLOSED, BLACKHOLE],
             "source_interfaces": [NODE_POD_IF]}]},
        before_agent=count_and_drop, server_extra={"dial_timeout": 1},
    ) as lab:
        yield lab


def syns_seen(topo: Topology) -> int:
    rules = topo.exec("remote", ["nft", "list", "chain", "inet", "probe", "input"]).stdout
    match = re.search(rf"dport {DENIED} .*counter packets (\d+)", rules)
    assert match is not None, rules
    return int(match.group(1))


def test_the_server_dials_only_what_egress_allows_and_refuses_failed_dials(lab: Lab) -> None:
    topo, server, agent = lab.topo, lab.server, lab.agent
    assert connect_from(topo, "pod", "10.30.0.2", ECHO) == "peer=10.30.0.1"
    # The denied destination is reachable by plain routing from the cloud: only the
    # policy keeps the server from dialing it.
    with in_netns(topo.ns("cloud")):
        socket.create_connection(("10.30.0.2", DENIED), timeout=5).close()
    assert syns_seen(topo) == 1
    for _ in range(3):
        _expect_reset(topo, "pod", "10.30.0.2", DENIED)
    _expect_reset(topo, "pod", "10.30.0.2", CLOSED)
    _expect_reset(topo, "pod", "10.30.0.2", BLACKHOLE)
    status = server.wait_for(
        lambda s: s["streams_by_outcome"].get("agent_opened:forbidden", 0) >= 3
        and s["streams_by_outcome"].get("agent_opened:refused", 0) >= 1
        and s["streams_by_outcome"].get("agent_opened:timeout", 0) >= 1,
        what="outcomes counted")
    assert status["streams_by_outcome"]["agent_opened:egress"] == 1
    # Deny by default: not one SYN of the server's reached the denied destination.
    assert syns_seen(topo) == 1
    logs = server.logs()
    assert logs.count("agent stream refused: destination not allowed") == 1  # rate-limited
    assert server.metric("nodeagent_server_refusals_total", reason="egress_not_allowed") == 3
    outcomes = agent.wait_for(
        lambda s: sum(s["intercepted_by_outcome"].values()) >= 6,
        what="agent outcomes")["intercepted_by_outcome"]
    assert outcomes == {"tunnel": 1, "forbidden": 3, "refused": 1, "timeout": 1}
