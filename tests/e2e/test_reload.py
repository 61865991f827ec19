"""Credentials reloaded from their files while running: real server and agent processes,
real TLS. A rotated file is used by the next handshake; tunnels already up keep running;
a broken file keeps the loaded credentials and costs one log line; a removed token ends
its tunnel."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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

pytestmark = pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)

# Every wait below follows its event (the 0.3 s file poll, an agent's dial or redial); the
# limit is only a hang guard. It is generous because on a loaded machine a redial after a
# handshake that timed out comes on the agent's backoff (1 s doubling), and a starved
# server polls late: 10 s was once missed with nothing wrong.
WAIT = 60.0


@pytest.fixture(autouse=True)
def fast_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODEAGENT_RELOAD_INTERVAL", "0.3")


@pytest.fixture
def procs() -> Iterator[list[NodeagentProcess]]:
    started: list[NodeagentProcess] = []
    yield started
    for proc in started:
        proc.kill()
    for proc in started:
        assert "Traceback" not in proc.logs(), proc.logs()


def start(procs: list[NodeagentProcess], role: str, cfg: dict[str, Any], tmp: Path,
          name: str) -> NodeagentProcess:
    proc = NodeagentProcess(role, cfg, tmp, name).start()
    procs.append(proc)
    proc.wait_ready()
    return proc


def presented_serial(port: int, ca: Path) -> int:
    """The serial of the certificate the tunnel listener presents to a new handshake."""
    context = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return pki.load_certificates(ssl.DER_cert_to_PEM_cert(der).encode())[0].serial_number


def wait_until(predicate: Any, what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if result := predicate():
                return result
        except (OSError, ssl.SSLError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout}s")


def own_pki(tmp: Path) -> tuple[pki.CertificateAuthority, Path, Path, Path]:
    ca = pki.create_ca("reload CA")
    ca.write(tmp / "ca.crt", tmp / "ca.key")
    leaf = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"])
    leaf.write(tmp / "tunnel.crt", tmp / "tunnel.key")
    return ca, tmp / "ca.crt", tmp / "tunnel.crt", tmp / "tunnel.key"


def test_a_rotated_tunnel_certificate_serves_new_handshakes_and_old_tunnels_stay(
        tmp_path: Path, certs: Certs, upstream: Upstream,
        procs: list[NodeagentProcess]) -> None:
    ca, ca_file, cert, key = own_pki(tmp_path)
    scfg = server_config(tmp_path, certs, upstream)
    scfg["tls"] = {"cert_file": str(cert), "key_file": str(key)}
    server = start(procs, "server", scfg, tmp_path, "server")
    acfg = agent_config(tmp_path, certs, upstream, scfg["tunnel"])
    acfg["tls"] = {"ca_file": str(ca_file)}
    start(procs, "agent", acfg, tmp_path, "agent")
    server.wait_for(lambda s: s["agents"], timeout=WAIT, what="agent connected")
    port = int(scfg["tunnel"].rsplit(":", 1)[1])
    first = presented_serial(port, ca_file)
    (before,) = server.status()["agents"]
    held = socket.create_connection(("127.0.0.1", listen_port(server, 0)), timeout=5)
    held.sendall(b"before")
    assert held.recv(6) == b"before"

    renewed = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"])
    renewed.write(cert, key)
    second = wait_until(lambda: (s := presented_serial(port, ca_file)) != first and s,
                        "the renewed certificate served")
    assert second == renewed.certificate.serial_number
    # The tunnel that was up is the same connection, and its open stream still flows.
    held.sendall(b"after")
    assert held.recv(5) == b"after"
    held.close()
    (after,) = server.status()["agents"]
    assert after["peer"] == before["peer"]
    assert echo_through(listen_port(server, 0), b"new stream") == b"new stream"

    # A half-written certificate: the server keeps the loaded one and says so once.
    # Counted from here: a poll between the rotation's two file writes (each atomic; the
    # new certificate beside the old key) was one broken state already, said once and
    # healed by the next poll. The broken file is put in place atomically too (a
    # truncating write could be seen empty, then partial: two states, two lines).
    failures = server.status()["reloads"]["tunnel_tls"]["failures"]
    lines = server.logs().count("changed files not usable")
    partial = cert.with_name("partial.crt")
    partial.write_bytes(b"-----BEGIN CERTIFICATE-----\nMIIB")
    partial.replace(cert)
    server.wait_for(lambda s: s["reloads"]["tunnel_tls"]["failures"] >= failures + 1,
                    timeout=WAIT, what="the broken file noticed")
    time.sleep(1.0)  # several polls
    assert presented_serial(port, ca_file) == second
    assert server.status()["reloads"]["tunnel_tls"]["failures"] == failures + 1
    assert server.logs().count("changed files not usable") == lines + 1
    # The line names the file's setting, as a config error at start would.
    assert "server.yaml: tls.cert_file" in server.logs()
    assert echo_through(listen_port(server, 0), b"still") == b"still"
    # Fixed again: picked up.
    third = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"])
    third.write(cert, key)
    wait_until(lambda: presented_serial(port, ca_file) == third.certificate.serial_number,
               "the fixed certificate served")
    assert server.status()["reloads"]["tunnel_tls"]["reloads"] == 2


def test_a_removed_or_rotated_token_file_ends_its_tunnel_and_refuses_it(
        tmp_path: Path, certs: Certs, upstream: Upstream,
        procs: list[NodeagentProcess]) -> None:
    token_file = tmp_path / "edge-1.token"
    token_file.write_text(TOKEN)
    scfg = server_config(tmp_path, certs, upstream)
    scfg["tokens"] = [{"node": "edge-1", "token_file": str(token_file)}]
    server = start(procs, "server", scfg, tmp_path, "server")
    old = start(procs, "agent", agent_config(tmp_path, certs, upstream, scfg["tunnel"]),
                tmp_path, "agent")
    server.wait_for(lambda s: s["agents"], timeout=WAIT, what="agent connected")
    assert echo_through(listen_port(server, 0), b"x") == b"x"

    rotated = "rotated-token-abcdefghijklmnop"
    token_file.write_text(rotated)
    server.wait_for(lambda s: not s["agents"], timeout=WAIT, what="the old token's tunnel closed")
    old.wait_for(lambda s: s["tunnel"]["failures"] >= 1, timeout=WAIT, what="its redial refused")
    assert "agent disconnected: its token was removed" in server.logs()
    assert server.status()["agents"] == []
    # The new token works for a new handshake.
    new = start(procs, "agent", dict(agent_config(tmp_path, certs, upstream, scfg["tunnel"]),
                                     token=rotated, debug_socket=str(tmp_path / "a2.sock")),
                tmp_path, "agent2")
    server.wait_for(lambda s: s["agents"], timeout=WAIT, what="the new token's agent connected")
    assert echo_through(listen_port(server, 0), b"y") == b"y"
    old.kill()

    # A token file that is gone: that token is removed.
    token_file.unlink()
    server.wait_for(lambda s: not s["agents"],
                    timeout=WAIT, what="the removed token's tunnel closed")
    new.wait_for(lambda s: s["tunnel"]["state"] != "connected", timeout=WAIT, what="agent refused")
    metrics = server.status()
    assert metrics["reloads"]["tokens"]["reloads"] == 2


def test_ca_bundle_and_agent_certificate_files_reload_for_standalone_mtls(
        tmp_path: Path, certs: Certs, upstream: Upstream,
        procs: list[NodeagentProcess]) -> None:
    """The standalone CA rotation: the server's client CA file goes from the old CA to a
    bundle of both to the new one alone; the agent's certificate files are replaced by
    one from the new CA while its tunnel runs; no restart anywhere."""
    old_ca, ca_file, cert, key = own_pki(tmp_path)
    new_ca = pki.create_ca("reload CA 2")
    client_ca = tmp_path / "clients.pem"
    client_ca.write_bytes(old_ca.certificate_pem)
    scfg = server_config(tmp_path, certs, upstream)
    scfg["tokens"] = []
    scfg["tls"] = {"cert_file": str(cert), "key_file": str(key),
                   "client_ca_file": str(client_ca)}
    server = start(procs, "server", scfg, tmp_path, "server")
    agent_cert, agent_key = tmp_path / "edge-1.crt", tmp_path / "edge-1.key"
    pki.issue_client_certificate(old_ca, "edge-1").write(agent_cert, agent_key)
    acfg = agent_config(tmp_path, certs, upstream, scfg["tunnel"])
    del acfg["token"]
    acfg["tls"] = {"ca_file": str(ca_file), "cert_file": str(agent_cert),
                   "key_file": str(agent_key)}
    agent = start(procs, "agent", acfg, tmp_path, "agent")
    server.wait_for(lambda s: s["agents"],
                    timeout=WAIT, what="agent connected with the old CA's cert")
    (before,) = server.status()["agents"]

    # Step 1: trust both. Step 2-3: the agent's certificate is now from the new CA.
    client_ca.write_bytes(old_ca.certificate_pem + new_ca.certificate_pem)
    server.wait_for(lambda s: s["reloads"]["tunnel_tls"]["reloads"] == 1,
                    timeout=WAIT, what="bundle")
    pki.issue_client_certificate(new_ca, "edge-1").write(agent_cert, agent_key)
    agent.wait_for_log("reloaded from changed files")
    # Step 4: the old CA removed. The running tunnel (old CA's certificate) stays up.
    client_ca.write_bytes(new_ca.certificate_pem)
    server.wait_for(lambda s: s["reloads"]["tunnel_tls"]["reloads"] == 2,
                    timeout=WAIT, what="new CA only")
    (still,) = server.status()["agents"]
    assert still["peer"] == before["peer"]
    assert echo_through(listen_port(server, 0), b"z") == b"z"
    # A new handshake with the old CA's certificate is refused...
    stale = dict(acfg, debug_socket=str(tmp_path / "stale.sock"))
    stale_cert, stale_key = tmp_path / "stale.crt", tmp_path / "stale.key"
    pki.issue_client_certificate(old_ca, "edge-1").write(stale_cert, stale_key)
    stale["tls"] = dict(acfg["tls"], cert_file=str(stale_cert), key_file=str(stale_key))
    old_agent = start(procs, "agent", stale, tmp_path, "stale")
    old_agent.wait_for(lambda s: s["tunnel"]["failures"] >= 1,
                       timeout=WAIT, what="old CA cert refused")
    old_agent.kill()
    (current,) = server.status()["agents"]
    assert current["peer"] == before["peer"]  # the refused one replaced nothing
    # ...and the agent's reconnect presents its reloaded certificate from the new CA.
    restarted = NodeagentProcess("server", scfg, tmp_path, "server2")
    server.kill()
    procs.append(restarted.start())
    restarted.wait_ready()
    restarted.wait_for(lambda s: s["agents"],
                       timeout=WAIT, what="agent back with the new CA's cert")
    assert echo_through(listen_port(restarted, 0), b"w") == b"w"
