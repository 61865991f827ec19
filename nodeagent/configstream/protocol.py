"""The config stream's wire contract, shared by the controller (`controller/configserver.py`)
and the watchers (`configstream/client.py`), so the two ends cannot drift apart.

    GET /v1/config/nodes/{node}?after=N     an agent's NodeConfig
    GET /v1/config/servers/{id}?after=N     the servers' RoutesConfig

A watch is answered `200`, `Content-Type: application/x-ndjson`, chunked, and never ends:
one line `{"version": V, "config": {...}}` per version newer than `after`, and the line
`{}` as a heartbeat. The controller announces its heartbeat interval in the
`x-nodeagent-heartbeat` response header so a watcher knows when silence means a dead
peer. A refusal is one JSON line `{"error": ..., "reason": <code>}`. The certificate
signing request (`POST /v1/certificates`) shares the connection; its contract is
`nodeagent.trust.enrollment`'s.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from nodeagent.config import NodeConfig, RoutesConfig

NODES: Literal["nodes"] = "nodes"
SERVERS: Literal["servers"] = "servers"
PATH_PREFIX = "/v1/config"
# The response header that announces the heartbeat interval, in seconds.
HEARTBEAT_HEADER = b"x-nodeagent-heartbeat"
HEARTBEAT_LINE = b"{}\n"
# A whole config (10,000 routes) is one line; a watcher refuses longer ones.
MAX_LINE = 16 * 1024 * 1024
# A watch or signing request is small; the controller refuses larger ones.
MAX_REQUEST_BYTES = 16 * 1024


class LineError(ValueError):
    """A line of the stream that is not a JSON object."""


def node_config_path(node: str) -> str:
    return f"{PATH_PREFIX}/{NODES}/{node}"


def servers_config_path(server_id: str) -> str:
    return f"{PATH_PREFIX}/{SERVERS}/{server_id}"


def parse_config_path(path: str) -> tuple[Literal["nodes", "servers"], str] | None:
    """(kind, name) of a watch path; None for any other path."""
    parts = path.strip("/").split("/")
    if len(parts) != 4 or "/" + "/".join(parts[:2]) != PATH_PREFIX or not parts[3]:
        return None
    if parts[2] == NODES:
        return NODES, parts[3]
    if parts[2] == SERVERS:
        return SERVERS, parts[3]
    return None


def config_line(version: int, config: NodeConfig | RoutesConfig) -> bytes:
    """`{"version": V, "config": {...}}`: the config serialised by pydantic's own JSON
    encoder (no intermediate dicts: at a fan-out to thousands of nodes, model_dump +
    json.dumps was most of the sending CPU; `python -m scripts.bench.config_propagation`
    measures it)."""
    body = config.model_dump_json(exclude={"version"}).encode()
    return b'{"version":%d,"config":%s}\n' % (version, body)


def parse_line(line: bytes) -> dict[str, Any]:
    """One line of the stream as a JSON object (`{}` is a heartbeat)."""
    try:
        doc = json.loads(line)
    except ValueError:
        raise LineError(f"not JSON: {line[:200]!r}") from None
    if not isinstance(doc, dict):
        raise LineError(f"not a JSON object: {line[:200]!r}")
    return doc
