"""Who may register as a node, against a real `nodeagent server` process: names, mTLS
certificates, and what a stream of bad handshakes costs the server (bounded log lines)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    TOKEN,
    Certs,
    Upstream,
    agent_config,
    echo_through,
    listen_port,
    server_config,
)
from nodeagent.trust import pki
from tunnel import protocol as p
from tunnel.dial import dial
from tunnel.endpoint import EndpointSettings, HandshakeError, TunnelConnection

ATTEMPTS = 1050
BAD_NAMES = ["EDGE-1", "edge_1", "a/b", "x" * 5000 + "\nforged log line", "", "edge-1.",
             "-edge"]


def _rss_kib(proc: NodeagentProcess) -> int:
    assert proc.proc is not None
    for line in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _handshake(url: str, ca: Path, node: str) -> str:
    """One HELLO naming `node` with a valid token; the server's refusal message."""
    ctx = pki.client_ssl_context(ca)
    transport = await dial(url, ssl_context=ctx, connect_timeout=5)
    conn = TunnelConnection(transport, p.Role.DIALER, EndpointSettings(ping_interval=0), None)
    try:
        await conn.dial_handshake(p.Hello(identity={"node": node, "token": TOKEN}))
    except HandshakeError as exc:
        return str(exc)
    finally:
        await transport.aclose()
    return "accepted"


def test_node_names_are_dns_names_and_bad_handshakes_cost_bounded_log_lines(
        tmp_path: Path, certs: Certs, upstream: Upstream) -> None:
    scfg = server_config(tmp_path, certs, upstream)
    scfg["tokens"] = [{"node": "*", "token": TOKEN}]  # the name is all that is checked
    url = scfg["tunnel"]
    # Admission is not under test here: 1,050 handshakes in a row outrun the default
    # 200/s on a quiet machine, and an OVERLOADED refusal never reaches the name check.
    scfg["tunnel"] = {"url": url, "handshake_rate": 100_000, "handshake_burst": 100_000}
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    try:
        server.wait_ready()

        async def attempts(count: int) -> list[str]:
            return [await _handshake(url, certs.ca, BAD_NAMES[i % len(BAD_NAMES)])
                    for i in range(count)]

        # Warm up (imports, TLS session caches), then 1,000 more: the server's memory
        # must not grow with them.
        answers = trio.run(attempts, 50)
        rss_before = _rss_kib(server)
        answers += trio.run(attempts, ATTEMPTS - 50)
        grown = _rss_kib(server) - rss_before
        assert all("invalid node name" in a or "names no node" in a for a in answers), answers
        status = server.status()
        assert status["agents"] == []
        assert status["handshake_failures"] == ATTEMPTS
        assert grown < 8 * 1024, f"server RSS grew {grown} KiB over 1,000 bad handshakes"
        # A valid name still gets in.
        assert trio.run(_handshake, url, certs.ca, "edge-1") == "accepted"
    finally:
        server.kill()
    logs = server.logs()
    # 1,050 failures, one line per failure code a minute; nothing a peer sent is echoed.
    assert logs.count("agent handshake failed") <= 2, logs
    assert "forged log line" not in logs and "x" * 100 not in logs


@pytest.mark.needs("root")  # the agent's tunnel socket carries SO_MARK (CAP_NET_ADMIN)
@pytest.mark.parametrize("which", ["server", "ca_key"])
def test_a_certificate_that_names_no_node_is_not_a_node(tmp_path: Path, certs: Certs,
                                                        upstream: Upstream, which: str) -> None:
    """The server's own certificate (clientAuth, same CA, CN only) used as an agent's is
    refused: a CN never names a node; only a nodeagent://node/<name> URI SAN does."""
    scfg = server_config(tmp_path, certs, upstream, mtls=True)
    scfg["tokens"] = []
    server = NodeagentProcess("server", scfg, tmp_path, "server").start()
    acfg = agent_config(tmp_path, certs, upstream, scfg["tunnel"], node="localhost")
    del acfg["token"]
    if which == "server":
        acfg["tls"].update(cert_file=str(certs.server_cert), key_file=str(certs.server_key))
    else:  # a CN-only client certificate from the same CA
        ca = pki.CertificateAuthority.load(certs.ca, certs.ca.with_suffix(".key"))
        issued = pki.issue_client_certificate(ca, "localhost")
        cert = issued.certificate
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        stripped = (x509.CertificateBuilder().subject_name(cert.subject)
                    .issuer_name(cert.issuer).public_key(cert.public_key())
                    .serial_number(x509.random_serial_number())
                    .not_valid_before(cert.not_valid_before_utc)
                    .not_valid_after(cert.not_valid_after_utc)
                    .add_extension(cert.extensions.get_extension_for_class(
                        x509.ExtendedKeyUsage).value, False)
                    .sign(ca.signing_key, hashes.SHA256()))
        assert issued.key is not None
        pki.write_certificate(tmp_path / "cn-only.crt", stripped)
        pki.write_private_key(tmp_path / "cn-only.key", issued.key)
        acfg["tls"].update(cert_file=str(tmp_path / "cn-only.crt"),
                           key_file=str(tmp_path / "cn-only.key"))
    agent = NodeagentProcess("agent", acfg, tmp_path, "agent")
    try:
        server.wait_ready()
        agent.start().wait_ready()
        agent.wait_for(lambda s: s["tunnel"]["failures"] >= 1, what="agent refused")
        assert server.status()["agents"] == []
        server.wait_for_log("its certificate names no node")
        # The real node certificate still works on the same server.
        acfg2 = agent_config(tmp_path, certs, upstream, scfg["tunnel"],
                             debug_socket=str(tmp_path / "real.sock"))
        del acfg2["token"]
        acfg2["tls"].update(cert_file=str(certs.agent_cert), key_file=str(certs.agent_key))
        real = NodeagentProcess("agent", acfg2, tmp_path, "real").start()
        try:
            server.wait_for(lambda s: s["agents"], what="edge-1 connected")
            assert echo_through(listen_port(server, 0), b"ok") == b"ok"
        finally:
            real.kill()
    finally:
        agent.kill()
        server.kill()
