"""An agent asked to intercept on a host without the netfilter tools: one line naming the
field and the package to install, exit 1, no traceback (docs/troubleshooting.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def run_agent(tmp_path: Path, intercept: dict[str, object]) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "node": "edge-1", "server": "tcp://127.0.0.1:9", "token": "0123456789abcdef0123",
        "insecure": True, "debug_socket": str(tmp_path / "agent.sock"),
        "intercept": {**intercept, "rules": [
            {"name": "web", "destinations": ["10.96.0.0/12"], "ports": [80]}]}}))
    empty = tmp_path / "bin"
    empty.mkdir()
    return subprocess.run([sys.executable, "-m", "nodeagent", "agent", "--config", str(config)],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PATH": str(empty)})


@pytest.mark.parametrize(("intercept", "says"), [
    ({}, "intercept: neither nft nor iptables-legacy-restore is installed"),
    ({"backend": "nftables"}, "intercept: intercept.backend is nftables, but nft is not "
                              "installed"),
    ({"backend": "iptables"}, "intercept: intercept.backend is iptables, but "
                              "iptables-legacy-restore is not installed"),
])
def test_no_netfilter_tools_is_one_line(tmp_path: Path, intercept: dict[str, object],
                                        says: str) -> None:
    proc = run_agent(tmp_path, intercept)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"nodeagent agent: {tmp_path / 'agent.yaml'}: {says}; "
                               "install the nftables package on the node"), lines[0]
