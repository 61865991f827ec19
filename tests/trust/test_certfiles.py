"""`nodeagent certs`: the files it writes (modes, what the certificates carry), its
refusals (an existing file without --force, bad names, no CA) as one line and exit 2, and,
end to end, a server and an agent that authenticate with nothing but what it made."""

from __future__ import annotations

import ipaddress
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    Certs,
    agent_config,
    echo_through,
    listen_port,
    run_upstream,
    server_config,
)
from nodeagent.trust import pki


def certs(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nodeagent", "certs", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def make_all(d: Path) -> None:
    for args in (["ca"], ["server", "--name", "localhost", "--ip", "127.0.0.1"],
                 ["node", "edge-1"], ["token", "edge-1"]):
        done = certs(*args, cwd=d)
        assert done.returncode == 0 and not done.stderr, done


def test_the_files_carry_what_the_server_checks_with_safe_modes(tmp_path: Path) -> None:
    make_all(tmp_path)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"ca.crt": 0o644, "ca.key": 0o600, "server.crt": 0o644,
                     "server.key": 0o600, "edge-1.crt": 0o644, "edge-1.key": 0o600,
                     "edge-1.token": 0o600}
    node = pki.load_certificate(tmp_path / "edge-1.crt")
    assert pki.node_name_from_certificate(node.public_bytes(
        serialization.Encoding.DER)) == "edge-1"
    server = pki.load_certificate(tmp_path / "server.crt")
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    ca = pki.load_certificate(tmp_path / "ca.crt")
    for leaf in (node, server):
        leaf.verify_directly_issued_by(ca)
    token = (tmp_path / "edge-1.token").read_text()
    assert len(token.strip()) == 32 and token.endswith("\n")


def test_nothing_is_replaced_without_force(tmp_path: Path) -> None:
    make_all(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for args in (["ca"], ["server", "--name", "localhost"], ["node", "edge-1"],
                 ["token", "edge-1"]):
        done = certs(*args, cwd=tmp_path)
        assert done.returncode == 2, done
        assert "already exist" in done.stderr and "--force" in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # --force replaces, keeping the modes.
    assert certs("token", "edge-1", "--force", cwd=tmp_path).returncode == 0
    assert (tmp_path / "edge-1.token").read_bytes() != before["edge-1.token"]
    assert stat.S_IMODE((tmp_path / "edge-1.token").stat().st_mode) == 0o600


@pytest.mark.parametrize(("args", "message"), [
    (["server", "--name", "tunnel.example.com"], "no CA at ca.crt: run `nodeagent certs ca`"),
    (["node", "Edge_1"], "invalid node name 'Edge_1'"),
    (["token", "a b"], "invalid node name 'a b'"),
    (["server"], "give the names agents dial: --name HOST and/or --ip ADDRESS"),
    (["server", "--ip", "tunnel.example.com"], "--ip 'tunnel.example.com' is not an IP"),
    (["server", "--name", "10.0.0.1"], "give it as --ip 10.0.0.1"),
    (["server", "--name", "bad name"], "--name 'bad name' is not a DNS name"),
    (["ca", "--days", "0"], "--days 0: give 1 to 36500 days for the CA"),
    (["ca", "--dir", "/nonexistent/pki"], "no such directory: /nonexistent/pki"),
])
def test_errors_are_one_line_and_write_nothing(tmp_path: Path, args: list[str],
                                               message: str) -> None:
    done = certs(*args, cwd=tmp_path)
    assert done.returncode == 2, done
    assert message in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())


def test_help_teaches_the_steps() -> None:
    done = subprocess.run([sys.executable, "-m", "nodeagent", "certs", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for step in ("nodeagent certs ca", "nodeagent certs server --name HOST",
                 "nodeagent certs token NODE", "nodeagent certs node NODE",
                 "nodeagent://node/NODE", "0600", "--force"):
        assert step in done.stdout, step


@pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)
def test_mutual_tls_with_only_the_files_it_made(tmp_path: Path) -> None:
    """No token anywhere: the server requires a client certificate of ca.crt, and the
    agent's edge-1.crt gets it in."""
    make_all(tmp_path)
    files = Certs(tmp_path / "ca.crt", tmp_path / "server.crt", tmp_path / "server.key",
                  tmp_path / "edge-1.crt", tmp_path / "edge-1.key")
    with run_upstream() as upstream:
        scfg = server_config(tmp_path, files, upstream, mtls=True)
        scfg["tls"]["require_client_cert"] = True
        del scfg["tokens"]
        acfg = agent_config(tmp_path, files, upstream, scfg["tunnel"])
        del acfg["token"]
        acfg["tls"].update(cert_file=str(files.agent_cert), key_file=str(files.agent_key))
        server = NodeagentProcess("server", scfg, tmp_path, "server").start()
        agent = NodeagentProcess("agent", acfg, tmp_path, "agent")
        try:
            server.wait_ready()
            agent.start().wait_ready()
            server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                            what="edge-1 connected with its certificate")
            assert echo_through(listen_port(server, 0), b"hello" * 1000) == b"hello" * 1000
        finally:
            agent.kill()
            server.kill()
