"""The node-local debug socket: a tiny HTTP/1.1 JSON server on a Unix socket, its client,
and the plain-text rendering `nodeagent debug …` prints.

Server side (agent and server roles): `DebugServer(path, routes, registry=...)` serves each
route (`"/status": callable`) as JSON on GET/HEAD, `/metrics` as Prometheus text when given
a registry, and `/` as the list of routes. The socket file is created with mode 0600 (the
caller may choose 0660 for a group), a stale file left by a crashed agent is removed at
start (a live one is refused), and the file is removed on exit.

Client side (the CLI, synchronous): `fetch_debug(path, "/status")` returns the decoded
JSON or raises `DebugUnavailable` with one line a human can act on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import errno
import functools
import inspect
import json
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11
import httpx
import trio

from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.debug")

DEFAULT_SOCKET = "/run/nodeagent/debug.sock"

Handler = Callable[[], Awaitable[Any] | Any]


class DebugUnavailable(Exception):
    """The debug socket could not be read; the message is meant for the user as is."""


class DebugSocketInUse(Exception):
    """Another live process already serves this socket path."""


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


@dataclass(frozen=True)
class HttpStatus:
    """A route's answer with a status other than 200."""

    status: int
    body: Any


def to_json(value: Any) -> bytes:
    return json.dumps(value, default=_json_default, indent=1).encode() + b"\n"


class DebugServer:
    """Serves `routes` (path → callable returning JSON-able data) on a Unix socket."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        routes: Mapping[str, Handler],
        *,
        registry: Any = None,
        mode: int = 0o600,
        idle_timeout: float = 30.0,
    ) -> None:
        self.path = Path(path)
        self.routes = dict(routes)
        self.registry = registry
        self.mode = mode
        self.idle_timeout = idle_timeout

    def _remove_stale(self) -> None:
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise DebugSocketInUse(
                f"{self.path} exists and is not a socket: remove it or pick another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale debug socket", path=str(self.path))
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            return
        except OSError:
            pass  # e.g. a timeout: something holds it; refuse below
        finally:
            probe.close()
        raise DebugSocketInUse(f"another process is serving {self.path}")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; the socket exists when `task_status.started()` is called."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale()
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o777 & ~self.mode)
        try:
            await sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, self.mode)
        ino = self.path.stat().st_ino
        try:
            sock.listen(16)
            listener = trio.SocketListener(sock)
            log.info("debug socket listening", path=str(self.path))
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    functools.partial(
                        trio.serve_listeners, self._serve, [listener], handler_nursery=nursery
                    )
                )
                task_status.started()
        finally:
            sock.close()
            with contextlib.suppress(OSError):
                if self.path.stat().st_ino == ino:
                    self.path.unlink()

    async def _serve(self, stream: trio.abc.Stream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)

        async def next_event() -> Any:
            while True:
                event = conn.next_event()
                if event is not h11.NEED_DATA:
                    return event
                conn.receive_data(bytes(await stream.receive_some(65536)))

        try:
            while True:
                req: Any = None
                with trio.move_on_after(self.idle_timeout):
                    req = await next_event()
                if type(req) is not h11.Request:
                    return
                while type(await next_event()) is not h11.EndOfMessage:
                    pass  # a request body means nothing here; h11 bounds what it buffers
                status, headers, body = await self._answer(req.method, req.target)
                data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
                if req.method != b"HEAD":
                    data += conn.send(h11.Data(data=body)) or b""
                data += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(data)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            with contextlib.suppress(h11.LocalProtocolError, trio.BrokenResourceError):
                body = to_json({"error": f"malformed request: {exc}"})
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ]
                data = conn.send(h11.Response(status_code=exc.error_status_hint, headers=headers))
                await stream.send_all((data or b"") + (conn.send(h11.Data(data=body)) or b""))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        """Answer one HTTP connection on any stream (the Unix socket's, or TCP for the
        metrics and health listener)."""
        await self._serve(stream)

    async def _answer(
        self, method: bytes, target: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        path = target.decode("latin-1").split("?", 1)[0]
        if len(path) > 1:
            path = path.rstrip("/")
        ctype = b"application/json"
        known = path in self.routes or path == "/" or (path == "/metrics" and self.registry)
        if not known:
            status, body = 404, to_json({"error": f"no such route {path}", "routes": self._list()})
        elif method not in (b"GET", b"HEAD"):
            status, body = 405, to_json({"error": f"method {method.decode()} not allowed"})
        elif path == "/metrics" and self.registry is not None and "/metrics" not in self.routes:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            status, body, ctype = 200, generate_latest(self.registry), CONTENT_TYPE_LATEST.encode()
        elif path == "/" and "/" not in self.routes:
            status, body = 200, to_json({"routes": self._list()})
        else:
            try:
                result = self.routes[path]()
                if inspect.isawaitable(result):
                    result = await result
                status = 200
                if isinstance(result, HttpStatus):  # e.g. /readyz answering 503
                    status, result = result.status, result.body
                body = to_json(result)
            except Exception as exc:  # a broken route must not take the socket down
                log.warning("debug route failed", route=path, error=repr(exc))
                status, body = 500, to_json({"error": f"{path} failed: {exc!r}"})
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
        if status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        return status, headers, body

    def _list(self) -> list[str]:
        names = set(self.routes) | ({"/metrics"} if self.registry is not None else set())
        return sorted(names)


# -- client (the CLI) ----------------------------------------------------------------------


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def fetch_debug(path: str | os.PathLike[str], route: str, *, timeout: float = 5.0) -> Any:
    """GET `route` from the debug socket at `path`: decoded JSON (text for non-JSON routes).

    Raises DebugUnavailable with a one-line message for the user.
    """
    path = str(path)
    if not route.startswith("/"):
        route = "/" + route
    hint = "(--socket to choose another)"
    try:
        transport = httpx.HTTPTransport(uds=path)
        with httpx.Client(transport=transport, timeout=timeout, trust_env=False) as client:
            resp = client.get(f"http://nodeagent{route}")
    except httpx.TimeoutException as exc:
        raise DebugUnavailable(
            f"the agent on {path} did not answer within {timeout:g}s {hint}"
        ) from exc
    except httpx.TransportError as exc:
        if _find(exc, PermissionError) is not None:
            raise DebugUnavailable(
                f"permission denied on {path}: run as root or as the agent's user {hint}"
            ) from exc
        os_error = _find(exc, OSError)
        if os_error is None or getattr(os_error, "errno", None) in (
            errno.ENOENT,
            errno.ECONNREFUSED,
            None,
        ):
            raise DebugUnavailable(
                f"no agent is listening on {path}: is the agent running? {hint}"
            ) from exc
        raise DebugUnavailable(f"cannot read {path}: {os_error} {hint}") from exc
    ctype = resp.headers.get("content-type", "")
    if "json" not in ctype:
        if resp.status_code != 200:
            raise DebugUnavailable(f"{route}: HTTP {resp.status_code} from {path}")
        return resp.text
    try:
        doc = resp.json()
    except ValueError as exc:
        raise DebugUnavailable(f"{route}: the agent on {path} sent invalid JSON") from exc
    if resp.status_code != 200:
        message = doc.get("error") if isinstance(doc, dict) else None
        raise DebugUnavailable(f"{route}: {message or f'HTTP {resp.status_code}'}")
    return doc


# -- plain-text rendering ------------------------------------------------------------------


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
        all(_is_number(rows[r].get(k)) or rows[r].get(k) is None for r in range(len(rows)))
        for i, (k, _) in enumerate(cols)
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
