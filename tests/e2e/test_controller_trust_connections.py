"""The controller's config stream under a flood of idle connections, with real sockets
and a real controller process: one address holding as many connections as it can open
gets at most `--max-anonymous-per-peer` of them (the rest closed at once), those it holds
are closed after `--anonymous-deadline-seconds`, the controller's open files stay
bounded, and a legitimate client — a node reading its config, an agent enrolling — is
served meanwhile."""

from __future__ import annotations

import functools
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from nodeagent.kube.resources import CONFIGMAPS, NODES
from tests.controller.identity import obtain_identity
from tests.e2e.test_controller_trust import Reader
from tests.e2e.test_kubernetes import (  # noqa: F401 (fixtures)
    add_token,
    controllers,
    pod,
    read_config,
    wait_for,
)

FLOOD = 600
PER_PEER = 100


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.controller_args("--max-anonymous-per-peer", str(PER_PEER),
                             "--anonymous-deadline-seconds", "3")
def test_idle_connections_from_one_address_are_capped_and_a_client_is_still_served(
        controllers: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811 (the fixture)
    api, port = controllers["api"], controllers["ports"]["c1"]
    c1 = controllers["procs"][0]
    assert c1.proc is not None
    pid = c1.proc.pid
    api.create(NODES, {"metadata": {"name": "edge-1"}})
    api.create(NODES, {"metadata": {"name": "edge-2"}})
    reader = Reader(api, port)  # edge-1's and a server's certificates
    before = open_files(pid)

    # The attacker: 127.0.0.2, as many idle TCP connections as it can open.
    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.connect(("127.0.0.1", port))
            flood.append(sock)
        time.sleep(0.5)
        during = open_files(pid)
        refused = sum(closed_by_peer(s) for s in flood)
        print(f"\ncontroller open files: {before} before, {during} with {FLOOD} idle "
              f"connections from one address ({refused} closed at once)")
        assert during <= before + PER_PEER + 20, (before, during)
        assert refused >= FLOOD - PER_PEER - 5, refused

        # Meanwhile, from another address: a node reads its config, an agent enrolls.
        status, body = read_config(port, "/v1/config/nodes/edge-1", reader.node)
        assert status == 200, body
        ca_pem = api.get(CONFIGMAPS, "nodeagent-ca", "nodeagent")["data"]["ca.crt"]
        uid = pod(api, "nodeagent-agent-x2", "edge-2", "nodeagent-agent")
        token = "e2e-conn-agent2-token-0123456789"
        add_token(api, token, namespace="nodeagent", service_account="nodeagent-agent",
                  pod_name="nodeagent-agent-x2", pod_uid=uid, node_name="edge-2",
                  node_uid="n2", audiences=["nodeagent"])
        started = time.monotonic()
        trio.run(functools.partial(obtain_identity, f"https://127.0.0.1:{port}", ca_pem,
                                   token, "node"))
        print(f"an agent enrolled during the flood in {time.monotonic() - started:.2f}s")

        # The idle ones the cap let in are closed at the deadline.
        wait_for(lambda: all(closed_by_peer(s) for s in flood), "the idle connections closed",
                 timeout=10)
        wait_for(lambda: open_files(pid) <= before + 5, "the controller's files back")
        assert "too_many_from_peer" in c1.logs()
        assert c1.logs().count("config stream connection refused") == 1  # once a minute
    finally:
        for sock in flood:
            sock.close()
