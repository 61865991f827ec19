"""The node-local debug socket: the JSON routes of `ops.jsonhttp` on a Unix socket, and
its client.

Server side (agent and server roles): `DebugServer(path, routes, registry=...)`, a
`Listener` (ops.listener), serves each route (`"/status": callable`) as JSON on GET/HEAD,
`/metrics` as Prometheus text when given a registry, and `/` as the list of routes. The
socket file is created with mode 0600 (the caller may choose 0660 for a group), a stale
file left by a crashed agent is removed at start (a live one is refused), and the file is
removed on exit.

Client side (the CLI, synchronous): `fetch_debug(path, "/status")` returns the decoded
JSON or raises `DebugUnavailable` with one line a human can act on. `ops.render` turns it
into the tables `nodeagent debug` prints.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from nodeagent.ops.jsonhttp import JsonRoutes, RouteHandler, serve_http
from nodeagent.ops.listener import Listener
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.debug")

DEFAULT_SOCKET = "/run/nodeagent/debug.sock"


class DebugUnavailable(Exception):
    """The debug socket could not be read; the message is meant for the user as is."""


class DebugSocketInUse(OSError):
    """Another live process already serves this socket path, or a file that is no socket
    is there (an OSError: Listener.start says it in one line, as for a port in use)."""


class DebugServer(Listener):
    """Serves `routes` (path → callable returning JSON-able data) on a Unix socket."""

    kind = "debug"

    def __init__(
        self,
        path: str | os.PathLike[str],
        routes: Mapping[str, RouteHandler],
        *,
        registry: Any = None,
        mode: int = 0o600,
        idle_timeout: float = 30.0,
    ) -> None:
        super().__init__("debug")
        self.path = Path(path)
        self.routes = JsonRoutes(routes, registry=registry)
        self.mode = mode
        self.idle_timeout = idle_timeout

    def _remove_stale(self) -> None:
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise DebugSocketInUse(
                errno.EEXIST, "a file that is not a socket is there: remove it or choose "
                              "another path")
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
        raise DebugSocketInUse(
            errno.EADDRINUSE, "another process is serving it (a second agent or server on "
                              "this host?): stop it, or choose another path")

    async def run(self, *, task_status: trio.TaskStatus[list[str]]
                  = trio.TASK_STATUS_IGNORED) -> None:
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
                        trio.serve_listeners, self.serve_connection, [listener],
                        handler_nursery=nursery
                    )
                )
                self.addresses = [f"unix:{self.path}"]
                task_status.started(self.addresses)
        finally:
            self.addresses = []
            sock.close()
            with contextlib.suppress(OSError):
                if self.path.stat().st_ino == ino:
                    self.path.unlink()

    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        """Answer one HTTP connection."""
        await serve_http(stream, self.routes, idle_timeout=self.idle_timeout)

    def details(self) -> dict[str, Any]:
        return {"mode": f"{self.mode:04o}"}


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
    # Connect once ourselves first: httpx's Unix-socket transport leaks its socket when
    # connect() fails (seen with httpx 0.28 / httpcore 1.0), and our own error says
    # exactly what is wrong. A socket that vanishes in between still fails cleanly below.
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout)
        probe.connect(path)
    except PermissionError as exc:
        raise DebugUnavailable(
            f"permission denied on {path}: run as root or as its user {hint}") from exc
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
        raise DebugUnavailable(
            f"nothing is listening on {path}: is the agent or server running? {hint}") from exc
    except TimeoutError as exc:
        raise DebugUnavailable(
            f"the process on {path} did not answer within {timeout:g}s {hint}") from exc
    except OSError as exc:
        raise DebugUnavailable(f"cannot read {path}: {exc.strerror or exc} {hint}") from exc
    finally:
        probe.close()
    import httpx  # the debug client only: agents and servers never load it (~8 MiB)

    try:
        transport = httpx.HTTPTransport(uds=path)
        with httpx.Client(transport=transport, timeout=timeout, trust_env=False) as client:
            resp = client.get(f"http://nodeagent{route}")
    except httpx.TimeoutException as exc:
        raise DebugUnavailable(
            f"the process on {path} did not answer within {timeout:g}s {hint}"
        ) from exc
    except httpx.TransportError as exc:
        if _find(exc, PermissionError) is not None:
            raise DebugUnavailable(
                f"permission denied on {path}: run as root or as its user {hint}"
            ) from exc
        os_error = _find(exc, OSError)
        if os_error is None or getattr(os_error, "errno", None) in (
            errno.ENOENT,
            errno.ECONNREFUSED,
            None,
        ):
            raise DebugUnavailable(
                f"nothing is listening on {path}: is the agent or server running? {hint}"
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
        raise DebugUnavailable(f"{route}: the process on {path} sent invalid JSON") from exc
    if resp.status_code != 200:
        message = doc.get("error") if isinstance(doc, dict) else None
        raise DebugUnavailable(f"{route}: {message or f'HTTP {resp.status_code}'}")
    return doc
