"""The public HTTP front: Host/path routing (Ingress semantics) and the HTTP/1.1 proxy.

One job per module:
- `front`: the listener (`HttpFront`), TLS by SNI, one task per client connection, which
  protocol it speaks (ALPN, or the h2c preface on plaintext);
- `connection`: one HTTP/1.1 client connection's request loop (read, route, forward, relay,
  repeat);
- `h2connection`: one HTTP/2 client connection (a task per stream, the same routing),
  on `h2session` (the `h2` state machine with the front's settings and limits, sans-IO)
  and `h2wire` (writes and flow control from many tasks); `h2heads`: h2 heads to and from
  the HTTP/1.1 view, pure; `grpcstatus`: gRPC deadlines and the front's own gRPC answers;
- `exchange`: one request's exchange with a backend, HTTP/1.1 or h2c; `h2pool`: the shared
  h2c connections to backends (one per endpoint), each request balanced on its own;
- `ondemand`: the h2c pool's slot, and `preface`: HTTP/2's connection preface, so that the
  h2 modules above (and the `h2` library) load on the first HTTP/2 connection or h2c
  request, not at start;
- `headers`: the header policy both ways, pure (hop-by-hop, X-Forwarded-*, Host, framing);
- `dispatch`: the route step, pure (a `Route`, or the 404/405/308/503/413 answered here);
- `upstream`: the connection's upstream and dialing a route's backends;
- `balancer`: which backend a new upstream goes to;
- `h1`: the sans-IO codec for upstream responses; `routes`: the route table;
- `tls`: certificates by SNI; `limits`, `stats`, `errors`: the front's settings, counters,
  and the error an opener raises.
Nothing here knows about the tunnel: an upstream is any `trio.abc.HalfCloseableStream`.
"""

from nodeagent.http.balancer import Balancer
from nodeagent.http.errors import UpstreamUnavailable
from nodeagent.http.front import HttpFront, serve_http_connection
from nodeagent.http.holds import HeldRequests
from nodeagent.http.limits import Limits
from nodeagent.http.routetable import (
    Backend,
    Match,
    PathType,
    Route,
    RouteSpec,
    RouteTable,
    WakeSpec,
)
from nodeagent.http.stats import HttpStats
from nodeagent.http.tls import CertStore, TlsConfig, context_from_pem
from nodeagent.http.upstream import Opener

__all__ = [
    "Backend",
    "Balancer",
    "CertStore",
    "HeldRequests",
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
    "WakeSpec",
    "context_from_pem",
    "serve_http_connection",
]
