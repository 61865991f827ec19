"""The CONNECT front's decisions, without I/O: what a control-plane request asks for, and
whether (and through which node) the server may open it.

kube-apiserver's egress selector (`proxyProtocol: HTTPConnect`) sends
`CONNECT <node address>:<port> HTTP/1.1`; Prometheus with `proxy_url` sends absolute-form
requests (`GET http://<node>:<port>/metrics HTTP/1.1`). Both name a node by its name, one
of its addresses (InternalIP, ExternalIP, Hostname) or a pod address in its podCIDR.

`parse_target(method, target)` turns the request line into a `ProxyTarget` or a
`Refusal` (400); `decide(target, routes)` into a `ConnectRoute` (node, what its agent
dials) or a `Refusal` (403 by policy, 502 no such node); `check_client` says whether a
TCP client's certificate is on the allow list (403 `client_not_allowed` if not). Every
refusal carries a reason code from `REASONS` — the metric label and the log key — and a
one-line message for the response body, which never echoes more than the (bounded)
target the client sent.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from nodeagent.config import ConnectTls, RoutesConfig

# Every reason a request can be refused for, with its HTTP status.
REASONS: dict[str, int] = {
    "malformed": 400,  # not HTTP, a bad request line or authority
    "not_proxy_request": 400,  # an origin-form request: this is a proxy, not a server
    "https_absolute_form": 400,  # `GET https://...`: use CONNECT for TLS
    "head_timeout": 408,
    "nodeagent_identity": 403,  # a node's or server's tunnel certificate (TCP listener)
    "client_not_allowed": 403,  # a certificate of the CA not in the allow list (TCP)
    "node_denied": 403,  # in a ClusterTunnel's deniedNodes
    "port_not_allowed": 403,  # not in the node's allowedNodePorts
    "pod_not_allowed": 403,  # a pod address, not on the tunnel's allowedPodPorts
    "agent_forbidden": 403,  # the agent refused (its own control-plane rules)
    "unknown_node": 502,  # no node answers to that name or address
    "node_not_connected": 502,
    "dial_failed": 502,  # the agent could not reach the target
    "dial_timeout": 504,
    "busy": 503,  # the front's max_streams reached
    "not_tcp": 400,  # the DNAT path (server/dnat.py): a stream that is not tcp
}

# A DNS name or an IP address as written in an authority (brackets stripped).
# Matched whole (fullmatch): `$` would also match before a final newline.
_HOST = re.compile(r"[A-Za-z0-9][-A-Za-z0-9.]{0,252}")
_MAX_TARGET = 1024


@dataclass(frozen=True, slots=True)
class ProxyTarget:
    """Where a request asks to go. `path` is None for CONNECT (a raw stream), else the
    origin-form path of a forwarded HTTP request."""

    host: str  # lower case; an IP address without brackets
    port: int
    path: str | None = None

    @property
    def authority(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ConnectRoute:
    """What the front opens: a stream through `node`'s agent to dial_host:port."""

    node: str
    dial_host: str
    port: int
    kind: str  # "node" (its own addresses) or "pod"


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str  # a key of REASONS
    message: str  # one line, for the response body and the log

    @property
    def status(self) -> int:
        return REASONS[self.reason]


def _split_authority(text: str) -> tuple[str, int] | None:
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1:end + 2] != ":":
            return None
        host, port = text[1:end], text[end + 2:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not _HOST.fullmatch(host):
            return None
    if not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        return None
    return host.lower(), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_target(method: str, target: str) -> ProxyTarget | Refusal:
    """The request line's method and target → where it goes, or a 400 refusal."""
    if len(target) > _MAX_TARGET:
        return Refusal("malformed", f"request target longer than {_MAX_TARGET} bytes")
    if method == "CONNECT":
        parts = _split_authority(target)
        if parts is None:
            return Refusal("malformed", "CONNECT needs host:port (a node name or address "
                                        "and a port 1-65535)")
        return ProxyTarget(*parts)
    lowered = target[:8].lower()
    if lowered.startswith("https://"):
        return Refusal("https_absolute_form", "use CONNECT host:port for TLS targets")
    if not lowered.startswith("http://"):
        return Refusal("not_proxy_request", "this is a proxy: send CONNECT host:port or an "
                                            "absolute http://host:port/path request")
    rest = target[7:]
    slash = rest.find("/")
    authority, path = (rest, "/") if slash < 0 else (rest[:slash], rest[slash:])
    if "@" in authority or "?" in authority or "#" in authority:
        return Refusal("malformed", "the URL's authority must be host:port")
    if ":" not in authority.rsplit("]", 1)[-1]:
        authority += ":80"
    parts = _split_authority(authority)
    if parts is None:
        return Refusal("malformed", "the URL needs host[:port] (a node name or address)")
    return ProxyTarget(*parts, path=path)


def decide(target: ProxyTarget, routes: RoutesConfig) -> ConnectRoute | Refusal:
    """Whether the control plane may reach `target`, and through which node.

    A node's name or one of its addresses: only on its allowed ports (ClusterTunnel
    `allowedNodePorts`, default kubelet 10250). A pod address inside a node's podCIDR: only
    on the tunnel's `allowedPodPorts` (none by default). Anything no node owns: 502
    unknown_node — the front never dials anything but a node's agent."""
    node = routes.connect_node_for(target.host)
    kind = "node"
    if node is None:
        owner = routes.node_for_address(target.host)
        if owner is None:
            return Refusal("unknown_node", f"no node answers to {target.host}")
        node, kind = owner, "pod"
    if node in routes.denied_nodes:
        return Refusal("node_denied", f"node {node} is denied")
    settings = routes.connect_nodes.get(node)
    if kind == "pod":
        if settings is None or not any(r.contains(target.port) for r in settings.pod_ports):
            return Refusal("pod_not_allowed", f"{target.authority} is a pod address on node "
                                              f"{node}; its port is not in allowedPodPorts")
        return ConnectRoute(node, target.host, target.port, kind)
    assert settings is not None
    if not any(r.contains(target.port) for r in settings.ports):
        return Refusal("port_not_allowed", f"port {target.port} of node {node} is not in "
                                           f"allowedNodePorts")
    # By name (node or Hostname address): the node's first IP; by IP: that address.
    dial = target.host if _is_ip(target.host) else settings.dial_host()
    return ConnectRoute(node, dial, target.port, kind)


def check_client(subjects: Sequence[str], organizations: Sequence[str],
                 tls: ConnectTls) -> Refusal | None:
    """Whether a client certificate the CA signed may use the TCP listener: its subject
    CNs (`subjects`) and Os against `connect.tls.allowed_subjects` and
    `allowed_organizations`; None when it may, else a 403 refusal naming what it is."""
    if "*" in tls.allowed_subjects:
        return None
    if any(cn in tls.allowed_subjects for cn in subjects):
        return None
    if any(o in tls.allowed_organizations for o in organizations):
        return None
    who = " ".join([f"cn={cn[:64]}" for cn in subjects[:2]] +
                   [f"o={o[:64]}" for o in organizations[:4]]) or "no subject"
    return Refusal("client_not_allowed",
                   f"client certificate ({who}) is not in connect.tls.allowed_subjects or "
                   f"allowed_organizations (by default only kube-apiserver's egress "
                   f"identity)")
