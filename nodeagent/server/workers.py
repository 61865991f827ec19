"""Several worker processes for one server (`nodeagent server --workers N`): both cores.

A server process is CPU-bound Python on one core. With `--workers N` the command becomes
a small parent that starts N workers (the same command with `--worker-index K`), each a
whole server: the same mechanism as N server replicas behind one address, on one host.

- Public listeners (tunnel, HTTP and Ingress fronts, TCP mappings) are opened by every
  worker with SO_REUSEPORT (tunnel/listeners.py): the kernel spreads new connections
  over the workers.
- Worker K is server `<server_id>-w<K>` and announces `replicas * N` in its handshake,
  so every agent holds a tunnel to every worker (ALREADY_CONNECTED, held_servers: the
  HA mechanism) and any worker reaches any node.
- The CONNECT front (a Unix socket path, an mTLS port) runs in worker 0 only: a socket
  path cannot be shared, and every agent holds a tunnel to worker 0 too.
- Each worker keeps its own debug socket (`server-w<K>.sock` beside the configured
  path): tunnels and streams are per-process state, and `nodeagent debug status
  --socket ...` shows one worker's exactly, without the parent merging tables.
- The parent serves `metrics_listen` for the pod: `/healthz`; `/readyz`, ready only
  when every worker is up (its debug socket answers) and none is draining — a probe
  that hit one worker at random would call a pod ready with a worker down, and
  Prometheus scraping one worker at random would see counters jump between processes;
  and `/metrics`, every worker's metrics with a `worker` label.
- The parent restarts a worker that exits (backoff 0.5 s doubling to 30 s, reset after a
  worker has run 60 s). A restarted worker opens its tunnel listener and debug socket at
  once but its public listeners only when it is ready (readiness.py: a tunnel from every
  node its routes name, or the grace): the kernel hands a listener in the SO_REUSEPORT
  group its share of new connections as soon as it binds, and a worker without the
  node's tunnel would answer them 502 while its siblings could serve them. The parent
  forwards SIGHUP, and on SIGTERM/SIGINT forwards it to every
  worker (each drains as a single server does) and exits when they all have. A worker
  drains as on SIGTERM when the parent dies (it holds the read end of a pipe whose only
  write end is the parent's: end of file), so none outlives it. (Not PR_SET_PDEATHSIG:
  that fires when the *thread* that started the child exits, and trio starts processes
  from its thread cache.)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import h11
import trio

from nodeagent.config import ConfigError, RoutesConfig, ServerConfig
from nodeagent.ops.jsonhttp import Reply, Request, json_reply, serve_http
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.server.workers")

MAX_WORKERS = 16
EXIT_USAGE = 2  # nodeagent.cli: a usage or config error
EXIT_STARTUP = 3  # nodeagent.cli: a port in use, a missing capability
RESTART_INITIAL = 0.5
RESTART_MAXIMUM = 30.0
RESTART_RESET_AFTER = 60.0  # a worker that ran this long restarts at the initial delay
MAX_REPLICAS = 64  # tunnel.protocol.wire.MAX_REPLICAS: an agent ignores a larger count


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Which worker this process is, of how many: what differs between workers."""

    index: int
    count: int
    parent_fd: int | None = None  # read end of the parent's pipe: EOF when it is gone
    # Started again after it exited: its siblings serve the public ports meanwhile, so it
    # joins them (binds its public listeners) only once it is ready (serve_server).
    restarted: bool = False

    def server_id(self, base: str) -> str:
        return f"{base}-w{self.index}"

    def replicas(self, replicas: int | None) -> int:
        """Distinct servers behind the public address: each replica is `count` workers."""
        return min((replicas or 1) * self.count, MAX_REPLICAS)

    def config(self, config: ServerConfig) -> ServerConfig:
        """This worker's view of the server's config."""
        return config.model_copy(update={
            "server_id": self.server_id(config.server_id),
            "replicas": self.replicas(config.replicas),
            "debug_socket": worker_socket(config.debug_socket, self.index),
            "metrics_listen": None,  # the parent's
        })

    def routes(self, routes: RoutesConfig) -> RoutesConfig:
        """Routes from the controller or a reloaded file, with the count this worker
        announces."""
        return routes.model_copy(update={"replicas": self.replicas(routes.replicas)})

    @property
    def runs_connect_front(self) -> bool:
        return self.index == 0


def worker_socket(path: Path, index: int) -> Path:
    """Worker `index`'s debug socket beside `path`: server.sock → server-w0.sock."""
    return path.with_name(f"{path.stem}-w{index}{path.suffix}")


def check_worker_config(config: ServerConfig, count: int, source: str) -> None:
    """Every public port must be fixed: with port 0 each worker would get its own."""
    if count < 1 or count > MAX_WORKERS:
        raise ConfigError(f"--workers: {count} is not in 1-{MAX_WORKERS}")
    if count == 1:
        return
    ports = [("tunnel", config.tunnel.url.rsplit(":", 1)[-1].split("/")[0])]
    ports += [(f"tcp[{i}].listen", str(m.listen.port)) for i, m in enumerate(config.tcp)]
    ports += [(f"http[{i}].listen", str(h.listen.port)) for i, h in enumerate(config.http)]
    ports += [(name, str(listen.port)) for name, listen in (
        ("ingress_http", config.ingress_http), ("ingress_https", config.ingress_https),
        ("metrics_listen", config.metrics_listen)) if listen is not None]
    for name, port in ports:
        if port == "0":
            raise ConfigError(f"{source}: {name}: port 0 with --workers {count}: each "
                              f"worker would listen on a port of its own; give a port")


async def serve_worker(slot: WorkerSlot, serve: Callable[[], Awaitable[None]]) -> None:
    """Run `serve` (the server), draining it as on SIGTERM if the parent goes away."""
    async with trio.open_nursery() as nursery:
        if slot.parent_fd is not None:
            nursery.start_soon(_exit_with_parent, slot.parent_fd)
        await serve()
        nursery.cancel_scope.cancel()


async def _exit_with_parent(fd: int) -> None:
    async with trio.lowlevel.FdStream(os.dup(fd)) as pipe:
        while await pipe.receive_some(1024):
            pass  # the parent writes nothing: only its end of file matters
    log.warning("the server's parent process is gone; draining")
    os.kill(os.getpid(), signal.SIGTERM)  # the server's own shutdown path


# ------------------------------------------------------------------------ the parent


@dataclass
class _Worker:
    index: int
    socket: Path
    process: trio.Process | None = None
    starts: int = 0


@dataclass
class Supervisor:
    """Starts the workers, restarts one that exits, passes signals on."""

    argv: Sequence[str]  # the worker command without --worker-index
    count: int
    debug_socket: Path
    workers: list[_Worker] = field(init=False)
    stop: trio.Event = field(default_factory=trio.Event)
    exit_code: int = 0
    # Workers hold the read end; the write end stays here, unwritten, for our life.
    _pipe: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.workers = [_Worker(k, worker_socket(self.debug_socket, k))
                        for k in range(self.count)]
        self._pipe = os.pipe()  # not inheritable: only pass_fds hands the read end on

    async def run(self, metrics_listen: tuple[str, int] | None = None) -> None:
        """Until every worker has exited after SIGTERM/SIGINT."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT,
                                       signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._forward, signals)
                if metrics_listen is not None:
                    await nursery.start(self._serve_health, *metrics_listen)
                log.info("server workers starting", workers=self.count)
                async with trio.open_nursery() as workers:
                    for worker in self.workers:
                        workers.start_soon(self._keep, worker)
                nursery.cancel_scope.cancel()  # the signal forwarder, the health listener

    @property
    def stopping(self) -> bool:
        return self.stop.is_set()

    async def _forward(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            if signum != signal.SIGHUP:
                if not self.stopping:
                    log.info("stopping: every worker drains",
                             signal=signal.Signals(signum).name)
                self.stop.set()
            self._signal_all(signum)

    def _stop_all(self, signum: int) -> None:
        self.stop.set()
        self._signal_all(signum)

    def _signal_all(self, signum: int) -> None:
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signum)

    async def _keep(self, worker: _Worker) -> None:
        delay = RESTART_INITIAL
        while not self.stopping:
            started = trio.current_time()
            worker.starts += 1
            # Its own process group: a Ctrl-C in a terminal reaches the parent only,
            # which passes it on (once) like any signal.
            try:
                worker.process = await trio.lowlevel.open_process(
                    [*self.argv, *(["--worker-restart"] if worker.starts > 1 else []),
                     "--worker-index", str(worker.index),
                     "--parent-fd", str(self._pipe[0])],
                    start_new_session=True, pass_fds=(self._pipe[0],))
            except OSError as exc:  # out of processes or memory: try again, as on an exit
                log.error("cannot start a worker", worker=worker.index, error=str(exc))
                code = None
            else:
                if self.stopping:  # a signal came while it was starting
                    worker.process.send_signal(signal.SIGTERM)
                with trio.CancelScope(shield=True):  # a worker is waited for, never left
                    code = await worker.process.wait()
            if self.stopping:
                log.info("worker exited", worker=worker.index, code=code)
                return
            if code in (EXIT_USAGE, EXIT_STARTUP) and worker.starts == 1:
                # Its config is invalid, or this host cannot honour it (a port in use): it
                # said why in one line, and restarting would say it again.
                log.error("worker found the config invalid; stopping the server"
                          if code == EXIT_USAGE else "worker could not start (a setting "
                          "this host cannot honour); stopping the server",
                          worker=worker.index, code=code)
                self.exit_code = code
                self._stop_all(signal.SIGTERM)
                return
            if trio.current_time() - started >= RESTART_RESET_AFTER:
                delay = RESTART_INITIAL
            log.warning("worker exited; restarting it", worker=worker.index, code=code,
                        retry_in=f"{delay:.1f}s")
            with trio.move_on_after(delay):
                await self.stop.wait()
            delay = min(delay * 2, RESTART_MAXIMUM)

    # ------------------------------------------------------------ metrics and health

    async def _serve_health(self, host: str, port: int, *,
                            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                            ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        log.info("metrics and health listening (all workers)", address=f"{host}:{port}")
        task_status.started()
        async def handle(stream: trio.SocketStream) -> None:
            await serve_http(stream, self._route)

        await trio.serve_listeners(handle, listeners)

    async def _route(self, request: Request) -> Reply:
        if request.path == "/healthz":
            return json_reply(200, {"ok": True})
        if request.path == "/readyz":
            reason = await self.not_ready()
            return json_reply(200, {"ready": True}) if reason is None else json_reply(
                503, {"ready": False, "reason": reason})
        if request.path == "/metrics":
            return Reply(200, await self.metrics(), content_type="text/plain; version=0.0.4")
        return json_reply(404, {"error": f"no such route {request.path}",
                                "routes": ["/healthz", "/metrics", "/readyz"]})

    async def not_ready(self) -> str | None:
        """Why the pod should get no traffic now (None: ready)."""
        if self.stopping:
            return "draining"
        for worker in self.workers:
            if worker.process is None or worker.process.returncode is not None:
                return f"worker {worker.index} is not running"
            try:
                stream = await trio.open_unix_socket(str(worker.socket))
            except OSError:
                return f"worker {worker.index} is starting"
            await stream.aclose()
        return None

    async def metrics(self) -> bytes:
        """Every worker's metrics, each sample labelled with its worker."""
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        families: dict[str, object] = {}
        for worker in self.workers:
            try:
                with trio.fail_after(5.0):
                    text = await get_unix(worker.socket, "/metrics")
            except (OSError, trio.BrokenResourceError, trio.TooSlowError, h11.ProtocolError,
                    ValueError):
                continue  # a worker restarting: its samples are missing from this scrape
            for family in text_string_to_metric_families(text.decode()):
                merged = families.setdefault(family.name, family)
                if merged is not family:
                    merged.samples.extend(  # type: ignore[attr-defined]
                        s._replace(labels={**s.labels, "worker": str(worker.index)})
                        for s in family.samples)
                else:
                    family.samples = [s._replace(labels={**s.labels,
                                                         "worker": str(worker.index)})
                                      for s in family.samples]

        class _Merged:
            def collect(self) -> list[object]:
                return list(families.values())

        return generate_latest(_Merged())  # type: ignore[arg-type]


async def get_unix(path: Path, route: str) -> bytes:
    """GET `route` over the Unix socket `path` (a worker's debug socket): the body."""
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        await stream.send_all(conn.send(h11.Request(
            method="GET", target=route,
            headers=[("host", "worker"), ("connection", "close")])) or b"")
        await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
        body = bytearray()
        status = 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        if status != 200:
            raise ValueError(f"{route}: status {status}")
        return bytes(body)


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The command that runs one worker: this program with the same arguments."""
    return [sys.executable, "-m", "nodeagent", *argv]


def run_parent(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """`nodeagent server --workers N` (N > 1): read the config (for the metrics listener
    and debug socket paths, and to refuse port 0 and bad fields at once), then supervise
    the workers. The parent never loads the server itself (TLS, routes, HTTP fronts):
    41 MiB at start where a worker takes 56. The workers check the rest (certificate and key,
    token files); a worker that finds an invalid config at its first start stops the
    whole server with exit code 2."""
    from nodeagent.config import load_config

    if args.config is not None:
        config = load_config(ServerConfig, args.config)
        source = str(args.config)
    else:
        from nodeagent.server.flags import server_config_from_flags

        config = server_config_from_flags(args)
        source = "flags"
    check_worker_config(config, args.workers, source)
    metrics = config.metrics_listen
    supervisor = Supervisor(worker_argv(argv), args.workers, config.debug_socket)
    trio.run(supervisor.run, (metrics.host, metrics.port) if metrics is not None else None)
    return supervisor.exit_code


__all__ = ["WorkerSlot", "check_worker_config", "run_parent", "serve_worker",
           "worker_socket"]
