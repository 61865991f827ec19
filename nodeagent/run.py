"""Process entry points for the server and agent roles: load config, build TLS, run
everything in one nursery, stop gracefully on signals."""

from __future__ import annotations

import functools
import signal
import ssl
from pathlib import Path
from typing import Any

import trio

from netfilter.model import NetfilterError
from nodeagent import pki
from nodeagent.agent import Agent
from nodeagent.config import AgentConfig, ConfigError, ServerConfig, load_config
from nodeagent.debug import DebugServer
from nodeagent.health import HealthServer
from nodeagent.http.proxy import HttpFront, HttpStats
from nodeagent.http.tls import TlsConfig
from nodeagent.logs import get_logger
from nodeagent.server import Server
from tunnel.dial import parse_endpoint, serve

log = get_logger("nodeagent.run")


def server_ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    if config.tls is None:
        return None
    try:
        return pki.server_ssl_context(
            config.tls.cert_file, config.tls.key_file, client_ca=config.tls.client_ca_file,
            require_client_cert=config.tls.require_client_cert)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"tls: cannot load certificate or key: {exc}") from None


def agent_ssl_context(config: AgentConfig) -> ssl.SSLContext | None:
    if not config.server.startswith(("tls://", "wss://")):
        return None
    try:
        ctx = pki.client_ssl_context(config.tls.ca_file, config.tls.cert_file,
                                     config.tls.key_file)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"tls: cannot load CA, certificate or key: {exc}") from None
    if config.tls.insecure_skip_verify:
        log.warning("tls.insecure_skip_verify is set: the server's identity is NOT checked")
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def serve_server(server: Server, ssl_context: ssl.SSLContext | None, *,
                       drain_seconds: float = 30.0, config_path: Path | None = None,
                       task_status: trio.TaskStatus[dict[str, list[str]]]
                       = trio.TASK_STATUS_IGNORED) -> None:
    """Run every listener of a server until cancelled or signalled; reports the bound
    addresses ({"tunnel": [...], "tcp:NAME": [...], "http:NAME": [...]})."""
    config = server.config
    async with trio.open_nursery() as nursery:
        endpoint = parse_endpoint(config.tunnel.url)
        bound = await nursery.start(lambda task_status: serve(
            endpoint, server.tunnel.handle_transport, ssl_context=ssl_context,
            task_status=task_status))
        server.bound["tunnel"] = [str(b) for b in bound]
        for index, mapping in enumerate(config.tcp):
            name = f"tcp:{mapping.name or index}"

            async def handler(client: trio.SocketStream, mapping: Any = mapping) -> None:
                await server.serve_tcp_mapping(mapping, client)

            listeners = await nursery.start(functools.partial(
                trio.serve_tcp, handler, mapping.listen.port, host=mapping.listen.host))
            server.bound[name] = [_sockname(lst) for lst in listeners]
        for index, listener in enumerate(config.http):
            name = f"http:{listener.name or index}"
            front = HttpFront(table=functools.partial(server.tables.__getitem__, index),
                              open_upstream=server.open_upstream,
                              stats=server.http_stats.setdefault(name, HttpStats()))
            listeners = await nursery.start(front.run, listener.listen.host,
                                            listener.listen.port)
            server.bound[name] = [_sockname(lst) for lst in listeners]
        # The Ingress listeners: routes (and certificates) swap under them on every update.
        for name, listen, tls in (("ingress-http", config.ingress_http, None),
                                  ("ingress-https", config.ingress_https,
                                   TlsConfig(certs=server.ingress_certs))):
            if listen is None:
                continue
            front = HttpFront(table=lambda: server.ingress_table,
                              open_upstream=server.open_upstream, tls=tls,
                              stats=server.http_stats.setdefault(name, HttpStats()))
            listeners = await nursery.start(front.run, listen.host, listen.port)
            server.bound[name] = [_sockname(lst) for lst in listeners]
        debug = DebugServer(str(config.debug_socket), {
            "/status": server.status,
            "/config": lambda: server.config.model_dump(mode="json", exclude={"tokens"}),
        }, registry=server.metrics.registry)
        await nursery.start(debug.run)
        if config.metrics_listen is not None:
            health = HealthServer(server.metrics.registry, lambda: None)
            await nursery.start(health.run, config.metrics_listen.host,
                                config.metrics_listen.port)
        log.info("server ready", **{k: ",".join(v) for k, v in server.bound.items()})
        task_status.started(dict(server.bound))
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    if config_path is not None:
                        _reload_server(server, config_path)
                    continue
                log.info("shutting down: draining agents", signal=signal.Signals(signum).name,
                         grace_seconds=drain_seconds)
                await server.tunnel.drain("server shutting down", grace=drain_seconds)
                nursery.cancel_scope.cancel()
                break


def _reload_server(server: Server, config_path: Path) -> None:
    try:
        new = load_config(ServerConfig, config_path)
        server.apply_routes(new.routes())
    except ConfigError as exc:
        log.error("config reload refused; keeping the running config", error=str(exc))


def _sockname(listener: trio.SocketListener) -> str:
    host, port = listener.socket.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run_server(config_path: Path, *, check: bool = False, drain_seconds: float = 30.0) -> int:
    config = load_config(ServerConfig, config_path)
    ssl_context = server_ssl_context(config)
    server = Server(config)  # reads token files: errors surface before anything listens
    if check:
        print(f"{config_path}: valid. tunnel {config.tunnel.url}, {len(config.tokens)} "
              f"token(s), {len(config.tcp)} TCP mapping(s), {len(config.http)} HTTP "
              f"listener(s)")
        return 0
    trio.run(lambda: serve_server(server, ssl_context, drain_seconds=drain_seconds,
                                  config_path=config_path))
    return 0


async def serve_agent(agent: Agent, config_path: Path | None = None, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.run)
        debug = DebugServer(str(agent.config.debug_socket), {
            "/status": agent.status,
            "/config": lambda: agent.node_config.model_dump(mode="json"),
            "/rules": agent.rules,
        }, registry=agent.metrics.registry)
        await nursery.start(debug.run)
        if agent.config.metrics_listen is not None:
            def ready() -> str | None:
                state = agent.client.status.state
                return None if state == "connected" else f"tunnel {state}"
            health = HealthServer(agent.metrics.registry, ready)
            await nursery.start(health.run, agent.config.metrics_listen.host,
                                agent.config.metrics_listen.port)
        task_status.started()
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP and config_path is not None:
                    await _reload(agent, config_path)
                    continue
                log.info("shutting down", signal=signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


async def _reload(agent: Agent, config_path: Path) -> None:
    try:
        new = load_config(AgentConfig, config_path)
        if (new.node, new.server) != (agent.config.node, agent.config.server):
            log.warning("node and server cannot change on reload; restart the agent for that")
        await agent.apply_node_config(new.node_config())
    except (ConfigError, NetfilterError) as exc:
        log.error("config reload refused; keeping the running config", error=str(exc))


def run_agent(config_path: Path, *, check: bool = False) -> int:
    config = load_config(AgentConfig, config_path)
    ssl_context = agent_ssl_context(config)
    agent = Agent(config, ssl_context=ssl_context)
    if check:
        print(f"{config_path}: valid. node {config.node}, server {config.server}, "
              f"{len(config.allow)} allow rule(s)")
        return 0
    trio.run(lambda: serve_agent(agent, config_path))
    return 0
