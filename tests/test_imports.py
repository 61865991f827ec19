"""Each role loads only what it uses: an agent or a server on tls:// does not import the
debug client's HTTP library, the WebSocket libraries or, started from a file,
cryptography (memory: docs/performance.md). Checked in a fresh
interpreter, as a process starts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

_CHECK = """
import sys, importlib
importlib.import_module(sys.argv[1])
print(" ".join(sorted({n.split(".")[0] for n in sys.modules})))
"""


@pytest.mark.parametrize("module", ["nodeagent.agent.main", "nodeagent.server.main"])
def test_a_role_does_not_import_what_it_does_not_use(module: str) -> None:
    out = subprocess.run([sys.executable, "-c", _CHECK, module], check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    assert "trio" in out  # the check itself works
    # cryptography: only for certificates the process makes or reads itself (controller
    # mode, or agents' certificates on a server), imported when first needed.
    assert not {"httpx", "httpcore", "websockets", "wsproto", "cryptography",
                "_cffi_backend"} & set(out), out


# What a role loads only when its config asks for it (memory: docs/performance.md, "Memory
# at 1,000 idle connections"): the nftables and iptables backends, the interception
# proxies and dnslib only when the agent intercepts; socksio only to dial through a proxy;
# HTTP/2 (the h2 library and the front's h2 modules, nodeagent/http/ondemand.py) only on
# the first HTTP/2 connection or request to an h2c backend (tests/http/test_h2_on_demand).
_ONLY_ON_USE = {"netfilter.nftables", "netfilter.iptables", "netfilter.detect",
                "netfilter.routing", "nodeagent.agent.intercept.listener",
                "nodeagent.agent.intercept.udpproxy", "dnslib", "socksio",
                "tunnel.proxy.handshake", "h2", "hpack", "hyperframe",
                "nodeagent.http.h2connection", "nodeagent.http.h2session",
                "nodeagent.http.h2wire", "nodeagent.http.h2pool", "nodeagent.http.h2heads"}

_CHECK_MODULES = """
import sys, importlib
importlib.import_module('nodeagent.cli'); importlib.import_module(sys.argv[1])
print(" ".join(sorted(sys.modules)))
"""


@pytest.mark.parametrize("module", ["nodeagent.agent.main", "nodeagent.server.main"])
def test_a_role_loads_features_only_when_used(module: str) -> None:
    out = set(subprocess.run([sys.executable, "-c", _CHECK_MODULES, module], check=True,
                             capture_output=True, text=True, timeout=60).stdout.split())
    assert {"netfilter.model", "tunnel.endpoint"} <= out  # the check itself works
    if module == "nodeagent.server.main":
        assert "nodeagent.http.front" in out
    assert not _ONLY_ON_USE & out, sorted(_ONLY_ON_USE & out)


def test_lazy_names_still_load_on_use() -> None:
    """What a role loads late is still there when a feature asks: netfilter's names (PEP
    562), the agent's interceptor, the proxy handshake."""
    out = subprocess.run([sys.executable, "-c", (
        "import sys, netfilter\n"
        "assert 'netfilter.nftables' not in sys.modules\n"
        "from netfilter import render_nftables, IptablesBackend, detect_backend\n"
        "from netfilter import sockets, PolicyRouting, CommandFailed, InterceptModel\n"
        "import nodeagent.agent.agent, tunnel.dial\n"
        "from nodeagent.agent.intercept.listener import Interceptor\n"
        "from tunnel.proxy.handshake import handshake_for\n"
        "print(render_nftables.__module__, IptablesBackend.__module__,"
        " 'dnslib' in sys.modules, 'socksio' in sys.modules)\n"
        "try:\n"
        "    netfilter.nothing\n"
        "except AttributeError as exc:\n"
        "    print('AttributeError')\n")], check=True, capture_output=True, text=True,
        timeout=60).stdout.split()
    assert out == ["netfilter.nftables", "netfilter.iptables", "True", "True",
                   "AttributeError"]


def test_websocket_names_still_load_on_use() -> None:
    out = subprocess.run([sys.executable, "-c", (
        "import sys, tunnel.transports as t\n"
        "assert 'websockets' not in sys.modules\n"
        "print(t.WebSocketTransport.__name__, t.websocket_connect.__name__,"
        " 'websockets' in sys.modules)")], check=True, capture_output=True, text=True,
        timeout=60).stdout.split()
    assert out == ["WebSocketTransport", "websocket_connect", "True"]


# What each start path must not load: cryptography (~9 MiB) is for certificates an agent
# in standalone mode never makes (ssl loads its CA, certificate and key files itself:
# nodeagent/trust/tlscontext.py); yaml only for config files.
_AGENT_STANDALONE_NEVER = {"cryptography", "_cffi_backend", "httpx", "websockets", "wsproto"}


def test_the_agent_cli_does_not_import_cryptography() -> None:
    out = subprocess.run([sys.executable, "-c", _CHECK.replace(
        "importlib.import_module(sys.argv[1])",
        "importlib.import_module('nodeagent.cli'); importlib.import_module(sys.argv[1])"),
        "nodeagent.agent.main"], check=True, capture_output=True, text=True,
        timeout=60).stdout.split()
    assert "pydantic" in out
    assert not _AGENT_STANDALONE_NEVER & set(out), out
    assert "yaml" not in out  # loaded by the file loader when there is a file


@pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)
def test_a_running_standalone_agent_has_not_loaded_cryptography(tmp_path: Path) -> None:
    """A real agent from a file, with a CA, a client certificate and key, dialing a
    server that is not there: its start path, as it runs, without cryptography."""
    from nodeagent.trust import pki  # the test makes the files; the agent must not need it

    ca = pki.create_ca("imports-test")
    ca.write(tmp_path / "ca.crt", tmp_path / "ca.key")
    pki.issue_client_certificate(ca, "edge-1").write(tmp_path / "edge.crt",
                                                     tmp_path / "edge.key")
    config = tmp_path / "agent.yaml"
    config.write_text(
        "node: edge-1\nserver: tls://127.0.0.1:1\n"
        f"tls: {{ca_file: {tmp_path}/ca.crt, cert_file: {tmp_path}/edge.crt,"
        f" key_file: {tmp_path}/edge.key}}\n"
        f"debug_socket: {tmp_path}/agent.sock\nallow: ['127.0.0.1:80']\n")
    with subprocess.Popen([sys.executable, "-m", "nodeagent", "agent", "--config",
                           str(config)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT) as agent:
        try:
            deadline = time.monotonic() + 30
            while not (tmp_path / "agent.sock").exists():
                assert agent.poll() is None, agent.stdout.read() if agent.stdout else ""
                assert time.monotonic() < deadline, "the agent did not start"
                time.sleep(0.05)
            time.sleep(1.5)  # a dial or two to the absent server
            maps = Path(f"/proc/{agent.pid}/maps").read_text()
            assert agent.poll() is None
        finally:
            agent.terminate()
            agent.wait(10)
    loaded = {Path(line.split()[-1]).name for line in maps.splitlines() if "/" in line}
    assert not any("cryptography" in name or "_rust" in name or "_cffi_backend" in name
                   for name in loaded), sorted(loaded)
    assert any(name.startswith("_ssl") for name in loaded)  # the check sees extensions
