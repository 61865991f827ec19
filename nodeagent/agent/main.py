"""Entry point of the agent role: from a config file (`nodeagent agent --config`), or
from flags with the controller's config watch stream (controller mode).

Both run the same Agent in one nursery with its debug socket and health listener, and stop
gracefully on SIGTERM/SIGINT; SIGHUP re-reads a config file. In controller mode the agent
opens its watch as a stream *through its tunnel* (edge nodes cannot reach the cluster
network directly; the server allows the controller's address as egress) and applies each
NodeConfig atomically (interception rules, allow list).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from netfilter.model import NetfilterError
from netfilter.sockets import set_mark
from nodeagent.agent.agent import Agent
from nodeagent.config import (
    AgentConfig,
    ConfigError,
    ConfigProblems,
    NodeConfig,
    StartupFailed,
    load_config,
    parse_config,
    redacted,
)
from nodeagent.configstream.client import (
    controller_address,
    read_ca_file,
    token_reader,
)
from nodeagent.ops.debug import DebugServer
from nodeagent.ops.health import HealthServer
from nodeagent.ops.listener import Listener, Listeners
from nodeagent.ops.logs import get_logger
from nodeagent.runtime.malloctune import trim_forever
from nodeagent.trust.filewatch import FileReloader
from nodeagent.trust.tlscontext import TlsInputError, client_ssl_context
from tunnel import protocol as p

log = get_logger("nodeagent.agent")


# Which setting named each TLS input (TlsInputError.which), in a file and as flags.
TLS_FIELDS = {"ca": "tls.ca_file", "cert": "tls.cert_file", "key": "tls.key_file",
              "pair": "tls.cert_file, tls.key_file"}
TLS_FLAGS = {"ca": "--ca-file"}


def agent_ssl_context(config: AgentConfig, source: str = "config",
                      fields: dict[str, str] = TLS_FIELDS) -> ssl.SSLContext | None:
    """The tunnel's TLS context; a file that cannot be used is a ConfigError naming the
    config `source`, the field and the problem ("agent.yaml: tls.ca_file: /ca: no such
    file")."""
    if not config.server.startswith(("tls://", "wss://")):
        return None
    try:
        ctx = client_ssl_context(config.tls.ca_file, config.tls.cert_file,
                                     config.tls.key_file)
    except TlsInputError as exc:
        raise ConfigError(f"{source}: {fields[exc.which]}: {exc}") from None
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{source}: tls: cannot load CA, certificate or key: {exc}") from None
    if config.tls.insecure_skip_verify:
        log.warning("tls.insecure_skip_verify is set: the server's identity is NOT checked")
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def agent_listeners(agent: Agent) -> list[Listener]:
    """The agent's own listeners: the debug socket, and the health listener if asked for.
    (Its interception listeners follow the node's config: the Agent runs those.)"""

    def ready() -> str | None:
        state = agent.client.status.state
        return None if state == "connected" else f"tunnel {state}"

    listeners: list[Listener] = [DebugServer(str(agent.config.debug_socket), {
        "/status": agent.status,
        "/config": lambda: redacted(agent.node_config.model_dump(mode="json")),
        "/rules": agent.rules,
        "/tunnels": agent.tunnels,
        "/streams": agent.streams,
        "/flows": agent.flows,
    }, registry=agent.metrics.registry).for_setting("debug_socket", agent.config.debug_socket)]
    if agent.config.metrics_listen is not None:
        listeners.append(HealthServer(agent.metrics.registry, ready,
                                      host=agent.config.metrics_listen.host,
                                      port=agent.config.metrics_listen.port)
                         .for_setting("metrics_listen", agent.config.metrics_listen))
    return listeners


async def serve_agent(agent: Agent, config_path: Path | None = None, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.run)
        nursery.start_soon(trim_forever)  # malloctune.py: RSS back soon after load
        await Listeners(agent_listeners(agent)).start_all(nursery)
        task_status.started()
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP and config_path is not None:
                    await _reload(agent, config_path)
                    continue
                log.info("shutting down", signal=signal.Signals(signum).name,
                         drain_seconds=agent.config.drain_seconds)
                # A second signal during the drain ends it at once. Its watcher runs in a
                # nursery of the drain's own, so it has ended before the receiver's block
                # closes (an idle agent's drain returns at once).
                with trio.move_on_after(agent.config.drain_seconds):
                    async with trio.open_nursery() as drain:
                        drain.start_soon(_cancel_on_next_signal, signals, drain.cancel_scope)
                        await agent.drain()
                        drain.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
                break


async def _cancel_on_next_signal(signals: Any, scope: trio.CancelScope) -> None:
    async for signum in signals:
        if signum != signal.SIGHUP:
            log.info("second signal: not waiting for the drain",
                     signal=signal.Signals(signum).name)
            scope.cancel()
            return


async def _reload(agent: Agent, config_path: Path) -> None:
    try:
        new = load_config(AgentConfig, config_path)
        if (new.node, new.server) != (agent.config.node, agent.config.server):
            log.warning("node and server cannot change on reload; restart the agent for that")
        await agent.apply_node_config(new.node_config())
    except (ConfigError, NetfilterError) as exc:
        log.error("config reload refused; keeping the running config", error=str(exc))


def tls_files(config: AgentConfig) -> list[Path]:
    return [f for f in (config.tls.ca_file, config.tls.cert_file, config.tls.key_file)
            if f is not None]


async def serve_agent_reloading(agent: Agent, config_path: Path) -> None:
    """serve_agent, with the tunnel's CA, certificate and key files reloaded when they
    change: the next connection uses them; the running one is not dropped."""
    config = agent.config

    def swap(context: ssl.SSLContext | None) -> None:
        agent.client.ssl_context = context

    async with trio.open_nursery() as nursery:
        if config.server.startswith(("tls://", "wss://")) and tls_files(config):
            reloader = FileReloader(
                "tunnel certificate", tls_files(config), load=functools.partial(
                    agent_ssl_context, config, str(config_path)), apply=swap, log=agent.log)
            nursery.start_soon(reloader.run)
        await serve_agent(agent, config_path)
        nursery.cancel_scope.cancel()


def run_cleanup() -> int:
    """`nodeagent agent --cleanup`: what an agent left in the kernel, removed."""
    from nodeagent.agent.intercept.rules import remove_all
    try:
        removed = remove_all()
    except (NetfilterError, OSError) as exc:
        print(f"nodeagent agent --cleanup: {exc}", file=sys.stderr)
        return 1
    print("removed: " + ", ".join(removed) if removed else "nothing to remove")
    return 0


def check_socket_mark(mark: int) -> None:
    """The agent marks every socket it opens (its netfilter rules skip that mark, so it
    never intercepts itself): without CAP_NET_ADMIN every dial would fail, so say so once
    at start instead of retrying for ever."""
    import socket

    with socket.socket() as probe:
        try:
            set_mark(probe, mark)
        except PermissionError:
            raise StartupFailed(
                "socket_mark", f"cannot mark the agent's sockets with {mark:#x} (SO_MARK "
                "needs CAP_NET_ADMIN): run the agent as root or with CAP_NET_ADMIN, as the "
                "DaemonSet does (capabilities: add: [NET_ADMIN])") from None


# What to do when the host lacks the netfilter tools interception needs.
NETFILTER_HINT = ("install the nftables package on the node (iptables on a host whose "
                  "kube-proxy uses legacy iptables), or drop the intercept section")


def run_agent(config_path: Path, *, check: bool = False) -> int:
    config = load_config(AgentConfig, config_path)
    problems = ConfigProblems()  # the TLS files and the token file, both reported
    ssl_context = None
    with problems.check():
        ssl_context = agent_ssl_context(config, str(config_path))
    with problems.check():
        try:
            config.read_token()
        except ConfigError as exc:  # token_file: unreadable, too short, not ASCII
            raise ConfigError(f"{config_path}: token_file: {exc}") from None
    problems.raise_any()
    try:
        agent = Agent(config, ssl_context=ssl_context)
    except NetfilterError as exc:  # interception asked for, and this host cannot do it
        print(f"nodeagent agent: {config_path}: intercept: {exc}; {NETFILTER_HINT}",
              file=sys.stderr)
        return 1
    if check:
        print(f"{config_path}: valid. node {config.node}, server {config.server}, "
              f"{len(config.allow)} allow rule(s), {agent.client.proxy.describe()}")
        return 0
    check_socket_mark(config.socket_mark)
    trio.run(serve_agent_reloading, agent, config_path)
    return 0


def agent_config_from_flags(args: argparse.Namespace) -> AgentConfig:
    node = args.node or os.environ.get("NODE_NAME")
    missing = [flag for flag, value in (("--node (or NODE_NAME)", node),
                                        ("--server", args.server),
                                        ("--token-file", args.token_file),
                                        ("--ca-file", args.ca_file),
                                        ("--controller", args.controller)) if not value]
    if missing:
        raise ConfigError(f"controller mode needs {', '.join(missing)} (or use --config FILE)")
    controller_address(args.controller)
    # The token file is the projected ServiceAccount token: it goes to the controller
    # only (for the node's certificate), never to the server as a tunnel credential.
    doc: dict[str, Any] = {"node": node, "server": args.server,
                           "identity_token_file": str(args.token_file),
                           "controller": args.controller, "tls": {"ca_file": str(args.ca_file)}}
    if args.debug_socket:
        doc["debug_socket"] = str(args.debug_socket)
    if args.metrics_listen:
        doc["metrics_listen"] = args.metrics_listen
    if args.drain_seconds is not None:
        doc["drain_seconds"] = args.drain_seconds
    if args.keep_rules_on_exit:
        doc["keep_rules_on_exit"] = True
    return parse_config(AgentConfig, doc, "flags")


@dataclass
class _Trust:
    pem: bytes  # the --ca-file bundle
    server: ssl.SSLContext | None  # verifies the tunnel server with it


def run_agent_cluster(args: argparse.Namespace) -> int:
    # Controller mode only: the node certificate (a key, a CSR: cryptography). An agent
    # started from a file never imports these (tests/test_imports.py).
    from nodeagent.agent.nodecert import node_certificate_requester
    from nodeagent.configstream.cluster import ControllerLink
    from nodeagent.trust.enrollment import IssuedIdentity, Requester

    config = agent_config_from_flags(args)
    assert config.controller is not None and config.identity_token_file is not None
    assert config.tls.ca_file is not None
    ca_file = config.tls.ca_file
    # The --ca-file bundle: it verifies the tunnel server and the controller, and is
    # re-read when it changes (CA rotation: a bundle of both CAs, then the new one alone).
    ca = _Trust(read_ca_file(ca_file), agent_ssl_context(config, "flags", TLS_FLAGS))
    agent = Agent(config, ssl_context=ca.server)
    if args.check:
        # The flags and the files they name are read; what to do is the controller's.
        token_reader(config.identity_token_file)
        print(f"flags: valid. node {config.node}, server {config.server}, controller "
              f"{config.controller} (allow rules come from it), "
              f"{agent.client.proxy.describe()}")
        return 0

    def tunnel_context() -> None:
        # The tunnel presents the node certificate from its next connection on.
        identity = link.keeper.identity
        if identity is not None:
            agent.client.ssl_context = client_ssl_context(
                ca.pem, identity.certificate_pem, identity.key_pem)

    def renewed(identity: IssuedIdentity) -> None:
        tunnel_context()

    def load_ca() -> tuple[bytes, ssl.SSLContext | None]:
        return read_ca_file(ca_file), agent_ssl_context(config, "flags", TLS_FLAGS)

    def ca_changed(loaded: tuple[bytes, ssl.SSLContext | None]) -> None:
        ca.pem, ca.server = loaded
        tunnel_context()

    async def open_stream() -> trio.abc.Stream:
        # The config watch: TLS to the controller end to end, inside the tunnel.
        target = p.Target(link.host, link.port)
        stream: trio.abc.Stream = await agent.open_stream(target)
        agent.stream_notes.note(stream, f"config watch to the controller {target.host}:"
                                        f"{target.port}")
        return stream

    def requester(link: ControllerLink) -> Requester:
        # Through the tunnel when it is up, else a bootstrap connection (nodecert.py).
        return node_certificate_requester(
            agent.client, node=config.node, controller=(link.host, link.port),
            token=link.token, ca_pem=lambda: ca.pem, server_ca=lambda: ca.server,
            current=lambda: link.keeper.identity)

    link = ControllerLink(kind="node", name=config.node, url=config.controller,
                          token=token_reader(config.identity_token_file),
                          ca_pem=lambda: ca.pem, open_stream=open_stream,
                          log=log.bind(node=config.node), requester=requester,
                          on_renewed=renewed)
    agent.identity = link.keeper
    agent.config_watch = link.status
    ca_reloader = FileReloader("CA bundle", [ca_file], load=load_ca, apply=ca_changed,
                               log=agent.log)

    async def link_until_drain(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                               ) -> None:
        # The watch is a stream of the agent's own: it ends when a drain begins, which
        # then waits only for the traffic the agent carries.
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run, NodeConfig, agent.apply_node_config)
            task_status.started()
            await agent.draining.wait()
            nursery.cancel_scope.cancel()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(link_until_drain)  # the first certificate is in
            nursery.start_soon(ca_reloader.run)
            await serve_agent(agent)  # returns on SIGTERM/SIGINT
            nursery.cancel_scope.cancel()

    check_socket_mark(config.socket_mark)
    trio.run(main)
    return 0
