"""CLI usage errors: one line a human can act on, exit code 2, nothing started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize(("args", "message"), [
    (["agent"], "give --config FILE (standalone) or --controller URL"),
    (["server"], "give --config FILE (standalone) or --controller URL"),
    (["agent", "--config", "a.yaml", "--controller", "http://c:8090"], "not both"),
    (["agent", "--controller", "http://c:8090"],
     "controller mode needs --node (or NODE_NAME), --server, --token-file"),
    (["agent", "--node", "edge-1", "--server", "tls://s:1", "--token-file", "/nonexistent",
      "--controller", "ftp://c"], "--controller 'ftp://c': use http://host:port"),
    (["server", "--controller", "http://c:8090", "--token-file", "/nonexistent/t",
      "--tunnel-listen", "tls://127.0.0.1:0", "--tls-cert", "/x.crt", "--tls-key", "/x.key"],
     "/nonexistent/t"),
    (["server", "--controller", "http://c:8090", "--token-file", "/etc/hostname",
      "--tunnel-listen", "tcp://127.0.0.1:0"],
     "tokens would cross the network in clear"),
    (["server", "--controller", "http://c:8090", "--token-file", "/etc/hostname"],
     "needs a tls section"),
    (["controller", "--listen", "nowhere"], "--listen 'nowhere'"),
    (["frobnicate"], "invalid choice"),
])
def test_usage_errors_exit_2_with_one_clear_line(args: list[str], message: str,
                                                 tmp_path: Path) -> None:
    result = run(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help_teaches_both_modes() -> None:
    for role, words in (("agent", ["standalone mode", "controller mode", "--node"]),
                        ("server", ["--ingress-https", "controller mode"]),
                        ("controller", ["Lease", "--lease-seconds"])):
        result = run(role, "--help")
        assert result.returncode == 0
        for word in words:
            assert word in result.stdout, (role, word)
