"""The server's config from its controller-mode flags (the parent of --workers reads it
too, without loading the server itself)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from nodeagent.config import ConfigError, ServerConfig, parse_config
from nodeagent.configstream.client import controller_address


def server_config_from_flags(args: argparse.Namespace) -> ServerConfig:
    missing = [flag for flag, value in (("--token-file", args.token_file),
                                        ("--ca-file", args.ca_file),
                                        ("--tls-cert", args.tls_cert),
                                        ("--tls-key", args.tls_key),
                                        ("--controller", args.controller)) if not value]
    if missing:
        raise ConfigError(f"controller mode needs {', '.join(missing)} (or use --config FILE)")
    controller_address(args.controller)
    # No tokens: agents present the node certificates the controller signs (verified
    # against --ca-file); one without a certificate may only fetch one (bootstrap).
    doc: dict[str, Any] = {
        "server_id": args.server_id or os.environ.get("POD_NAME") or "nodeagent-server",
        "tunnel": args.tunnel_listen, "controller": args.controller,
        "tls": {"cert_file": str(args.tls_cert), "key_file": str(args.tls_key),
                "client_ca_file": str(args.ca_file)}}
    if args.max_connections_per_client is not None:
        # 0: no per-client cap (behind a load balancer that SNATs every client).
        doc["http_limits"] = {"max_connections_per_client":
                              args.max_connections_per_client or None}
    if args.handshake_rate is not None or args.handshake_burst is not None:
        doc["tunnel"] = {"url": args.tunnel_listen}
        if args.handshake_rate is not None:
            doc["tunnel"]["handshake_rate"] = args.handshake_rate
        if args.handshake_burst is not None:
            doc["tunnel"]["handshake_burst"] = args.handshake_burst
    if getattr(args, "proxy_protocol_from", None):
        doc["proxy_protocol_from"] = list(args.proxy_protocol_from)
    connect = connect_from_flags(args)
    if connect:
        doc["connect"] = connect
    for key in ("ingress_http", "ingress_https", "metrics_listen", "debug_socket",
                "load_balancer_host"):
        value = getattr(args, key, None)
        if value:
            doc[key] = str(value)
    return parse_config(ServerConfig, doc, "flags")


def connect_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The CONNECT front's settings from --connect-* flags (empty: off)."""
    doc: dict[str, Any] = {}
    if getattr(args, "connect_uds", None):
        try:
            mode = int(str(args.connect_uds_mode), 8)
        except ValueError:
            raise ConfigError(f"--connect-uds-mode: {args.connect_uds_mode!r} is not an "
                              f"octal mode (0600, 0660)") from None
        doc.update(uds=str(args.connect_uds), uds_mode=mode)
        if args.connect_uds_group is not None:
            doc["uds_group"] = args.connect_uds_group
    if getattr(args, "connect_listen", None):
        doc["listen"] = args.connect_listen
        if args.connect_client_ca is None:
            raise ConfigError("--connect-listen needs --connect-client-ca (only clients with "
                              "a certificate from that CA may use it)")
        doc["tls"] = {"client_ca_file": str(args.connect_client_ca)}
        subjects = getattr(args, "connect_allow_subject", None)
        organizations = getattr(args, "connect_allow_organization", None)
        if subjects or organizations:  # else the default: kube-apiserver's identity
            doc["tls"].update(allowed_subjects=subjects or [],
                              allowed_organizations=organizations or [])
    return doc
