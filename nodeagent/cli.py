"""The `nodeagent` command line: one program, one subcommand per role.

Exit codes: 0 success, 1 a runtime failure (the demo saw no traffic, a debug socket is not
there), 2 a usage or config error (nothing was started), 3 a setting this host cannot honour
at start (a port in use, a missing capability: StartupFailed; nothing was started).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, TypeAlias

from nodeagent import __version__
from nodeagent.config import ConfigError, StartupFailed

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_STARTUP = 0, 1, 2, 3

DESCRIPTION = """\
nodeagent connects Kubernetes nodes that sit behind NAT to a cloud side. Each node's
agent dials out and holds one multiplexed tunnel to the server; the server carries public
TCP ports and HTTP (by Host and path) through it to services on the node.

roles:
  nodeagent server --config server.yaml     the cloud side: terminates tunnels, routes traffic
  nodeagent agent --config agent.yaml       on each node: dials the server, serves streams
  nodeagent controller                      in a cluster: computes config from the Kubernetes API

tools:
  nodeagent certs ca|server|node|token      CA, certificates and tokens for standalone TLS
  nodeagent debug VIEW                      what a local agent or server is doing
  nodeagent demo                            server + agent + sample service on loopback
"""

EPILOG = """\
examples:
  nodeagent demo --seconds 5
  nodeagent server --config server.yaml --check   # the file and the files it names
  nodeagent debug status --socket /run/nodeagent/agent.sock --json

Config files are YAML: commented ones in examples/ (they name their certificates and
tokens under /etc/nodeagent/: `nodeagent certs` makes them); the README's standalone
quickstart goes from nothing to traffic.
"""


DEBUG_VIEWS = ("status", "tunnels", "streams", "flows", "config", "rules", "holds",
               "loadbalancers", "metrics")
DEBUG_DESCRIPTION = """\
Read the node-local debug socket of a running agent or server and print what it is doing.

views:
  status    everything at a glance: role, versions, tunnels, counters, config watch
  tunnels   each tunnel: agent: one row per server held or being dialed (server id,
            address, state, RTT, open streams, bytes, since when, last error); server: one
            row per node, connected ones then nodes whose tunnel ended lately and why
  streams   each stream now open: id, direction (to-node: the server opened it, for an
            Ingress, a TCP mapping or a CONNECT client; from-node: the agent did, for
            intercepted pod traffic or the controller), target, bytes toward the target
            and back, age, and who opened it (a UDP flow is a stream to a udp:// target)
  flows     server: each UDP mapping with its drops by reason, then each flow: client
            address, node, target, state, datagrams and bytes each way, idle time, age;
            agent: pods' intercepted UDP flows (client, original destination, rule, via)
  config    the config in use, with its version (secret values shown as [redacted])
  rules     interception rules as applied in the kernel, next to the model (agent)
  holds     requests held for sleeping routes (scale to zero), per Service: how many
            and for how long, and how held requests ended (server)
  loadbalancers  server: each LoadBalancer Service port: Service, protocol and port,
            state (listening, or failed and why), backends (node/address:port), and
            connections or flows taken and refused (no ready endpoints)
  metrics   Prometheus text
"""

DEBUG_EPILOG = """\
questions and the command that answers them:
  is node X connected, to which servers?    (server) nodeagent debug tunnels --node X
                                            (agent)  nodeagent debug tunnels
  what is node X doing?                     nodeagent debug streams --node X --watch
  why did that request fail?                nodeagent debug tunnels (LAST ERROR), then
                                            nodeagent debug status (streams_by_outcome)
                                            and the log lines of that node/target
examples:
  nodeagent debug tunnels --socket /run/nodeagent/server.sock --node edge-1
  nodeagent debug streams --watch 1
  nodeagent debug streams --json | jq '.streams[] | select(.target | test(":10250"))'
"""


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError("--watch takes 0.1 to 3600 seconds")
    return value


def _grace_seconds(text: str) -> float:
    """A server's shutdown and readiness durations: 0 to an hour (a negative one once
    passed as an immediate deadline)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text}: give 0 to 3600 seconds")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with exit code 2 and a one-line hint on errors (its default prints usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n"
                              f"run '{self.prog} --help' for usage\n")


# The subcommands of the `nodeagent` parser, to which each add_*_parser adds its own.
Subcommands: TypeAlias = "argparse._SubParsersAction[_Parser]"


def build_parser() -> argparse.ArgumentParser:
    """The `nodeagent` parser: global flags, then one subcommand per role and tool, each
    built by its own function below."""
    parser = _Parser(prog="nodeagent", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"nodeagent {__version__}")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="least severe log level to print (default: info)")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="log lines as key=value text or JSON objects (default: text)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in (add_server_parser, add_agent_parser, add_controller_parser,
                add_certs_parser, add_debug_parser, add_demo_parser):
        add(sub)
    for name in ("server", "agent", "controller", "demo"):
        _add_log_flags(sub.choices[name])
    return parser


def _add_log_flags(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format after a role too (`nodeagent server --log-level debug`
    was 'unrecognized arguments'). SUPPRESS: unless given here, the value before the
    command (or its default) stands."""
    group = parser.add_argument_group("logging (also accepted before the command)")
    group.add_argument("--log-level", default=argparse.SUPPRESS,
                       choices=["debug", "info", "warning", "error"],
                       help="least severe log level to print (default: info)")
    group.add_argument("--log-format", default=argparse.SUPPRESS, choices=["text", "json"],
                       help="log lines as key=value text or JSON objects (default: text)")


def add_server_parser(sub: Subcommands) -> None:
    """`nodeagent server`: standalone (--config) or controller mode (the flags)."""
    server = sub.add_parser(
        "server", help="run the cloud side",
        description="Terminate agents' tunnels and carry public TCP ports and HTTP routes "
                    "into them. Stops gracefully on SIGTERM/SIGINT: agents are told to move "
                    "(GOAWAY) and running streams get a grace period.")
    server.add_argument("--config", type=Path, metavar="FILE",
                        help="standalone mode: server config (YAML); see examples/server.yaml")
    cluster = server.add_argument_group(
        "controller mode (Kubernetes; instead of --config): routes come from the controller")
    _add_server_controller_flags(cluster)
    _note_controller_mode_flags(server, cluster)
    server.add_argument("--check", action="store_true",
                        help="validate, print a summary and exit: the --config file, or the "
                             "controller-mode flags, and the files they name")
    server.add_argument("--drain-seconds", type=_grace_seconds, default=30.0, metavar="S",
                        help="on shutdown, how long running streams may finish (default 30)")
    server.add_argument("--shutdown-delay", type=_grace_seconds, default=2.0, metavar="S",
                        help="on shutdown, how long readiness fails while requests are still "
                             "served, before agents are told to move (GOAWAY): at least the "
                             "load balancer's health-check interval (default 2)")
    server.add_argument("--ready-grace", type=_grace_seconds, default=30.0, metavar="S",
                        help="a new replica is ready once it holds a tunnel from every node "
                             "its routes name, or after this long (default 30)")
    server.add_argument("--workers", type=int, default=1, metavar="N",
                        help="worker processes (default 1; 2 uses both cores of a 2-core "
                             "host): each is a server of its own that every agent holds a "
                             "tunnel to, sharing the public ports (SO_REUSEPORT); a parent "
                             "restarts one that exits and serves --metrics-listen for all. "
                             "Ports must be fixed (no port 0)")
    # The parent starts each worker with the same arguments plus this (not for users).
    server.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    server.add_argument("--parent-fd", type=int, default=None, help=argparse.SUPPRESS)
    server.add_argument("--worker-restart", action="store_true", help=argparse.SUPPRESS)



def _note_controller_mode_flags(parser: argparse.ArgumentParser,
                                group: argparse._ArgumentGroup) -> None:
    """Remember the flags of the controller-mode group, so main() can refuse them beside
    --config rather than ignore them (a file sets those things itself)."""
    parser.set_defaults(controller_mode_flags=tuple(
        (action.dest, action.option_strings[0], action.default)
        for action in group._group_actions))


def _add_server_controller_flags(cluster: argparse._ArgumentGroup) -> None:
    cluster.add_argument("--controller", metavar="URL",
                         help="the controller, https://host:port (its config stream and the "
                              "certificate signer)")
    cluster.add_argument("--token-file", type=Path, metavar="PATH",
                         help="this pod's projected ServiceAccount token (audience "
                              "nodeagent): proves the replica to the controller, which signs "
                              "its certificate")
    cluster.add_argument("--tunnel-listen", default="wss://0.0.0.0:8443/tunnel", metavar="URL",
                         help="where agents dial in (default wss://0.0.0.0:8443/tunnel)")
    cluster.add_argument("--tls-cert", type=Path, metavar="FILE", help="tunnel certificate")
    cluster.add_argument("--tls-key", type=Path, metavar="FILE", help="its private key")
    cluster.add_argument("--ca-file", type=Path, metavar="PATH",
                         help="the cluster CA (ConfigMap nodeagent-ca): verifies the "
                              "controller and the agents' node certificates")
    cluster.add_argument("--max-connections-per-client", type=int, metavar="N",
                         help="HTTP connections one client address (IPv6: one /64) may hold "
                              "(default 256; 0: no cap — behind a load balancer that hides "
                              "client addresses)")
    cluster.add_argument("--proxy-protocol-from", action="append", metavar="CIDR",
                         help="a load balancer that sends PROXY v2 to the public listeners: "
                              "from its addresses a header is required and names the client "
                              "(repeatable; docs/proxy-protocol.md)")
    cluster.add_argument("--ingress-http", metavar="HOST:PORT",
                         help="Ingress over HTTP (default: none)")
    cluster.add_argument("--load-balancer-host", metavar="HOST",
                         help="where the ports of LoadBalancer Services listen (default "
                              "0.0.0.0; docs/loadbalancer.md)")
    cluster.add_argument("--ingress-https", metavar="HOST:PORT",
                         help="Ingress over HTTPS, certificates by SNI from Ingress TLS "
                              "(default: none)")
    cluster.add_argument("--connect-uds", type=Path, metavar="PATH",
                         help="CONNECT front for kube-apiserver's egress selector (transport."
                              "uds) and HTTP proxy clients, on a Unix socket (mode 0600)")
    cluster.add_argument("--connect-uds-mode", metavar="MODE", default="0600",
                         help="the socket's mode: 0600 or 0660 (default 0600)")
    cluster.add_argument("--connect-uds-group", type=int, metavar="GID",
                         help="the socket's group (with --connect-uds-mode 0660)")
    cluster.add_argument("--connect-listen", metavar="HOST:PORT",
                         help="CONNECT front over TCP with mutual TLS (transport.tcp); needs "
                              "--connect-client-ca; serves the --tls-cert certificate")
    cluster.add_argument("--connect-client-ca", type=Path, metavar="FILE",
                         help="CA whose client certificates the --connect-listen front "
                              "accepts (kube-apiserver's egress client certificate)")
    cluster.add_argument("--connect-allow-subject", action="append", metavar="CN",
                         help="a client certificate CN the --connect-listen front accepts "
                              "(repeatable; default kube-apiserver-kubelet-client, "
                              "kube-apiserver's egress client; '*': any of the CA's)")
    cluster.add_argument("--connect-allow-organization", action="append", metavar="O",
                         help="a client certificate O the --connect-listen front accepts "
                              "(repeatable; default none)")
    cluster.add_argument("--handshake-rate", type=float, metavar="PER_S",
                         help="agent handshakes admitted per second (default 200); beyond it "
                              "agents are refused with a retry-after and come back spread out")
    cluster.add_argument("--handshake-burst", type=int, metavar="N",
                         help="handshakes admitted at once before the rate applies "
                              "(default 200)")
    cluster.add_argument("--server-id", metavar="NAME",
                         help="this replica, as agents tell replicas apart (default: $POD_NAME, "
                              "else nodeagent-server)")
    cluster.add_argument("--state-dir", type=Path, metavar="DIR",
                         help="keep the last routes here (routes.json, mode 0600: it holds "
                              "Ingress TLS keys) and serve them at once after a restart "
                              "while the controller is away (an emptyDir)")
    cluster.add_argument("--metrics-listen", metavar="HOST:PORT",
                         help="Prometheus /metrics, /healthz and /readyz (default: none)")
    cluster.add_argument("--debug-socket", type=Path, metavar="PATH",
                         help="debug socket (default /run/nodeagent/server.sock)")


def add_agent_parser(sub: Subcommands) -> None:
    """`nodeagent agent`: standalone (--config) or controller mode (the flags)."""
    agent = sub.add_parser(
        "agent", help="run on a node",
        description="Dial the server, keep a tunnel to it up (one to each replica), and "
                    "serve the streams the server opens by dialing allowed node-local "
                    "targets. Reconnects: about every "
                    "second while the server is unreachable (reconnect.unreachable_maximum, "
                    "default 1 s), when a busy server says (its retry-after, with jitter), "
                    "and slowing to reconnect.maximum (default 15 s) after a refused "
                    "handshake; at once when the server drains (GOAWAY). "
                    "SIGHUP re-reads the config file; an invalid new config is refused and the "
                    "running one kept.")
    agent.add_argument("--config", type=Path, metavar="FILE",
                       help="standalone mode: agent config (YAML); see examples/agent.yaml")
    cluster = agent.add_argument_group(
        "controller mode (Kubernetes; instead of --config): what to do comes from the "
        "controller, reached through the tunnel")
    cluster.add_argument("--node", metavar="NAME", help="this node (default: $NODE_NAME)")
    cluster.add_argument("--server", metavar="URL", help="tunnel URL, wss://host:port/path")
    cluster.add_argument("--token-file", type=Path, metavar="PATH",
                         help="this pod's projected ServiceAccount token (audience nodeagent):"
                              " sent only to the controller, inside TLS end to end, which "
                              "signs this node's certificate for it")
    cluster.add_argument("--ca-file", type=Path, metavar="PATH",
                         help="the cluster CA (ConfigMap nodeagent-ca): verifies the server "
                              "and the controller")
    cluster.add_argument("--controller", metavar="URL",
                         help="the controller, https://host:port (reached through the tunnel)")
    cluster.add_argument("--debug-socket", type=Path, metavar="PATH",
                         help="debug socket (default /run/nodeagent/agent.sock)")
    cluster.add_argument("--metrics-listen", metavar="HOST:PORT",
                         help="Prometheus /metrics, /healthz and /readyz (default: none)")
    cluster.add_argument("--drain-seconds", type=float, default=None, metavar="S",
                         help="on SIGTERM, how long intercepted connections and streams in "
                              "flight may finish before the agent exits (default 10)")
    cluster.add_argument("--keep-rules-on-exit", action="store_true",
                         help="leave the interception rules in the kernel on exit, for the "
                              "next agent (a DaemonSet restart): meanwhile intercepted "
                              "connections are refused (REDIRECT) or wait in SYN "
                              "retransmission (TPROXY) instead of bypassing the tunnel")
    _note_controller_mode_flags(agent, cluster)
    agent.add_argument("--check", action="store_true",
                       help="validate, print a summary and exit: the --config file, or the "
                            "controller-mode flags, and the files they name")
    agent.add_argument("--cleanup", action="store_true",
                       help="remove the interception rules and policy routing an agent left "
                            "in this host's kernel, then exit (after uninstalling, like "
                            "kube-proxy --cleanup)")



def add_controller_parser(sub: Subcommands) -> None:
    """`nodeagent controller`."""
    controller = sub.add_parser(
        "controller", help="run the cluster controller (Kubernetes)",
        description="Watch the Kubernetes API (Nodes, Services, EndpointSlices, Ingresses, "
                    "IngressClasses, Secrets, ClusterTunnels), compute every node's and the "
                    "servers' config, and serve it as a watch stream over TLS, with the "
                    "certificates agents and servers read it with. Replicas elect a leader "
                    "with a Lease; only the leader writes (CRDs, Events, the CA).")
    controller.add_argument("--kubeconfig", type=Path, metavar="FILE",
                            help="credentials for the Kubernetes API (default: the pod's service "
                                 "account in a cluster, else ~/.kube/config)")
    controller.add_argument("--namespace", default="nodeagent", metavar="NAMESPACE",
                            help="namespace of the Lease and Secrets (default nodeagent)")
    controller.add_argument("--listen", default="0.0.0.0:8090", metavar="HOST:PORT",
                            help="config stream (TLS) listener (default 0.0.0.0:8090)")
    controller.add_argument("--tls-name", action="append", metavar="NAME|IP",
                            help="also name this in the config stream's certificate, besides "
                                 "the nodeagent-controller Service names (repeatable)")
    controller.add_argument("--identity", default=None, metavar="NAME",
                            help="this replica in the Lease (default: $POD_NAME or hostname)")
    controller.add_argument("--lease-name", default="nodeagent-controller", metavar="NAME",
                            help="the Lease the replicas elect a leader with, in --namespace "
                                 "(default nodeagent-controller)")
    controller.add_argument("--lease-seconds", type=float, default=15.0, metavar="S",
                            help="lease duration: a standby takes over within it (default 15)")
    controller.add_argument("--certificate-hours", type=float, default=24.0, metavar="H",
                            help="validity of the node and server certificates it signs; "
                                 "they renew at half-life (default 24)")
    controller.add_argument("--token-reviews-per-second", type=float, default=20.0,
                            metavar="N", help="TokenReviews the certificate endpoint may "
                            "cause a second (bursts of 2.5x); beyond: 429 (default 20)")
    controller.add_argument("--metrics-listen", metavar="HOST:PORT",
                            help="/metrics, /healthz and /readyz for probes (default: none)")
    controller.add_argument("--heartbeat-seconds", type=float, default=60.0, metavar="S",
                            help="a config watch with nothing new gets a heartbeat line this "
                                 "often; watchers give up after 3 missed (the interval is "
                                 "announced to them). Each costs a TLS write per watch: "
                                 "~0.5 %% of a core at 5,000 nodes and 60 s. A dead peer's "
                                 "TCP keepalive notices sooner (default 60)")
    controller.add_argument("--server-workers", type=int, default=1, metavar="N",
                            help="worker processes per server pod (set it to the servers' "
                                 "--workers): each agent holds a tunnel to ready server "
                                 "pods x N (default 1)")
    controller.add_argument("--max-connections", type=int, default=20_000, metavar="N",
                            help="config stream connections open at once, in all (also "
                                 "kept under the file limit); beyond, a new one is closed at "
                                 "once (default 20000)")
    controller.add_argument("--max-anonymous-per-peer", type=int, default=256, metavar="N",
                            help="connections from one address (IPv6: one /64) that have "
                                 "not proved an identity (in the TLS handshake, or without a "
                                 "client certificate); agents come through the servers' "
                                 "addresses, so those with a certificate are not capped per "
                                 "address (default 256)")
    controller.add_argument("--anonymous-deadline-seconds", type=float, default=5.0,
                            metavar="S", help="a connection must finish its TLS handshake "
                            "within this, and one without a client certificate must also "
                            "have sent its request (default 5)")
    controller.add_argument("--min-awake-seconds", type=float, default=60.0, metavar="S",
                            help="scale to zero: a woken workload stays up at least this "
                            "long, whatever its idle-after (default 60)")
    controller.add_argument("--activity-interval-seconds", type=float, default=10.0,
                            metavar="S", help="scale to zero: how often servers report "
                            "their sleepable routes' activity (default 10)")



CERTS_DESCRIPTION = """\
Make the files standalone TLS needs, in the current directory (--dir elsewhere). Keys and
tokens are written mode 0600, certificates 0644; an existing file is never replaced
without --force.

  1. nodeagent certs ca                             ca.crt, ca.key (keep ca.key here)
  2. nodeagent certs server --name HOST [--ip IP]   server.crt, server.key for the names
                                                    and addresses agents dial
  3. either a token per node (simplest):
     nodeagent certs token NODE                     NODE.token, for the server and the node
     or a client certificate per node (mutual TLS):
     nodeagent certs node NODE                      NODE.crt, NODE.key for the node

The server uses server.crt/server.key (tls.cert_file, tls.key_file) and, for mutual TLS,
ca.crt as tls.client_ca_file; agents use ca.crt as tls.ca_file. A node certificate names
its node only in its URI SAN nodeagent://node/NODE (with clientAuth usage), which is what
the server reads; the CN is for people.
"""

CERTS_EPILOG = """\
examples:
  nodeagent certs ca --dir /etc/nodeagent/pki
  nodeagent certs server --dir /etc/nodeagent/pki --name tunnel.example.com --ip 203.0.113.7
  nodeagent certs node edge-1 --days 90
  nodeagent certs token edge-2
"""


def add_certs_parser(sub: Subcommands) -> None:
    """`nodeagent certs ca|server|node|token`: files for standalone TLS (trust/certfiles)."""
    certs = sub.add_parser(
        "certs", help="make a CA, server and node certificates, and tokens",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=CERTS_DESCRIPTION, epilog=CERTS_EPILOG)
    kinds = certs.add_subparsers(dest="kind", metavar="KIND", parser_class=_Parser)
    kinds.required = True

    def common(parser: argparse.ArgumentParser, *, days: float | None,
               dir_help: str = "where to write (and find ca.crt, ca.key); default: here",
               force_help: str = "replace files that exist") -> None:
        parser.add_argument("--dir", type=Path, default=Path("."), metavar="DIR",
                            help=dir_help)
        parser.add_argument("--force", action="store_true", help=force_help)
        if days is not None:
            parser.add_argument("--days", type=float, default=days, metavar="N",
                                help=f"validity in days (default {days:g})")

    def signed_by(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--ca", type=Path, metavar="FILE",
                            help="the CA certificate (default DIR/ca.crt)")
        parser.add_argument("--ca-key", type=Path, metavar="FILE",
                            help="its key (default DIR/ca.key)")

    ca = kinds.add_parser("ca", help="a CA: ca.crt and ca.key",
                          description="A CA that signs the server's and the nodes' "
                                      "certificates: ca.crt and ca.key (mode 0600).")
    ca.add_argument("--name", default="nodeagent CA", metavar="CN",
                    help="the CA's common name (default 'nodeagent CA')")
    common(ca, days=3650, dir_help="where to write; default: here",
           force_help="replace files that exist (a new CA key makes every certificate of "
                      "the old one useless)")
    server = kinds.add_parser(
        "server", help="the tunnel server's certificate",
        description="The tunnel server's certificate (serverAuth) for every name and "
                    "address agents dial: server.crt, server.key (mode 0600).")
    server.add_argument("--name", action="append", default=[], metavar="HOST",
                        help="a DNS name agents dial (repeatable; *.domain for a wildcard)")
    server.add_argument("--ip", action="append", default=[], metavar="ADDRESS",
                        help="an IP address agents dial (repeatable)")
    server.add_argument("--out", default="server", metavar="NAME",
                        help="file names NAME.crt, NAME.key (default server)")
    signed_by(server)
    common(server, days=365)
    node = kinds.add_parser(
        "node", help="a node's client certificate (mutual TLS)",
        description="A node's client certificate for mutual TLS: URI SAN "
                    "nodeagent://node/NODE and clientAuth, which the server checks (the "
                    "HELLO's node must match it): NODE.crt, NODE.key (mode 0600).")
    node.add_argument("node", metavar="NODE", help="the node's name (a lower-case DNS name)")
    signed_by(node)
    common(node, days=365)
    token = kinds.add_parser(
        "token", help="a random token for a node",
        description="A random token (128 bits as 32 hex characters) for one node: "
                    "NODE.token (mode 0600); '*' makes shared.token, a token any node may "
                    "present (a lab convenience).")
    token.add_argument("node", metavar="NODE", help="the node the token registers")
    common(token, days=None, dir_help="where to write; default: here")


def run_certs(args: argparse.Namespace) -> int:
    from nodeagent.trust import certfiles

    try:
        if args.kind == "ca":
            written = certfiles.make_ca(args.dir, name=args.name, days=args.days,
                                        force=args.force)
        elif args.kind == "server":
            written = certfiles.make_server(args.dir, names=args.name, ips=args.ip,
                                            out=args.out, ca_cert=args.ca,
                                            ca_key=args.ca_key, days=args.days,
                                            force=args.force)
        elif args.kind == "node":
            written = certfiles.make_node(args.dir, args.node, ca_cert=args.ca,
                                          ca_key=args.ca_key, days=args.days,
                                          force=args.force)
        else:
            written = certfiles.make_token(args.dir, args.node, force=args.force)
    except certfiles.CertFilesError as exc:
        print(f"nodeagent certs {args.kind}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"nodeagent certs {args.kind}: {exc.filename or args.dir}: {exc.strerror}",
              file=sys.stderr)
        return EXIT_FAILURE
    sys.stdout.write(written.report())
    return EXIT_OK


def add_debug_parser(sub: Subcommands) -> None:
    """`nodeagent debug VIEW`: read a running agent's or server's debug socket."""
    debug = sub.add_parser(
        "debug", help="inspect a running agent or server through its debug socket",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=DEBUG_DESCRIPTION, epilog=DEBUG_EPILOG)
    debug.add_argument("what", choices=DEBUG_VIEWS, metavar="VIEW",
                       help=f"{' | '.join(DEBUG_VIEWS)} (see above)")
    debug.add_argument("--socket", type=Path, default=None, metavar="PATH",
                       help="debug socket (default: the agent's, else the server's: "
                            "/run/nodeagent/agent.sock, /run/nodeagent/server.sock)")
    debug.add_argument("--node", metavar="NAME",
                       help="on a server, tunnels, streams and flows: only this node's")
    debug.add_argument("--json", action="store_true",
                       help="print JSON for scripts (with --watch: one document per line)")
    debug.add_argument("--watch", nargs="?", type=_positive_seconds, const=2.0,
                       default=None, metavar="SECONDS",
                       help="redraw every SECONDS (default 2) until Ctrl-C")



def add_demo_parser(sub: Subcommands) -> None:
    """`nodeagent demo`: a server, an agent and a sample service on loopback."""
    demo = sub.add_parser(
        "demo", help="run a server, an agent and a sample service on loopback",
        description="Start a server, an agent and a small HTTP service on 127.0.0.1, send "
                    "real requests through the tunnel (a TCP port mapping and Host-based HTTP "
                    "routing), print what happened, and keep the stack running until Ctrl-C. "
                    "Exits non-zero if traffic did not flow.")
    demo.add_argument("--seconds", type=float, default=None, metavar="N",
                      help="exit by itself after N seconds (default: run until Ctrl-C)")
    demo.add_argument("--transport", choices=["tls", "wss"], default="tls",
                      help="tunnel transport: TLS over TCP or WebSocket over TLS (default tls)")


def _watch_before_view(argv: Sequence[str]) -> list[str]:
    """`debug --watch streams`: argparse would read the view as --watch's SECONDS; give
    --watch its default there instead."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--watch" and out[i + 1] in DEBUG_VIEWS:
            out.insert(i + 1, "2")
            break
    return out


# Controller mode has no file: a setting is named by the flag that sets it.
FLAG_FOR_SETTING = {
    "tunnel": "--tunnel-listen", "ingress_http": "--ingress-http",
    "ingress_https": "--ingress-https", "metrics_listen": "--metrics-listen",
    "debug_socket": "--debug-socket", "connect.listen": "--connect-listen",
    "connect.uds": "--connect-uds",
}


def _startup_failure(exc: BaseException) -> StartupFailed | None:
    """The StartupFailed a role ended with (None for anything else, which is a bug)."""
    from nodeagent.runtime.failures import sole_failure  # loads trio: only once a role ran

    return sole_failure(exc, StartupFailed)


def _source(args: argparse.Namespace) -> str:
    config = getattr(args, "config", None)
    return str(config) if config is not None else "flags"


def _setting(args: argparse.Namespace, failed: StartupFailed) -> str:
    if getattr(args, "config", None) is None and failed.setting in FLAG_FOR_SETTING:
        return f"{FLAG_FOR_SETTING[failed.setting]}: {failed.detail}"
    return str(failed)


def _usage_error(command: str, message: str) -> NoReturn:
    """A role's usage error found after parsing, worded as argparse's own for that role
    (and its hint pointing at the role's help, not the program's)."""
    sys.stderr.write(f"nodeagent {command}: error: {message}\n"
                     f"run 'nodeagent {command} --help' for usage\n")
    sys.exit(EXIT_USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_watch_before_view(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from nodeagent.ops import logs
    logs.configure(args.log_level, args.log_format)
    try:
        if args.command in ("server", "agent"):
            cluster_flags = [f for f in ("controller", "node", "server", "token_file")
                             if getattr(args, f, None) and not (
                                 f == "server" and args.command == "server")]
            given = [flag for dest, flag, default in args.controller_mode_flags
                     if getattr(args, dest) != default]
            if args.config is not None and given:
                _usage_error(args.command, "give --config FILE (standalone) or the "
                             f"controller-mode flags, not both ({', '.join(given)}: with "
                             "--config, set that in the file)")
            if args.config is None and not cluster_flags and not getattr(args, "cleanup",
                                                                          False):
                _usage_error(args.command, "give --config FILE (standalone) or "
                             "--controller URL with its flags")
        if args.command == "server":
            if args.workers > 1 and args.worker_index is None and not args.check:
                # The parent of the workers, which it starts with these same arguments.
                from nodeagent.server.workers import run_parent
                return run_parent(args, list(argv if argv is not None else sys.argv[1:]))
            if args.config is None:
                from nodeagent.server.main import run_server_cluster
                return run_server_cluster(args)
            from nodeagent.server.main import run_server, worker_slot
            return run_server(args.config, check=args.check, drain_seconds=args.drain_seconds,
                              shutdown_delay=args.shutdown_delay, ready_grace=args.ready_grace,
                              workers=args.workers, slot=worker_slot(args))
        if args.command == "agent":
            if args.cleanup:
                from nodeagent.agent.main import run_cleanup
                return run_cleanup()
            if args.config is None:
                from nodeagent.agent.main import run_agent_cluster
                return run_agent_cluster(args)
            from nodeagent.agent.main import run_agent
            return run_agent(args.config, check=args.check)
        if args.command == "controller":
            from nodeagent.controller.main import run_controller
            return run_controller(args)
        if args.command == "certs":
            return run_certs(args)
        if args.command == "debug":
            from nodeagent.ops.debugcli import run_debug
            return run_debug(args.what, args.socket, as_json=args.json, node=args.node,
                             watch=args.watch)
        if args.command == "demo":
            from nodeagent.demo import run_demo
            return run_demo(seconds=args.seconds, transport=args.transport)
    except ConfigError as exc:
        print(f"nodeagent {args.command}: invalid config:\n{exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK
    except (StartupFailed, BaseExceptionGroup) as exc:
        failed = _startup_failure(exc)
        if failed is None:
            raise
        print(f"nodeagent {args.command}: {_source(args)}: {_setting(args, failed)}",
              file=sys.stderr)
        return EXIT_STARTUP
    parser.error(f"unknown command {args.command}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
