"""The config stream's wire contract, shared by the controller (`controller/configserver.py`)
and the watchers (`configstream/client.py`), so the two ends cannot drift apart.

    GET /v1/config/nodes/{node}?after=N     an agent's NodeConfig
    GET /v1/config/servers/{id}?after=N     the servers' RoutesConfig
    POST /v1/servers/{id}/activity          a server's report of its sleepable routes
    POST /v1/servers/{id}/wake              a server asks to wake a sleeping Service

A watch is answered `200`, `Content-Type: application/x-ndjson`, chunked, and never ends:
one line `{"version": V, "config": {...}}` per version newer than `after`, and the line
`{}` as a heartbeat. The controller announces its heartbeat interval in the
`x-nodeagent-heartbeat` response header so a watcher knows when silence means a dead
peer. A refusal is one JSON line `{"error": ..., "reason": <code>}`. The certificate
signing request (`POST /v1/certificates`) shares the connection; its contract is
`nodeagent.trust.enrollment`'s.

Scale to zero: a server reports the activity of the Services behind its routes with `wake`
(`{"services": {"ns/name": {"idle": seconds since the last request or null, "in_flight":
N}}}`: ages, not timestamps, so the two clocks need not agree) and asks to wake one
(`{"service": "ns/name"}`); both are answered `{"state": ...}` or a refusal. Only a server
certificate for that server id may post them.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError, create_model

from nodeagent.config import NodeConfig, RoutesConfig

M = TypeVar("M", bound=BaseModel)

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


SERVERS_REPORT_PREFIX = "/v1/servers"
ACTIVITY = "activity"
WAKE = "wake"
# A report of many routes' activity is chunked by the server into posts this size.
MAX_REPORT_SERVICES = 150  # ~10 KiB, inside MAX_REQUEST_BYTES


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


def parse_config_line(line: bytes, model: type[M]) -> tuple[int, M] | None:
    """A config line's version and its config validated as `model`, carrying that
    version, straight from the bytes (pydantic's own JSON parser: no intermediate dicts,
    about half a watcher's CPU per line, which at a fan-out is what 5,000 watchers each
    spend; `python -m scripts.bench.config_fanout` measures it). None for anything
    else — a heartbeat, a line that is not JSON, a config that does not validate: the
    caller reads those with `parse_line` and `config.parse_config`, which say what is
    wrong with them."""
    try:
        parsed = _line_model(model).model_validate_json(line)
    except ValidationError:
        return None
    version: int = parsed.version  # type: ignore[attr-defined]
    config: M = parsed.config  # type: ignore[attr-defined]
    return version, config.model_copy(update={"version": version})


@functools.cache
def _line_model(model: type[BaseModel]) -> type[BaseModel]:
    """`{"version": int, "config": model}` (other keys ignored, as `parse_line`'s
    readers do)."""
    return create_model(f"{model.__name__}Line", version=(int, ...), config=(model, ...))


def report_path(server_id: str, kind: str) -> str:
    """`/v1/servers/{id}/activity` or `/v1/servers/{id}/wake`."""
    return f"{SERVERS_REPORT_PREFIX}/{server_id}/{kind}"


def parse_report_path(path: str) -> tuple[str, str] | None:
    """(kind, server id) of a report path; None for any other path."""
    parts = path.strip("/").split("/")
    if len(parts) != 4 or "/" + "/".join(parts[:2]) != SERVERS_REPORT_PREFIX or not parts[2]:
        return None
    if parts[3] not in (ACTIVITY, WAKE):
        return None
    return parts[3], parts[2]


class ReportError(ValueError):
    """A report body that does not follow the contract."""


def _service_key(value: Any) -> str:
    if not isinstance(value, str) or value.count("/") != 1 or len(value) > 320 \
            or not all(value.split("/")):
        raise ReportError(f"not a namespace/name: {str(value)[:80]!r}")
    return value


def parse_activity(body: bytes) -> dict[str, tuple[float | None, int]]:
    """`{"services": {...}}` → service → (idle seconds or None, requests in flight)."""
    doc = parse_line(body)
    services = doc.get("services")
    if not isinstance(services, dict) or len(services) > MAX_REPORT_SERVICES:
        raise ReportError(f"services must be an object of at most {MAX_REPORT_SERVICES}")
    out: dict[str, tuple[float | None, int]] = {}
    for key, entry in services.items():
        if not isinstance(entry, dict):
            raise ReportError("each service's activity must be an object")
        idle, in_flight = entry.get("idle"), entry.get("in_flight", 0)
        if idle is not None and (not isinstance(idle, int | float) or isinstance(idle, bool)
                                 or not 0 <= idle < 1e9):
            raise ReportError("idle must be null or seconds")
        if not isinstance(in_flight, int) or isinstance(in_flight, bool) or not \
                0 <= in_flight < 1e9:
            raise ReportError("in_flight must be a count")
        out[_service_key(key)] = (None if idle is None else float(idle), in_flight)
    return out


def activity_body(services: dict[str, tuple[float | None, int]]) -> bytes:
    return json.dumps({"services": {
        key: {"idle": None if idle is None else round(idle, 3), "in_flight": n}
        for key, (idle, n) in services.items()}}, separators=(",", ":")).encode()


def parse_wake(body: bytes) -> str:
    """`{"service": "ns/name"}` → the service."""
    return _service_key(parse_line(body).get("service"))


def wake_body(service: str) -> bytes:
    return json.dumps({"service": service}, separators=(",", ":")).encode()
