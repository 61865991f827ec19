"""`nodeagent debug ...`: read a running agent's or server's debug socket and print it.

One fetch per view, or with `--watch` one every few seconds, the screen redrawn, until
Ctrl-C (exit 0, no traceback). A socket that is not there, or goes away while watching, is
one line on stderr and exit 1.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from nodeagent.config import DEFAULT_AGENT_SOCKET, DEFAULT_SERVER_SOCKET
from nodeagent.ops.debug import DebugUnavailable, fetch_debug
from nodeagent.ops.render import render_flows, render_status, render_streams, render_tunnels

# Views that take `--node` (a server's: every node's rows, or one node's).
NODE_VIEWS = ("tunnels", "streams", "flows")
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen (any ANSI terminal)


def _default_socket() -> Path:
    for candidate in (DEFAULT_AGENT_SOCKET, DEFAULT_SERVER_SOCKET):
        if Path(candidate).exists():
            return Path(candidate)
    return Path(DEFAULT_AGENT_SOCKET)


def program_command(path: str | None = None) -> str:
    """How to type this program in a shell so that it runs this very installation: what
    the demos print. `nodeagent` when PATH finds the script beside this interpreter (an
    activated venv, pipx); else that script's full path (a venv not activated, e.g.
    `scripts/demo`'s `.venv`); else `python -m nodeagent` with this interpreter. `path`:
    the PATH to look in (default the environment's)."""
    here = Path(sys.executable).parent / "nodeagent"
    found = shutil.which("nodeagent", path=path if path is not None
                         else os.environ.get("PATH", os.defpath))
    if found is not None and here.exists() and Path(found).resolve() == here.resolve():
        return "nodeagent"
    if here.exists() and os.access(here, os.X_OK):
        return shlex.quote(str(here))
    return f"{shlex.quote(sys.executable)} -m nodeagent"


def route_for(what: str, node: str | None) -> str:
    if node and what in NODE_VIEWS:
        return f"/{what}?node={quote(node, safe='')}"
    return f"/{what}"


def render(what: str, doc: Any, *, as_json: bool) -> str:
    """The text `nodeagent debug WHAT` prints for `doc`."""
    if what == "metrics":
        return doc if isinstance(doc, str) else json.dumps(doc) + "\n"
    if as_json:
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if what == "rules" and isinstance(doc, dict) and "backend" in doc:
        return (f"backend {doc['backend']}, mode {doc['mode']}, {len(doc['rules'])} rule(s)"
                "\n\n# applied in the kernel now\n"
                f"{doc['applied_in_kernel'] or '(no table)'}\n"
                "# rendered from the model\n"
                f"{doc['rendered_from_model'] or '(nothing)'}\n")
    if what == "tunnels" and isinstance(doc, dict):
        return render_tunnels(doc)
    if what == "streams" and isinstance(doc, dict):
        return render_streams(doc)
    if what == "flows" and isinstance(doc, dict):
        return render_flows(doc)
    if what == "status" and isinstance(doc, dict):
        return render_status(doc) + "\n"
    if what == "holds" and isinstance(doc, dict):
        return render_holds(doc)
    if what == "loadbalancers" and isinstance(doc, dict):
        return render_load_balancers(doc)
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def render_holds(doc: dict[str, Any]) -> str:
    """`nodeagent debug holds`: one row per Service with requests held now."""
    rows = [f"{'SERVICE':<40} {'HELD':>6} {'WAITING':>9}"]
    for service, held in sorted((doc.get("held_now") or {}).items()):
        rows.append(f"{service:<40} {held.get('requests', 0):>6} "
                    f"{held.get('waiting_seconds', 0):>8.1f}s")
    if len(rows) == 1:
        rows.append("(no request held)")
    rows.append("")
    rows.append(", ".join(f"{key} {doc.get(key, 0)}" for key in (
        "held", "forwarded", "timeouts", "overflowed", "failed")) + " since start")
    return "\n".join(rows) + "\n"


def render_load_balancers(doc: dict[str, Any]) -> str:
    """`nodeagent debug loadbalancers`: one row per LoadBalancer Service port."""
    rows = [f"{'SERVICE':<32} {'PORT':<10} {'STATE':<10} {'TAKEN':>7} {'REFUSED':>7}  "
            "BACKENDS"]
    for port in doc.get("ports") or []:
        where = f"{port.get('protocol')}/{port.get('port')}"
        backends = ", ".join(port.get("backends") or []) or "(no ready endpoints)"
        rows.append(f"{port.get('service', ''):<32} {where:<10} {port.get('state', ''):<10} "
                    f"{port.get('accepted', 0):>7} {port.get('refused', 0):>7}  {backends}")
        if port.get("error"):
            rows.append(f"{'':<32} {'':<10} {port['error']}")
    if len(rows) == 1:
        rows.append(f"(no LoadBalancer Service served; ports listen on {doc.get('host')})")
    return "\n".join(rows) + "\n"


def run_debug(what: str, socket: Path | None, *, as_json: bool, node: str | None = None,
              watch: float | None = None,
              sleep: Callable[[float], None] = time.sleep) -> int:
    path = str(socket or _default_socket())
    route = route_for(what, node)
    try:
        while True:
            try:
                doc = fetch_debug(path, route)
            except DebugUnavailable as exc:
                print(f"nodeagent debug: {exc}", file=sys.stderr)
                return 1
            text = render(what, doc, as_json=as_json)
            if watch is None:
                sys.stdout.write(text)
                return 0
            if as_json:
                # One document per line, for `jq` and scripts that follow along.
                sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
            else:
                stamp = time.strftime("%H:%M:%S")
                sys.stdout.write(f"{_CLEAR}every {watch:g}s, {stamp}  (Ctrl-C to stop)"
                                 f"  nodeagent debug {what}\n\n{text}")
            sys.stdout.flush()
            sleep(watch)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # `nodeagent debug streams --watch | head`: the reader left; so do we, quietly.
        sys.stderr.close()
        return 0
