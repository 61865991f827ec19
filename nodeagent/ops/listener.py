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
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any, ClassVar

import trio


class Listener(abc.ABC):
    """One listening socket (or set of sockets) of one kind, and what it serves."""

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
        """Run in `nursery`; returns the addresses once listening."""
        addresses: list[str] = await nursery.start(self._run_until_stopped)
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

    async def start_all(self, nursery: trio.Nursery) -> dict[str, list[str]]:
        """Start each listener in `nursery`, in order (a failure to bind raises and the
        rest are not started); returns name -> addresses."""
        for listener in self.all:
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
