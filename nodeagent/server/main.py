"""Entry point of the server role: from a config file (`nodeagent server --config`), or
from flags with the controller's config watch stream (controller mode).

Both start every listener of one Server (listeners.server_listeners: tunnel, TCP
mappings, HTTP and Ingress fronts, CONNECT front, debug socket, health) in one nursery
through `ops.listener.Listeners`, and drain agents gracefully on SIGTERM/SIGINT (a second
one ends the drain at once); SIGHUP re-reads a config file. In controller mode the server
watches the controller directly and applies each RoutesConfig (Ingress routes,
certificates, egress, node CIDRs).

Static stability (controller mode, `--state-dir`): each RoutesConfig applied is also
written to STATE_DIR/routes.json (mode 0600, replaced atomically; it holds Ingress TLS
private keys, so it lives on the pod's own volume and is never logged). A server that
restarts while the controller is away serves those routes at once and asks for its
certificate and the current routes in the background.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import ssl
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import trio

from nodeagent.config import (
    ConfigError,
    ConfigProblems,
    RoutesConfig,
    ServerConfig,
    load_config,
    parse_config,
)
from nodeagent.configstream.client import (
    controller_address,
    read_ca_file,
    token_reader,
)
from nodeagent.ops.listener import Listeners
from nodeagent.ops.logs import get_logger
from nodeagent.runtime.malloctune import trim_forever
from nodeagent.server.flags import server_config_from_flags
from nodeagent.server.listeners import server_listeners
from nodeagent.server.readiness import DEFAULT_READY_GRACE, ReadinessGate
from nodeagent.server.reload import ServerReloader
from nodeagent.server.server import Server
from nodeagent.server.wakeclient import WakeClient
from nodeagent.server.workers import (
    WorkerSlot,
    check_worker_config,
    serve_worker,
)
from nodeagent.trust.filewatch import FileReloader
from nodeagent.trust.tlscontext import TlsInputError
from nodeagent.trust.tlscontext import server_ssl_context as tls_server_context
from tunnel import protocol as p
from tunnel.tcp import connect_tcp

log = get_logger("nodeagent.server")

ROUTES_STATE = "routes.json"


def persist_routes(state_dir: Path, routes: RoutesConfig) -> None:
    """Write `routes` to STATE_DIR/routes.json: 0600 from creation, renamed over the
    previous one (a crash leaves the old file or the new, never half of one)."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    state_dir.chmod(0o700)
    text = json.dumps({"version": routes.version,
                       "config": routes.model_dump(mode="json", exclude={"version"})},
                      separators=(",", ":"))
    # Per process: a server's workers persist the same routes into one directory.
    tmp = state_dir / f"{ROUTES_STATE}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)  # created afresh below, so with our mode and owner
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, state_dir / ROUTES_STATE)


def load_persisted_routes(state_dir: Path) -> tuple[RoutesConfig, dict[str, Any]] | None:
    """The routes persist_routes wrote, and their JSON; None (with one log line) when
    there are none or they cannot be used."""
    path = state_dir / ROUTES_STATE
    try:
        doc = json.loads(path.read_text())
        config = doc["config"]
        routes = parse_config(RoutesConfig, config, str(path))
        routes = routes.model_copy(update={"version": int(doc["version"])})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        # Never the content: it holds private keys.
        log.warning("persisted routes not usable; waiting for the controller",
                    path=str(path), error=type(exc).__name__)
        return None
    return routes, config


# Which setting named each TLS input (pki.TlsInputError.which), in a file and as flags.
TLS_FIELDS = {"cert": "tls.cert_file", "key": "tls.key_file", "ca": "tls.client_ca_file",
              "pair": "tls.cert_file, tls.key_file"}
TLS_FLAGS = {"cert": "--tls-cert", "key": "--tls-key", "pair": "--tls-cert, --tls-key",
             "ca": "--ca-file"}


def server_ssl_context(config: ServerConfig, source: str = "config",
                       fields: dict[str, str] = TLS_FIELDS) -> ssl.SSLContext | None:
    """The tunnel's TLS context; a file that cannot be used is a ConfigError naming the
    config `source`, the field and the problem ("server.yaml: tls.key_file: /k: not a PEM
    private key")."""
    if config.tls is None:
        return None
    try:
        return tls_server_context(
            config.tls.cert_file, config.tls.key_file, client_ca=config.tls.client_ca_file,
            require_client_cert=config.tls.require_client_cert)
    except TlsInputError as exc:
        raise ConfigError(f"{source}: {fields[exc.which]}: {exc}") from None
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{source}: tls: cannot load certificate or key: {exc}") from None


def check_token_files(config: ServerConfig, source: str) -> None:
    """Read every tokens[].token_file now, so an unreadable one names its field (all of
    them at once)."""
    problems = ConfigProblems()
    for index, entry in enumerate(config.tokens):
        if entry.token_file is not None:
            with problems.check():
                try:
                    entry.read()
                except ConfigError as exc:
                    raise ConfigError(f"{source}: tokens[{index}].token_file: {exc}") from None
    problems.raise_any()


def start_reloaders(server: Server, nursery: trio.Nursery,
                    ssl_context: ssl.SSLContext | None, tls_source: str,
                    tls_fields: dict[str, str]) -> list[ssl.SSLContext | None]:
    """Watch the tunnel's certificate, key and client CA files (the token files:
    reload.ServerReloader): returns the one-element holder of the tunnel's current TLS
    context (what new handshakes use; tunnels already up keep theirs)."""
    config = server.config
    holder = [ssl_context]
    tls = config.tls
    if ssl_context is not None and tls is not None:
        def swap(context: ssl.SSLContext) -> None:
            holder[0] = context

        files = [tls.cert_file, tls.key_file] + (
            [tls.client_ca_file] if tls.client_ca_file is not None else [])
        server.reloaders["tunnel_tls"] = FileReloader(
            "tunnel certificate", files,
            load=functools.partial(server_ssl_context, config, tls_source, tls_fields),
            apply=swap, log=server.log)
        nursery.start_soon(server.reloaders["tunnel_tls"].run)
    return holder


async def serve_server(server: Server, ssl_context: ssl.SSLContext | None, *,
                       drain_seconds: float = 30.0, shutdown_delay: float = 0.0,
                       ready_grace: float = DEFAULT_READY_GRACE,
                       config_path: Path | None = None,
                       tls_source: str = "config", tls_fields: dict[str, str] = TLS_FIELDS,
                       slot: WorkerSlot | None = None,
                       task_status: trio.TaskStatus[dict[str, list[str]]]
                       = trio.TASK_STATUS_IGNORED) -> None:
    """Run every listener of a server (listeners.server_listeners) until cancelled or
    signalled; reports the bound addresses by listener name ({"tunnel": [...],
    "tcp:NAME": [...], "http:NAME": [...], "debug": [...], ...}). The tunnel's
    certificate files and the token files are reloaded when they change.

    `slot`: this process is one of several workers (nodeagent/server/workers.py): its
    public listeners share their ports with the other workers (SO_REUSEPORT), and only
    worker 0 runs the CONNECT front."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trim_forever)  # malloctune.py: RSS back soon after load
        nursery.start_soon(server.agent_streams.flow_poller.run)
        await nursery.start(server.health_watch.run)  # active health checks' streams
        holder = start_reloaders(server, nursery, ssl_context, tls_source, tls_fields)
        reloader = ServerReloader(server, nursery, slot)
        reloader.watch_token_files()

        def current_context() -> ssl.SSLContext:
            context = holder[0]
            assert context is not None
            return context

        listeners = server.listeners = Listeners(server_listeners(
            server, tunnel_context=current_context if ssl_context is not None else None,
            reuse_port=slot is not None,
            runs_connect_front=slot is None or slot.runs_connect_front))
        if slot is not None and slot.restarted:
            # Its siblings serve the public ports: join them once ready (workers.py).
            bound = await listeners.start_all(nursery, kinds=_FIRST_WHEN_RESTARTED)
            server.ready_gate = ReadinessGate(started=time.monotonic(), grace=ready_grace)
            await nursery.start(_public_when_ready, server, listeners, nursery)
        else:
            bound = await listeners.start_all(nursery)
            server.ready_gate = ReadinessGate(started=time.monotonic(), grace=ready_grace)
        log.info("server ready", **{k: ",".join(v) for k, v in bound.items()})
        task_status.started(bound)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    if config_path is not None:
                        await reloader.reload(config_path)
                    continue
                log.info("shutting down: draining agents", signal=signal.Signals(signum).name,
                         grace_seconds=drain_seconds, delay_seconds=shutdown_delay)
                # A second signal during the drain ends it at once. Its watcher runs in a
                # nursery of the drain's own, so it has ended before the receiver's block
                # closes (a drain with nothing in flight returns at once).
                async with trio.open_nursery() as drain:
                    drain.start_soon(_cancel_on_next_signal, signals, drain.cancel_scope)
                    await _drain(server, listeners, drain_seconds=drain_seconds,
                                 shutdown_delay=shutdown_delay)
                    drain.cancel_scope.cancel()
                # Cut short, the drain left its tunnels open: they end now, telling each
                # agent why (resetting the streams in them).
                await _close_tunnels(server)
                nursery.cancel_scope.cancel()
                break


_FIRST_WHEN_RESTARTED = frozenset({"tunnel", "debug"})
_READY_POLL = 0.1  # seconds; readiness moves when an agent registers, at most `grace` long


async def _public_when_ready(server: Server, listeners: Listeners, nursery: trio.Nursery, *,
                             task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                             ) -> None:
    """A restarted worker: start the listeners not started yet once it is ready for public
    traffic; never while it drains."""
    task_status.started()
    while server.not_ready() is not None:
        if server.tunnel.draining:
            return
        await trio.sleep(_READY_POLL)
    await listeners.start_all(nursery, kinds=None, skip_started=True)
    log.info("public listeners open (restarted worker ready)",
             **{k: ",".join(v) for k, v in listeners.addresses().items()})


async def _drain(server: Server, listeners: Listeners, *, drain_seconds: float,
                 shutdown_delay: float) -> None:
    # Readiness fails first (a load balancer stops sending), then new tunnels are refused
    # by the kernel (they go to the next server), then GOAWAY.
    server.tunnel.start_draining()
    server.health_watch.stop()  # its streams are the server's own, not traffic to wait for
    # The tunnel listener closes its sockets. Public requests keep being served through
    # the tunnels until the load balancer has seen readiness fail: a GOAWAY at once would
    # answer 502 to every request it still sends here meanwhile. Keep-alive clients are
    # told to reconnect (through the balancer, to another replica) after their current
    # request; the connections idle all along close after the delay.
    listeners.drain(close_idle=False)
    await trio.sleep(shutdown_delay)
    listeners.drain(close_idle=True)
    await server.tunnel.drain("server shutting down", grace=drain_seconds)


async def _close_tunnels(server: Server) -> None:
    for session in list(server.tunnel.sessions.values()):
        await session.connection.aclose(p.ErrorCode.SHUTTING_DOWN, "server shutting down")


async def _cancel_on_next_signal(signals: Any, scope: trio.CancelScope) -> None:
    async for signum in signals:
        if signum != signal.SIGHUP:
            log.info("second signal: not waiting for the drain",
                     signal=signal.Signals(signum).name)
            scope.cancel()
            return


def worker_slot(args: argparse.Namespace | None) -> WorkerSlot | None:
    """This process's worker slot: None when it is the only server process."""
    index = getattr(args, "worker_index", None)
    if index is None:
        return None
    count = int(getattr(args, "workers", 1) or 1)
    if not 0 <= index < count:
        raise ConfigError(f"--worker-index {index}: not in 0-{count - 1}")
    return WorkerSlot(index, count, getattr(args, "parent_fd", None),
                      restarted=bool(getattr(args, "worker_restart", False)))


def run_server(config_path: Path, *, check: bool = False, drain_seconds: float = 30.0,
               shutdown_delay: float = 0.0, ready_grace: float = DEFAULT_READY_GRACE,
               workers: int = 1, slot: WorkerSlot | None = None) -> int:
    """Standalone mode: the only server process, or worker `slot` of `workers` (their
    parent: workers.run_parent)."""
    config = load_config(ServerConfig, config_path)
    # The files it names, each checked whatever the others' fate: every problem at once,
    # before anything listens.
    problems = ConfigProblems()
    with problems.check():
        check_worker_config(config, workers, str(config_path))
    ssl_context = None
    with problems.check():
        ssl_context = server_ssl_context(config, str(config_path))
    with problems.check():
        check_token_files(config, str(config_path))
    problems.raise_any()
    server = Server(slot.config(config) if slot is not None else config)
    if check:
        print(f"{config_path}: valid. tunnel {config.tunnel.url}, {len(config.tokens)} "
              f"token(s), {len(config.tcp)} TCP mapping(s), {len(config.http)} HTTP "
              f"listener(s)" + (f", {workers} workers" if workers > 1 else ""))
        return 0

    def main() -> Awaitable[None]:
        return serve_server(server, ssl_context, drain_seconds=drain_seconds,
                            shutdown_delay=shutdown_delay, ready_grace=ready_grace,
                            config_path=config_path, tls_source=str(config_path), slot=slot)

    if slot is not None:
        trio.run(serve_worker, slot, main)
    else:
        trio.run(main)
    return 0


def run_server_cluster(args: argparse.Namespace) -> int:
    # Controller mode only: this server's own certificate (a key, a CSR: cryptography).
    # A server started from a file never imports these.
    from nodeagent.configstream.cluster import ControllerLink

    config = server_config_from_flags(args)
    workers = int(getattr(args, "workers", 1))  # 0 is refused below, as with --config
    check_worker_config(config, workers, "flags")
    token = token_reader(Path(str(args.token_file)))
    ssl_context = server_ssl_context(config, "flags", TLS_FLAGS)
    slot = worker_slot(args)
    if slot is not None:
        # Each worker is a server of its own to the controller too: its own certificate
        # (the controller signs for the pod's token, whatever the id) and routes watch.
        config = slot.config(config)
    assert config.controller is not None and config.tls is not None
    assert config.tls.client_ca_file is not None
    host, port = controller_address(config.controller)
    ca_file = config.tls.client_ca_file
    ca_pem = read_ca_file(ca_file)
    server = Server(config)
    if args.check:
        # The flags and the files they name are read; the routes are the controller's.
        print(f"flags: valid. tunnel {config.tunnel.url}, server id {config.server_id}, "
              f"controller {config.controller} (routes come from it)"
              + (f", {workers} workers" if workers > 1 else ""))
        return 0

    async def open_stream() -> trio.abc.Stream:
        # connect_tcp: every address in turn, and TCP keepalive (a controller that
        # vanished is noticed in ~35 s, long before three missed heartbeats).
        return await connect_tcp(host, port, connect_timeout=10.0)

    def current_ca() -> bytes:
        # The --ca-file as it is now (a CA rotation changes it; a broken file: the last
        # good one): it verifies the controller.
        nonlocal ca_pem
        try:
            ca_pem = read_ca_file(ca_file)
        except ConfigError as exc:
            log.warning("--ca-file not usable; verifying with the last good one",
                        error=str(exc)[:200])
        return ca_pem

    link = ControllerLink(kind="server", name=config.server_id, url=config.controller,
                          token=token, ca_pem=current_ca, open_stream=open_stream,
                          log=log.bind(server=config.server_id))
    server.identity = link.keeper
    server.config_watch = link.status
    wake_client = WakeClient(server.holds, link.post, config.server_id,
                             lambda: server.routes.activity_interval,
                             log.bind(server=config.server_id))
    state_dir: Path | None = getattr(args, "state_dir", None)

    async def apply(routes: RoutesConfig) -> None:
        server.apply_routes(slot.routes(routes) if slot is not None else routes)
        if state_dir is not None:
            try:
                persist_routes(state_dir, routes)
            except OSError as exc:
                log.warning("routes applied but not persisted", path=str(state_dir),
                            error=str(exc)[:200])
        await server.close_revoked()  # a deleted or denied Node's tunnel

    persisted = load_persisted_routes(state_dir) if state_dir is not None else None
    running: dict[str, Any] | None = None
    if persisted is not None:
        server.apply_routes(slot.routes(persisted[0]) if slot is not None else persisted[0])
        running = persisted[1]
        link.status.applied_version = persisted[0].version
        log.info("serving the routes persisted before the restart until the controller "
                 "answers", version=persisted[0].version, path=str(state_dir))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            # Serve the persisted routes at once; else wait for the first certificate.
            await nursery.start(functools.partial(
                link.run, RoutesConfig, apply, running=running,
                serve_before_identity=persisted is not None))
            nursery.start_soon(wake_client.run)
            await serve_server(server, ssl_context, tls_source="flags",  # returns on SIGTERM/SIGINT
                               tls_fields=TLS_FLAGS, drain_seconds=args.drain_seconds,
                               shutdown_delay=args.shutdown_delay,
                               ready_grace=args.ready_grace, slot=slot)
            nursery.cancel_scope.cancel()

    if slot is not None:
        trio.run(serve_worker, slot, main)
    else:
        trio.run(main)
    return 0
