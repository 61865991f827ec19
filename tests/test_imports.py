"""Each role loads only what it uses: an agent or a server on tls:// does not import the
debug client's HTTP library or the WebSocket libraries (memory: see the README's
performance section). Checked in a fresh interpreter, as a process starts."""

from __future__ import annotations

import subprocess
import sys

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
    assert not {"httpx", "httpcore", "websockets", "wsproto"} & set(out), out


def test_websocket_names_still_load_on_use() -> None:
    out = subprocess.run([sys.executable, "-c", (
        "import sys, tunnel.transports as t\n"
        "assert 'websockets' not in sys.modules\n"
        "print(t.WebSocketTransport.__name__, t.websocket_connect.__name__,"
        " 'websockets' in sys.modules)")], check=True, capture_output=True, text=True,
        timeout=60).stdout.split()
    assert out == ["WebSocketTransport", "websocket_connect", "True"]
