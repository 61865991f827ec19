"""One interface for every listening socket a role runs, and the one place that starts
them.

A `Listener` is one kind of listener: the tunnel, an HTTP front, the CONNECT front, a TCP
mapping, the debug socket, the health listener. Started in a nursery it binds, reports the
addresses it listens on, and serves until stopped or cancelled; `drain` is its part of a
graceful shutdown; `describe()` is what the debug socket shows of it. A role lists its
listeners once and `Listeners` starts, drains and stops them all, so adding a kind of
listener is one subclass and the code that runs the role does not change (the shape of
mitmproxy's `proxy/mode_servers.py` ServerInstance).

Clients a role runs (the config watch, the tunnel's dialer) are not listeners.

A listener that cannot start (the port is taken, a privileged port, a directory it may not
write) raises `ListenerFailed`: one line naming the setting, the address, the reason and
what to do, which the CLI prints instead of a traceback.
"""

from __future__ import annotations

import abc
import contextlib
import errno
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, Self

import trio

from nodeagent.config import StartupFailed


def bind_advice(error: OSError, address: str) -> str:
    """What an error binding `address` means and what to do about it, in a few words."""
    port = address.rpartition(":")[2]
    unix = ":" not in address or address.startswith(("/", "unix:"))
    code = error.errno
    if unix and code in (errno.EADDRINUSE, errno.EEXIST) and error.strerror:
        return error.strerror  # DebugSocketInUse's own words
    if code == errno.EADDRINUSE:
        if unix:
            return "address already in use: remove the file if nothing serves it, or " \
                   "choose another path"
        return (f"address already in use: another process listens there (`ss -ltnp "
                f"'sport = :{port}'` shows which); stop it or choose another port")
    if code in (errno.EACCES, errno.EPERM):
        if not unix and port.isdigit() and int(port) < 1024:
            return (f"permission denied: port {port} is below 1024, which needs root or "
                    "CAP_NET_BIND_SERVICE; grant it, or choose a port above 1023")
        return "permission denied: this user may not create it there; choose another " \
               "path, or run as a user that may"
    if code == errno.EADDRNOTAVAIL:
        return "address not available: no interface of this host has that address; " \
               "use one it has, or 0.0.0.0 for all"
    if code in (errno.ENOENT, errno.ENOTDIR):
        return "no such directory: create it, or choose another path"
    if code == errno.EROFS:
        return "read-only file system: choose a writable path"
    return (error.strerror or str(error)).lower()


class ListenerFailed(StartupFailed):
    """A listener could not bind: `setting` (the config field, `tcp[0].listen`) and
    `address` (what it tried) name it."""

    def __init__(self, setting: str, address: str, error: OSError | str) -> None:
        why = error if isinstance(error, str) else bind_advice(error, address)
        super().__init__(setting, f"cannot listen on {address}: {why}")
        self.address = address


def _bind_failure(exc: BaseException) -> ListenerFailed | OSError | None:
    """The one reason a listener did not start, out of the exception groups its nurseries
    wrap it in; None if `exc` is anything else (a bug: the traceback is wanted)."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        elif not isinstance(e, trio.Cancelled):
            leaves.append(e)

    walk(exc)
    if len(leaves) == 1 and isinstance(leaves[0], ListenerFailed | OSError):
        return leaves[0]
    return None


@contextlib.contextmanager
def bind_errors(setting: str, address: object) -> Iterator[None]:
    """Around the start of one of a listener's sockets when it has several (the CONNECT
    front's Unix socket and TCP port): a failure to bind names that socket's setting."""
    try:
        yield
    except BaseException as exc:
        failure = _bind_failure(exc)
        if isinstance(failure, OSError):
            raise ListenerFailed(setting, str(address), failure) from None
        raise


class Listener(abc.ABC):
    """One listening socket (or set of sockets) of one kind, and what it serves."""

    setting = ""
    """The config field that asked for it (`tcp[0].listen`, `debug_socket`), for errors."""
    bind_address = ""
    """What it binds, as the setting says it (`0.0.0.0:8080`, a socket path)."""

    def for_setting(self, setting: str, address: object) -> Self:
        """Name the config field and the address this listener binds, for the one line
        said when it cannot."""
        self.setting, self.bind_address = setting, str(address)
        return self

    kind: ClassVar[str]
    """What this listener is ("tunnel", "http", "connect", "debug", ...)."""

    def __init__(self, name: str) -> None:
        self.name = name
        """Which one of its kind ("http:public", "tcp:ssh"); unique in a process."""
        self.addresses: list[str] = []
        """Where it listens ("host:port", "[v6]:port", "unix:/path"), once started."""
        self._scope: trio.CancelScope | None = None

    @abc.abstractmethod
    async def run(self, *, task_status: trio.TaskStatus[list[str]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, set `addresses` and report them through `task_status`, then serve until
        cancelled. Everything it serves lives in nurseries inside this call."""

    async def start(self, nursery: trio.Nursery) -> list[str]:
        """Run in `nursery`; returns the addresses once listening. Raises ListenerFailed
        if it cannot bind."""
        try:
            addresses: list[str] = await nursery.start(self._run_until_stopped)
        except BaseException as exc:
            failure = _bind_failure(exc)
            if isinstance(failure, ListenerFailed):
                raise failure from None
            if failure is None:
                raise
            raise ListenerFailed(self.setting or self.name, self.bind_address or self.name,
                                 failure) from None
        return addresses

    async def _run_until_stopped(self, *, task_status: trio.TaskStatus[list[str]]
                                 = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self._scope = scope
            try:
                await self.run(task_status=task_status)
            finally:
                self._scope = None

    @property
    def running(self) -> bool:
        """Started with `start` and not stopped yet."""
        return self._scope is not None

    def drain(self, *, close_idle: bool) -> None:
        """Graceful shutdown: stop taking new work (first with `close_idle` False, while a
        load balancer still sends; then True). Most listeners have nothing to do."""
        return

    def stop(self) -> None:
        """Close the listening sockets and everything served through them."""
        if self._scope is not None:
            self._scope.cancel()

    def details(self) -> dict[str, Any]:
        """What else the debug socket shows of this listener (per kind)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """This listener for the debug socket: name, kind, addresses, running, details."""
        return {"name": self.name, "kind": self.kind, "addresses": list(self.addresses),
                "running": self.running, **self.details()}


class Listeners:
    """Every listener of one process, started in the order given, in one place."""

    def __init__(self, listeners: Iterable[Listener] = ()) -> None:
        self.all = list(listeners)
        names = [listener.name for listener in self.all]
        if len(set(names)) != len(names):
            raise ValueError(f"listener names must be unique: {names}")

    async def start_all(self, nursery: trio.Nursery, *,
                        kinds: frozenset[str] | None = None,
                        skip_started: bool = False) -> dict[str, list[str]]:
        """Start each listener in `nursery`, in order (a failure to bind raises and the
        rest are not started); returns name -> addresses. `kinds`: only listeners of
        these kinds; `skip_started`: leave those already running (a second call)."""
        for listener in self.all:
            if kinds is not None and listener.kind not in kinds:
                continue
            if skip_started and listener.running:
                continue
            await listener.start(nursery)
        return self.addresses()

    def addresses(self) -> dict[str, list[str]]:
        return {listener.name: list(listener.addresses) for listener in self.all
                if listener.addresses}

    def drain(self, *, close_idle: bool) -> None:
        for listener in self.all:
            listener.drain(close_idle=close_idle)

    def stop_all(self) -> None:
        for listener in self.all:
            listener.stop()

    def describe(self) -> list[dict[str, Any]]:
        return [listener.describe() for listener in self.all]


def socket_address(listener: trio.SocketListener) -> str:
    """host:port a listening socket is bound to ([host]:port for IPv6)."""
    host, port = listener.socket.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
