"""What SIGHUP does to a running standalone server: re-read its config file, apply what
can change in place, say which changes need a restart, and keep the outcome for the debug
status (`last_reload`).

- Routes (the RoutesConfig part: TCP mappings' targets, HTTP and Ingress routes, egress,
  `connect_nodes`, ...) apply through `Server.apply_routes`; a change it cannot make in
  place (a TCP mapping or HTTP listener added, removed or moved) is a ConfigError.
- Tokens apply at once: new handshakes use the new list, and the tunnels that a removed
  or changed token opened close (`token_revoked`), as when a token file is rotated; the
  token files watched from then on are the ones the file names now.
- Every other field (the tunnel listener, `tls` paths, `metrics_listen`, `debug_socket`,
  `server_id`, the fronts' listeners and limits, `keepalive`, `dial_timeout`, `connect`)
  is fixed for the process's life: a change is reported as "not applied: needs a restart"
  naming the fields, never passed off as applied.

An invalid file, or a route change refused, changes nothing (tokens included): the
running config stays and the reason is logged and shown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from pydantic import BaseModel

from nodeagent.config import ConfigError, RoutesConfig, ServerConfig, load_config
from nodeagent.server.server import Server
from nodeagent.server.workers import WorkerSlot
from nodeagent.trust.filewatch import FileReloader

# What a reload applies: the routes' fields and the tokens; the rest needs a restart.
APPLIED_FIELDS = frozenset(RoutesConfig.model_fields) | {"tokens"}


@dataclass
class ReloadOutcome:
    """One SIGHUP's result, for the log and `nodeagent debug status` (last_reload)."""

    outcome: str  # "applied", "partly_applied" (some fields need a restart), "refused"
    applied: list[str] = field(default_factory=list)  # "routes", "tokens"
    needs_restart: list[str] = field(default_factory=list)  # fields, "tunnel.url"
    tunnels_closed: list[str] = field(default_factory=list)  # nodes whose token went
    error: str | None = None
    at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "at": round(self.at, 3), "applied": self.applied,
                "needs_restart": self.needs_restart, "tunnels_closed": self.tunnels_closed,
                "error": self.error}


def changed_fields(old: BaseModel, new: BaseModel, skip: frozenset[str] = frozenset(),
                   prefix: str = "") -> list[str]:
    """The fields that differ between two models, a nested model's by their own names
    (`tunnel.url`)."""
    out = []
    for name in type(old).model_fields:
        if name in skip:
            continue
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if isinstance(before, BaseModel) and type(before) is type(after):
            out += changed_fields(before, after, prefix=f"{prefix}{name}.") or [prefix + name]
        else:
            out.append(prefix + name)
    return out


class ServerReloader:
    """Applies the config file to a running server on SIGHUP, and watches the token files
    its config names (re-pointed when a reload names others)."""

    def __init__(self, server: Server, nursery: trio.Nursery,
                 slot: WorkerSlot | None = None) -> None:
        self.server = server
        self._nursery = nursery
        self._slot = slot
        self._token_watch: trio.CancelScope | None = None

    def watch_token_files(self) -> None:
        """(Re)start polling the token files the entries in force name."""
        if self._token_watch is not None:
            self._token_watch.cancel()
            self._token_watch = None
        server = self.server
        files = [e.token_file for e in server.auth.entries if e.token_file is not None]
        if not files:
            server.reloaders.pop("tokens", None)
            return
        previous = server.reloaders.get("tokens")
        reloader = FileReloader("agent tokens", files, load=server.auth.load_tokens,
                                apply=server.reload_tokens, log=server.log)
        if previous is not None:  # the counts go on across a re-point
            reloader.reloads, reloader.failures = previous.reloads, previous.failures
        server.reloaders["tokens"] = reloader
        self._token_watch = trio.CancelScope()
        self._nursery.start_soon(self._run, reloader, self._token_watch)

    @staticmethod
    async def _run(reloader: FileReloader[Any], scope: trio.CancelScope) -> None:
        with scope:
            await reloader.run()

    async def reload(self, config_path: Path) -> ReloadOutcome:
        """Re-read `config_path` and apply it (see the module docstring)."""
        server = self.server
        try:
            outcome = await self._apply(config_path)
        except ConfigError as exc:
            outcome = ReloadOutcome("refused", error=str(exc)[:500])
            server.log.error("config reload refused; keeping the running config",
                             error=outcome.error)
        server.last_reload = outcome.as_dict()
        return outcome

    async def _apply(self, config_path: Path) -> ReloadOutcome:
        server, slot = self.server, self._slot
        new = load_config(ServerConfig, config_path)
        if slot is not None:
            new = slot.config(new)
        # Read first: a token file that cannot be used refuses the reload before
        # anything changes.
        tokens = server.auth.read_tokens(new.tokens)
        routes = new.routes()
        server.apply_routes(slot.routes(routes) if slot is not None else routes)
        applied = ["routes"]
        closed: list[str] = []
        if new.tokens != server.config.tokens:
            closed = await server.auth.reload_tokens(tokens, server.tunnel.sessions,
                                                     entries=new.tokens)
            server.config = server.config.model_copy(update={"tokens": new.tokens})
            applied.append("tokens")
            self.watch_token_files()
        restart = changed_fields(server.config, new, skip=APPLIED_FIELDS)
        if restart:
            server.log.warning("config reload: not applied: needs a restart",
                               fields=",".join(restart))
        server.log.info("config reloaded", applied=",".join(applied),
                        needs_restart=",".join(restart) or "none",
                        tunnels_closed=",".join(closed) or "none")
        return ReloadOutcome("partly_applied" if restart else "applied", applied=applied,
                             needs_restart=restart, tunnels_closed=closed)
