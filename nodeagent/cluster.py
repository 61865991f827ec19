"""Controller mode for the agent and the server: settings from flags, what to do from the
controller's config watch stream (instead of a file).

The agent opens its watch as a stream *through its tunnel* (edge nodes cannot reach the
cluster network directly; the server allows the controller's address as egress), and
applies each NodeConfig atomically (interception rules, allow list). The server watches
directly and applies each RoutesConfig (Ingress routes, certificates, egress, node CIDRs).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from nodeagent.agent import Agent
from nodeagent.config import (
    AgentConfig,
    ConfigError,
    NodeConfig,
    RoutesConfig,
    ServerConfig,
    parse_config,
)
from nodeagent.configwatch import WatchStatus, watch_config
from nodeagent.logs import get_logger
from nodeagent.run import agent_ssl_context, serve_agent, serve_server, server_ssl_context
from nodeagent.server import Server
from tunnel import protocol as p

log = get_logger("nodeagent.cluster")


def controller_address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"--controller {url!r}: use http://host:port")
    return parts.hostname, parts.port or 80


def _token_reader(path: Path) -> Callable[[], str]:
    """Reads the token file at each (re)connect: a rotated Secret takes effect."""
    def read() -> str:
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {path}: {exc.strerror}") from None
    read()  # fail at start, not at the first watch
    return read


def agent_config_from_flags(args: argparse.Namespace) -> AgentConfig:
    node = args.node or os.environ.get("NODE_NAME")
    missing = [flag for flag, value in (("--node (or NODE_NAME)", node),
                                        ("--server", args.server),
                                        ("--token-file", args.token_file),
                                        ("--controller", args.controller)) if not value]
    if missing:
        raise ConfigError(f"controller mode needs {', '.join(missing)} (or use --config FILE)")
    controller_address(args.controller)
    doc: dict[str, Any] = {"node": node, "server": args.server,
                           "token_file": str(args.token_file), "controller": args.controller,
                           "tls": {"ca_file": str(args.ca_file)} if args.ca_file else {}}
    if args.debug_socket:
        doc["debug_socket"] = str(args.debug_socket)
    if args.metrics_listen:
        doc["metrics_listen"] = args.metrics_listen
    return parse_config(AgentConfig, doc, "flags")


def server_config_from_flags(args: argparse.Namespace) -> ServerConfig:
    missing = [flag for flag, value in (("--token-file", args.token_file),
                                        ("--controller", args.controller)) if not value]
    if missing:
        raise ConfigError(f"controller mode needs {', '.join(missing)} (or use --config FILE)")
    controller_address(args.controller)
    doc: dict[str, Any] = {
        "server_id": args.server_id or os.environ.get("POD_NAME") or "nodeagent-server",
        "tunnel": args.tunnel_listen, "controller": args.controller,
        "tokens": [{"node": "*", "token_file": str(args.token_file)}]}
    if args.tls_cert or args.tls_key:
        doc["tls"] = {"cert_file": str(args.tls_cert), "key_file": str(args.tls_key)}
    for key in ("ingress_http", "ingress_https", "metrics_listen", "debug_socket"):
        value = getattr(args, key, None)
        if value:
            doc[key] = str(value)
    return parse_config(ServerConfig, doc, "flags")


def run_agent_cluster(args: argparse.Namespace) -> int:
    config = agent_config_from_flags(args)
    assert config.controller is not None and config.token_file is not None
    host, port = controller_address(config.controller)
    token = _token_reader(config.token_file)
    agent = Agent(config, ssl_context=agent_ssl_context(config))
    status = WatchStatus(config.controller)
    agent.config_watch = status

    async def open_stream() -> trio.abc.Stream:
        stream: trio.abc.Stream = await agent.client.open_stream(p.Target(host, port))
        return stream

    async def apply(node_config: NodeConfig) -> None:
        await agent.apply_node_config(node_config)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: watch_config(
                open_stream=open_stream, host=f"{host}:{port}",
                path=f"/v1/config/nodes/{config.node}", token=token, model=NodeConfig,
                apply=apply, status=status, log=log.bind(node=config.node)))
            await serve_agent(agent)  # returns on SIGTERM/SIGINT
            nursery.cancel_scope.cancel()

    trio.run(main)
    return 0


def run_server_cluster(args: argparse.Namespace) -> int:
    config = server_config_from_flags(args)
    assert config.controller is not None
    host, port = controller_address(config.controller)
    token = _token_reader(Path(str(args.token_file)))
    ssl_context = server_ssl_context(config)
    server = Server(config)
    status = WatchStatus(config.controller)
    server.config_watch = status

    async def open_stream() -> trio.abc.Stream:
        return await trio.open_tcp_stream(host, port)

    async def apply(routes: RoutesConfig) -> None:
        server.apply_routes(routes)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: watch_config(
                open_stream=open_stream, host=f"{host}:{port}",
                path=f"/v1/config/servers/{config.server_id}", token=token,
                model=RoutesConfig, apply=apply, status=status,
                log=log.bind(server=config.server_id)))
            await serve_server(server, ssl_context)  # returns on SIGTERM/SIGINT
            nursery.cancel_scope.cancel()

    trio.run(main)
    return 0
