"""`nodeagent debug ...`: read a running agent's or server's debug socket."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nodeagent.config import DEFAULT_AGENT_SOCKET, DEFAULT_SERVER_SOCKET
from nodeagent.ops.debug import DebugUnavailable, fetch_debug
from nodeagent.ops.render import render_status


def _default_socket() -> Path:
    for candidate in (DEFAULT_AGENT_SOCKET, DEFAULT_SERVER_SOCKET):
        if Path(candidate).exists():
            return Path(candidate)
    return Path(DEFAULT_AGENT_SOCKET)


def run_debug(what: str, socket: Path | None, *, as_json: bool) -> int:
    path = socket or _default_socket()
    try:
        doc = fetch_debug(str(path), f"/{what}")
    except DebugUnavailable as exc:
        print(f"nodeagent debug: {exc}", file=sys.stderr)
        return 1
    if what == "metrics":
        print(doc if isinstance(doc, str) else json.dumps(doc), end="")
    elif what == "rules" and not as_json and isinstance(doc, dict) and "backend" in doc:
        print(f"backend {doc['backend']}, mode {doc['mode']}, {len(doc['rules'])} rule(s)\n")
        print("# applied in the kernel now")
        print(doc["applied_in_kernel"] or "(no table)")
        print("# rendered from the model")
        print(doc["rendered_from_model"] or "(nothing)")
    elif as_json or what != "status":
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(render_status(doc))
    return 0
