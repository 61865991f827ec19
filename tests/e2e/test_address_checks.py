"""The server's address checks against a real `nodeagent server` process, attacked as a
compromised node would: a tunnel client holding a node's token opens streams to the
IPv6 forms of addresses it must not reach (another node's pod, the protected floor), and
registers under a name with a trailing newline. Each refusal is FORBIDDEN (a name:
refused at the handshake), counted by reason and logged."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import TOKEN, Certs, Upstream, server_config
from nodeagent.trust import pki
from tunnel import protocol as p
from tunnel.dial import dial
from tunnel.endpoint import (
    EndpointSettings,
    HandshakeError,
    StreamRefusedError,
    TunnelConnection,
)

pytestmark = pytest.mark.needs("root")



def local_ipv4() -> str | None:
    """A global IPv4 address of this host (not loopback: the floor protects that)."""
    out = subprocess.run(["ip", "-j", "-4", "addr", "show", "scope", "global"],
                         capture_output=True, text=True, check=False).stdout
    for link in json.loads(out or "[]"):
        for info in link.get("addr_info", []):
            if info.get("local"):
                return str(info["local"])
    return None


@pytest.fixture
def echo_anywhere() -> Iterator[int]:
    """A TCP echo service on every IPv4 address: what another node's pod stands for."""
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(5)
                try:
                    while data := conn.recv(65536):
                        conn.sendall(data)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def start_server(tmp_path: Path, certs: Certs, upstream: Upstream,
                 **extra: Any) -> NodeagentProcess:
    scfg = server_config(tmp_path, certs, upstream)
    scfg["tokens"] = [{"node": "*", "token": TOKEN}]  # the attacker may name any node
    scfg["dial_timeout"] = 2
    scfg.update(extra)
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    server.wait_ready()
    return server


async def open_as(server: NodeagentProcess, ca: Path, node: str,
                  targets: list[tuple[str, int]]) -> list[str]:
    """Register as `node` and open a stream to each target: "forbidden: <message>" for a
    refusal, "echoed" when the target answered, else the refusal's reason."""
    transport = await dial(server.config["tunnel"], ssl_context=pki.client_ssl_context(ca),
                           connect_timeout=5)
    conn = TunnelConnection(transport, p.Role.DIALER, EndpointSettings(ping_interval=0), None)
    results = []
    try:
        await conn.dial_handshake(p.Hello(identity={"node": node, "token": TOKEN}))
        async with trio.open_nursery() as nursery:
            await nursery.start(conn.run)
            for host, port in targets:
                try:
                    with trio.fail_after(10):
                        stream = await conn.open_stream(p.Target(host, port),
                                                        {"origin": "10.1.0.9:4000"})
                        await stream.send_all(b"ping")
                        data = await stream.receive_some()
                        await stream.aclose()
                    results.append("echoed" if data == b"ping" else f"answered {data!r}")
                except StreamRefusedError as exc:
                    results.append(f"{exc.reason.name.lower()}: {exc.message}")
            nursery.cancel_scope.cancel()
    finally:
        await transport.aclose()
    return results


def test_another_nodes_pod_in_ipv4_mapped_form_needs_a_relay_policy(
        tmp_path: Path, certs: Certs, upstream: Upstream, echo_anywhere: int) -> None:
    """With an IPv6 egress rule, `::ffff:<edge-2's pod>` is edge-2's pod all the same: it
    goes the relay way, and with no relay policy it is refused, never dialed directly."""
    pod = local_ipv4()
    if pod is None:
        pytest.skip("no global IPv4 address on this host to stand for a pod")
    server = start_server(tmp_path, certs, upstream, egress=["::/0:*"],
                          node_cidrs={"edge-2": [f"{pod}/32"]})
    try:
        results = trio.run(open_as, server, certs.ca, "edge-1", [
            (f"::ffff:{pod}", echo_anywhere), (pod, echo_anywhere)])
        for result in results:
            assert result.startswith("forbidden:"), results
            assert "belongs to node edge-2; no relay policy" in result, results
        assert server.metric("nodeagent_server_refusals_total",
                      reason="relay_not_allowed") == 2
        assert server.logs().count("agent stream refused: relay not allowed") == 1
    finally:
        server.kill()
    assert "Traceback" not in server.logs()


FLOOR_FORMS = [
    "64:ff9b::127.0.0.1",            # NAT64, well-known prefix
    "64:ff9b::169.254.169.254",
    "64:ff9b:1::a9fe:a9fe",          # NAT64, local-use prefix (/96 split)
    "2002:7f00:1::1",                # 6to4 of 127.0.0.1
    "2001:0:a9fe:a9fe::1",           # Teredo, the metadata address as its server
    "2001:0:102:304::5601:5601",     # Teredo, the metadata address as its client
    "::127.0.0.1",                   # IPv4-compatible
    "::ffff:127.0.0.1",              # IPv4-mapped (caught before too)
]


def test_the_floor_refuses_ipv6_addresses_that_embed_a_protected_ipv4(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    """A wide IPv6 egress rule never reaches loopback or the metadata address through an
    IPv6 form that embeds it: each is refused as protected before any dial."""
    server = start_server(tmp_path, certs, upstream, egress=["::/0:*"])
    try:
        results = trio.run(open_as, server, certs.ca, "edge-1",
                           [(host, upstream.echo_port) for host in FLOOR_FORMS])
        for host, result in zip(FLOOR_FORMS, results, strict=True):
            assert result.startswith("forbidden:") and "is protected" in result, (host, result)
        assert server.metric("nodeagent_server_refusals_total",
                      reason="egress_protected") == len(FLOOR_FORMS)
        # One log line a minute per (reason, node), however many refusals.
        assert server.logs().count("agent stream refused: protected destination") == 1, \
            server.logs()
    finally:
        server.kill()
    assert "Traceback" not in server.logs()


def test_a_node_name_with_a_trailing_newline_is_refused_at_the_handshake(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    server = start_server(tmp_path, certs, upstream)
    try:
        for name in ("edge-1\n", "edge-1.example\n"):
            with pytest.raises(HandshakeError, match="invalid node name"):
                trio.run(open_as, server, certs.ca, name, [])
        assert server.status()["agents"] == []
        assert trio.run(open_as, server, certs.ca, "edge-1", []) == []  # a valid name: in
    finally:
        server.kill()
    assert "Traceback" not in server.logs()
