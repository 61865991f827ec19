"""The public HTTP front: Host/path routing (Ingress semantics) and the HTTP/1.1 proxy.

`routes` is the pure route table; `proxy` is the h11-based front that serves client
connections and relays them to upstream streams it gets from a caller-supplied opener;
`tls` selects certificates by SNI; `errors` holds the error the opener raises.
Nothing here knows about the tunnel: an upstream is any `trio.abc.HalfCloseableStream`.
"""

from nodeagent.http.errors import UpstreamUnavailable
from nodeagent.http.proxy import (
    Balancer,
    HttpFront,
    HttpStats,
    Limits,
    Opener,
    open_direct,
    serve_http_connection,
)
from nodeagent.http.routes import Backend, Match, PathType, Route, RouteSpec, RouteTable
from nodeagent.http.tls import CertStore, TlsConfig, context_from_pem

__all__ = [
    "Backend",
    "Balancer",
    "CertStore",
    "HttpFront",
    "HttpStats",
    "Limits",
    "Match",
    "Opener",
    "PathType",
    "Route",
    "RouteSpec",
    "RouteTable",
    "TlsConfig",
    "UpstreamUnavailable",
    "context_from_pem",
    "open_direct",
    "serve_http_connection",
]
