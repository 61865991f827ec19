"""The one config model: typed, validated, versioned, for files and for the controller.

Files are YAML because the same model appears inside Kubernetes objects (the controller
renders it from CRDs and serves it to agents and servers), and one format for both modes
means an example in the docs works in either. Validation is pydantic: every error names
the field path and the problem, and nothing starts on invalid config.

Two halves per role:
- what it should do (allowed targets, interception, routes): `NodeConfig`, `RoutesConfig`;
  from a file in standalone mode, from the controller in cluster mode, with a version
  either way;
- what a process needs to run at all (its identity, where to connect, credentials, the
  debug socket): `AgentConfig` and `ServerConfig` extend those halves with it; only ever
  from a file or flags.

The modules split it by role: `base` (shared pieces and loading), `node` (the agent's),
`routes` (the server's); every name is importable from `nodeagent.config` as before.
"""

from __future__ import annotations

from nodeagent.config.base import (
    DEFAULT_AGENT_SOCKET,
    DEFAULT_SERVER_SOCKET,
    DEFAULT_SOCKET_MARK,
    DNS_LABEL,
    DNS_NAME,
    REDACTED,
    SECRET_FIELDS,
    Cidr,
    ConfigError,
    ConfigPath,
    ConfigProblems,
    ControllerUrl,
    HostPort,
    InlineToken,
    Keepalive,
    ListenAddress,
    M,
    Model,
    PortRange,
    Reconnect,
    StartupFailed,
    controller_url_address,
    format_errors,
    load_config,
    parse_config,
    raise_problems,
    redacted,
    token_text,
    valid_node_name,
)
from nodeagent.config.connect import (
    CONTROL_PLANE_PURPOSE,
    PURPOSE_KEY,
    ConnectFrontConfig,
    ConnectNode,
    ConnectTls,
)
from nodeagent.config.gateway import (
    BasicAuth,
    JwtAuth,
    NodeBandwidth,
    RateLimit,
    RouteAuth,
    parse_htpasswd,
)
from nodeagent.config.node import (
    AgentConfig,
    AllowRule,
    ClientTls,
    InterceptConfig,
    InterceptRuleConfig,
    NodeConfig,
    intercept_model,
)
from nodeagent.config.routes import (
    ALWAYS_PROTECTED,
    Backend,
    HttpLimitsConfig,
    HttpListener,
    HttpRoute,
    IngressRoutes,
    IngressRule,
    IngressTls,
    LoadBalancerPort,
    LoadBalancerService,
    NodeScope,
    RoutesConfig,
    ServerConfig,
    ServerTls,
    TcpMapping,
    TokenEntry,
    TunnelListen,
    UdpMapping,
    WakeRoute,
)

__all__ = [
    "ALWAYS_PROTECTED",
    "CONTROL_PLANE_PURPOSE",
    "DEFAULT_AGENT_SOCKET",
    "DEFAULT_SERVER_SOCKET",
    "DEFAULT_SOCKET_MARK",
    "DNS_LABEL",
    "DNS_NAME",
    "PURPOSE_KEY",
    "REDACTED",
    "SECRET_FIELDS",
    "AgentConfig",
    "AllowRule",
    "Backend",
    "BasicAuth",
    "Cidr",
    "ClientTls",
    "ConfigError",
    "ConfigPath",
    "ConfigProblems",
    "ConnectFrontConfig",
    "ConnectNode",
    "ConnectTls",
    "ControllerUrl",
    "HostPort",
    "HttpLimitsConfig",
    "HttpListener",
    "HttpRoute",
    "IngressRoutes",
    "IngressRule",
    "IngressTls",
    "InlineToken",
    "InterceptConfig",
    "InterceptRuleConfig",
    "JwtAuth",
    "Keepalive",
    "ListenAddress",
    "LoadBalancerPort",
    "LoadBalancerService",
    "M",
    "Model",
    "NodeBandwidth",
    "NodeConfig",
    "NodeScope",
    "PortRange",
    "RateLimit",
    "Reconnect",
    "RouteAuth",
    "RoutesConfig",
    "ServerConfig",
    "ServerTls",
    "StartupFailed",
    "TcpMapping",
    "TokenEntry",
    "TunnelListen",
    "UdpMapping",
    "WakeRoute",
    "controller_url_address",
    "format_errors",
    "intercept_model",
    "load_config",
    "parse_config",
    "parse_htpasswd",
    "raise_problems",
    "redacted",
    "token_text",
    "valid_node_name",
]
