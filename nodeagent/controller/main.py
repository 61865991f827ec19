"""`nodeagent controller` from its command-line arguments."""

from __future__ import annotations

import argparse
import os
import signal
import socket

import trio
from pydantic import ValidationError

from nodeagent.config import ConfigError, ListenAddress
from nodeagent.controller.configserver import ConnectionLimits
from nodeagent.controller.controller import ControllerSettings, serve_controller
from nodeagent.controller.sleeper import SleeperSettings
from nodeagent.kube import CredentialsError
from nodeagent.ops.logs import get_logger
from nodeagent.runtime.failures import sole_failure

log = get_logger("nodeagent.controller")


def _listen_flag(flag: str, value: str) -> ListenAddress:
    try:
        return ListenAddress.model_validate(value)
    except ValidationError as exc:
        # One line: pydantic's own text is several, with its type names and a URL.
        problems = "; ".join(str(err["msg"]).removeprefix("Value error, ")
                             for err in exc.errors())
        raise ConfigError(f"{flag} {value!r}: {problems}") from None


def run_controller(args: argparse.Namespace) -> int:
    listen = _listen_flag("--listen", args.listen)
    metrics = None
    if args.metrics_listen:
        address = _listen_flag("--metrics-listen", args.metrics_listen)
        metrics = (address.host, address.port)
    if not 0 < args.certificate_hours <= 24 * 30:
        raise ConfigError(f"--certificate-hours {args.certificate_hours:g}: give (0, 720]")
    if not 0 < args.token_reviews_per_second <= 10_000:
        raise ConfigError(f"--token-reviews-per-second {args.token_reviews_per_second:g}: "
                          f"give (0, 10000]")
    heartbeat = getattr(args, "heartbeat_seconds", 60.0)
    if not 1 <= heartbeat <= 600:
        raise ConfigError(f"--heartbeat-seconds {heartbeat:g}: give 1-600")
    server_workers = getattr(args, "server_workers", 1)
    if not 1 <= server_workers <= 16:
        raise ConfigError(f"--server-workers {server_workers}: give 1-16 (the servers' "
                          f"--workers)")
    limits = ConnectionLimits(
        max_connections=getattr(args, "max_connections", 20_000),
        max_anonymous_per_peer=getattr(args, "max_anonymous_per_peer", 256),
        anonymous_deadline=getattr(args, "anonymous_deadline_seconds", 5.0))
    if not 1 <= limits.max_connections <= 1_000_000:
        raise ConfigError(f"--max-connections {limits.max_connections}: give 1-1000000")
    if not 1 <= limits.max_anonymous_per_peer <= limits.max_connections:
        raise ConfigError(f"--max-anonymous-per-peer {limits.max_anonymous_per_peer}: give "
                          f"1 to --max-connections")
    if not 0.5 <= limits.anonymous_deadline <= 60:
        raise ConfigError(f"--anonymous-deadline-seconds {limits.anonymous_deadline:g}: "
                          f"give 0.5-60")
    min_awake = getattr(args, "min_awake_seconds", 60.0)
    if not 0 <= min_awake <= 86400:
        raise ConfigError(f"--min-awake-seconds {min_awake:g}: give 0-86400")
    activity_interval = getattr(args, "activity_interval_seconds", 10.0)
    if not 0.1 <= activity_interval <= 3600:
        raise ConfigError(f"--activity-interval-seconds {activity_interval:g}: give 0.1-3600")
    identity = args.identity or os.environ.get("POD_NAME") or socket.gethostname()
    settings = ControllerSettings(
        namespace=args.namespace, identity=identity, listen_host=listen.host,
        listen_port=listen.port, lease_name=args.lease_name, kubeconfig=args.kubeconfig,
        lease_duration=args.lease_seconds, metrics_listen=metrics,
        tls_names=tuple(getattr(args, "tls_name", None) or ()),
        certificate_validity=args.certificate_hours * 3600.0,
        token_review_rate=args.token_reviews_per_second, freeze_gc=True,
        server_workers=server_workers, heartbeat=heartbeat, connection_limits=limits,
        sleeper=SleeperSettings(min_awake=min_awake, activity_interval=activity_interval))
    try:
        trio.run(_serve_until_signalled, settings)
    except CredentialsError as exc:
        raise ConfigError(f"Kubernetes credentials: {exc}") from None
    except BaseExceptionGroup as group:
        # Raised inside the controller's nurseries, it arrives wrapped in their groups.
        credentials = sole_failure(group, CredentialsError)
        if credentials is None:
            raise
        raise ConfigError(f"Kubernetes credentials: {credentials}") from None
    return 0


async def _serve_until_signalled(settings: ControllerSettings) -> None:
    """SIGTERM or SIGINT stops the controller: cancelling it releases the leader Lease on
    the way out (kube/leader.py), so a standby takes over at once rather than after the
    lease runs out. The controller holds no state to drain: its watchers reconnect to
    another replica."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_controller, settings)
            async for signum in signals:
                log.info("shutting down", signal=signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
