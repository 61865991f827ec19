"""scripts.bench.tls_socket's prototype (the tunnel's TLS on an `ssl.SSLSocket` that reads
and writes the socket itself) keeps TLSStream's contract, so the figures
docs/performance.md gives for it are of a working TLS layer: the transport conformance
suite and the dial tests pass with it in place of TLSStream (trio's stream check, close
notify against an abrupt close or a truncation, mutual TLS, the wrong CA, a handshake
that never comes, wss over it, the shared receive buffer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_socket_tls_prototype_passes_the_transport_suite(tmp_path: Path) -> None:
    # A sitecustomize first on the path installs the prototype before anything imports
    # tunnel.transports (scripts.bench.tls_socket --splice runs the tunnel the same way).
    (tmp_path / "sitecustomize.py").write_text(
        "from scripts.bench.tls_socket import install\ninstall()\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    installed = subprocess.run(
        [sys.executable, "-c", "import tunnel.transports as t; print(t.TLSStream.__name__)"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert installed.stdout.strip() == "_Chooser"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "tests/tunnel/test_transport_conformance.py", "tests/tunnel/test_dial.py"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
