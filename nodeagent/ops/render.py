"""Plain-text rendering of debug documents: the tables and key/value lines
`nodeagent debug` prints (units guessed from key names)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def format_duration(seconds: float) -> str:
    """`93784` → `1d 2h 03m 04s`; short durations keep their unit: `4.2s`."""
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 and seconds != int(seconds) else f"{seconds:.0f}s"
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h {minutes:02d}m {s:02d}s"
    if hours:
        return f"{hours}h {minutes:02d}m {s:02d}s"
    return f"{minutes}m {s:02d}s"


def format_bytes(n: float) -> str:
    """`1536` → `1.5 KiB`."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # unreachable


def format_value(key: str, value: Any) -> str:
    """A value as shown in tables, guessing units from the key's name."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    k = key.lower()
    if isinstance(value, int | float):
        if k.endswith(("uptime", "_seconds", "uptime_s", "age")):
            return format_duration(value)
        if "bytes" in k:
            return format_bytes(value)
        if k.endswith(("rtt_ms", "_ms")):
            return f"{value:.1f} ms"
        if isinstance(value, float):
            return f"{value:g}"
        return str(value)
    if isinstance(value, list | tuple):
        return ", ".join(format_value(key, v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k2}={format_value(k2, v)}" for k2, v in value.items()) or "-"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def render_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str | tuple[str, str]] | None = None
) -> str:
    """Rows as an aligned plain-text table; numbers right-aligned.

    `columns` names the keys to show, optionally as `(key, heading)`; by default every key in
    order of first appearance, headed by the key in upper case.
    """
    if columns is None:
        keys: list[str] = []
        for row in rows:
            keys.extend(k for k in row if k not in keys)
        columns = keys
    cols = [(c, c.upper().replace("_", " ")) if isinstance(c, str) else c for c in columns]
    if not rows:
        return "  ".join(h for _, h in cols) + "\n(none)"
    cells = [[format_value(k, row.get(k)) for k, _ in cols] for row in rows]
    numeric = [
        all(_is_number(row.get(k)) or row.get(k) is None for row in rows)
        and any(_is_number(row.get(k)) for row in rows)
        for k, _ in cols
    ]
    widths = [max(len(h), *(len(line[i]) for line in cells)) for i, (_, h) in enumerate(cols)]

    def line(values: Sequence[str], header: bool = False) -> str:
        parts = [
            v.rjust(w) if numeric[i] and not header else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    out = [line([h for _, h in cols], header=True)]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and not _is_table(value):
            items.extend(_flatten(value, name + "."))
        elif not _is_table(value):
            items.append((name, value))
    return items


def _is_table(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _tables(doc: Mapping[str, Any], prefix: str = "") -> list[tuple[str, list[Any]]]:
    found: list[tuple[str, list[Any]]] = []
    for key, value in doc.items():
        if _is_table(value):
            found.append((f"{prefix}{key}", value))
        elif isinstance(value, Mapping):
            found.extend(_tables(value, f"{prefix}{key}."))
    return found


def render_status(doc: Mapping[str, Any]) -> str:
    """`nodeagent debug status`: a key/value section, then one table per list of objects.

    Works on any status document: scalars and nested objects (flattened as `tunnel.state`)
    become `key  value` lines, units guessed from key names (`uptime`, `*_bytes`,
    `rtt_ms`); lists of objects, such as the tunnel connections, become tables.
    """
    pairs = _flatten(doc)
    width = max((len(k) for k, _ in pairs), default=0)
    out = [f"{k.ljust(width)}  {format_value(k, v)}".rstrip() for k, v in pairs]
    for title, rows in _tables(doc):
        out.append("")
        out.append(f"{title} ({len(rows)})")
        out.append(render_table(rows))
    return "\n".join(out) + "\n"


_TUNNEL_COLUMNS: list[str | tuple[str, str]] = [
    ("state", "STATE"), ("peer", "PEER"), ("rtt_ms", "RTT"),
    ("streams_open", "STREAMS"), ("bytes_in", "BYTES IN"), ("bytes_out", "BYTES OUT"),
    ("since_seconds", "SINCE"), ("last_error", "LAST ERROR / REASON")]


def _counts(counts: Mapping[str, Any] | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted((counts or {}).items())) or "none"


def render_tunnels(doc: Mapping[str, Any]) -> str:
    """`nodeagent debug tunnels`: a headline, then a row per tunnel. Agent: one per server
    held or being dialed; server: one per node (connected, then lately disconnected)."""
    rows = doc.get("tunnels") or []
    if doc.get("role") == "server":
        head = (f"server {doc.get('server_id')}: {doc.get('connected')} node(s) connected; "
                f"disconnects: {_counts(doc.get('disconnects'))}")
        if doc.get("node_filter") and not rows:
            head += f"\nnode {doc['node_filter']} has no tunnel to this server and none " \
                    "ended lately"
        columns = [("node", "NODE"), *_TUNNEL_COLUMNS]
    else:
        held = sum(1 for r in rows if r.get("state") == "open")
        head = (f"agent {doc.get('node')}: {doc.get('state')}, {held} of "
                f"{doc.get('replicas')} server(s) held; connects {doc.get('connects')}, "
                f"reconnects: {_counts(doc.get('reconnects'))}")
        columns = [("server_id", "SERVER"), ("address", "ADDRESS"), *_TUNNEL_COLUMNS]
    return f"{head}\n\n{render_table(rows, columns)}\n"


def render_streams(doc: Mapping[str, Any]) -> str:
    """`nodeagent debug streams`: a row per stream. Bytes count toward the target (what the
    opening side sent) and back; to-node streams the server opened, from-node the agent."""
    rows = doc.get("streams") or []
    if doc.get("role") == "server":
        head = f"server {doc.get('server_id')}: {len(rows)} stream(s)"
        if doc.get("node_filter"):
            head += f" of node {doc['node_filter']}"
        first: list[str | tuple[str, str]] = [("node", "NODE")]
    else:
        head = f"agent {doc.get('node')}: {len(rows)} stream(s)"
        first = [("server_id", "SERVER")]
    columns = [*first, ("id", "ID"), ("direction", "DIRECTION"), ("target", "TARGET"),
               ("state", "STATE"), ("bytes_to_target", "TO TARGET"),
               ("bytes_from_target", "FROM TARGET"), ("age_seconds", "AGE"),
               ("opened_by", "OPENED BY")]
    out = f"{head}\n\n{render_table(rows, columns)}\n"
    for row in rows:
        inner = row.get("h2_streams")
        if inner is None:
            continue
        out += (f"\nstream {row.get('id')} ({row.get('target')}) carries an h2c connection: "
                f"{len(inner)} h2 stream(s)\n")
        for h2s in inner:
            out += (f"  h2 stream {h2s.get('stream')}  {h2s.get('path')}  "
                    f"{h2s.get('age_seconds')}s\n")
    return out


def render_flows(doc: Mapping[str, Any]) -> str:
    """`nodeagent debug flows` (a server): each UDP mapping with its drops by reason, then
    a row per flow (one per client address). In: from the client; out: back to it."""
    rows = doc.get("flows") or []
    if doc.get("role") == "agent":
        head = (f"agent {doc.get('node')}: {len(rows)} intercepted UDP flow(s); drops: "
                f"{_counts(doc.get('drops'))}")
        agent_columns: list[str | tuple[str, str]] = [
            ("client", "CLIENT"), ("destination", "DESTINATION"), ("rule", "RULE"),
            ("via", "VIA"), ("state", "STATE"), ("datagrams_in", "IN"),
            ("datagrams_out", "OUT"), ("idle_seconds", "IDLE")]
        return f"{head}\n\n{render_table(rows, agent_columns)}\n"
    mappings = doc.get("mappings") or []
    lines = [f"{len(mappings)} UDP mapping(s), {len(rows)} flow(s)"]
    for m in mappings:
        lines.append(f"  {m.get('mapping')} -> node {m.get('node')}: {m.get('flows')} "
                     f"flow(s); drops: {_counts(m.get('drops'))}")
    columns: list[str | tuple[str, str]] = [
        ("mapping", "MAPPING"), ("client", "CLIENT"), ("node", "NODE"),
        ("target", "TARGET"), ("state", "STATE"), ("datagrams_in", "IN"),
        ("datagrams_out", "OUT"), ("bytes_in", "BYTES IN"), ("bytes_out", "BYTES OUT"),
        ("idle_seconds", "IDLE"), ("age_seconds", "AGE")]
    return "\n".join(lines) + f"\n\n{render_table(rows, columns)}\n"
