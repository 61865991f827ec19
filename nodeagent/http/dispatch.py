"""The route step of a request: the route it goes to, or the answer it gets here instead.

`route_request` is pure (the route table and the request as `headers.read_request` read
it, in; a `Route` or a `Refusal`, out), so every way a request is turned away without
reaching an upstream is tested without a socket: CONNECT (405, then close), a target that
cannot be normalised (400, then close; see `paths`), a Host whose port is not one (400,
then close; see `headers`), no route (404),
a plain-HTTP request to a route that redirects to HTTPS (308), a route without ready
backends (503; a sleeping route's 503 carries its `wake`, and the connection holds the
request instead: `holds.py`), a sleeping route whose workload fails to start (502), a
declared body over the limit (413). A route with a gate (auth, rate limits: `gate.py`)
passes it to every refusal made after the match, so the caller asks the gate first.
"""

from __future__ import annotations

from nodeagent.http.headers import ClientRequest
from nodeagent.http.paths import clip
from nodeagent.http.routetable import Gate, Route, RouteTable, WakeSpec, normalize_host
from nodeagent.http.stats import RefusalReason


class Refusal:
    """The answer to a request that goes to no upstream (see `route_request`)."""

    __slots__ = ("close", "code", "gate", "grpc", "headers", "location", "reason",
                 "retry_after", "route", "status", "wake")

    def __init__(
        self,
        status: int,
        reason: str,
        *,
        location: str | None = None,
        close: bool = False,
        code: RefusalReason | None = None,
        wake: WakeSpec | None = None,
        route: str | None = None,
        retry_after: int | None = None,
        gate: Gate | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        grpc: int | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.code = code
        """Set: a refusal that protects the front, counted and logged by this reason."""
        self.location = location
        """For a 308: where the client should go instead."""
        self.close = close
        """Close the connection after answering, whatever the client asked."""
        self.wake = wake
        """Set: the route sleeps; hold the request until it wakes (holds.py)."""
        self.route = route
        """The route's name, when a route matched."""
        self.retry_after = retry_after
        """Seconds for a Retry-After header."""
        self.gate = gate
        """The matched route's gate (`gate.py`): asked before this answer is given."""
        self.headers = headers
        """More header fields for the answer (WWW-Authenticate)."""
        self.grpc = grpc
        """The gRPC status for a gRPC request, when not the HTTP status's usual one."""

    def __repr__(self) -> str:
        return f"Refusal({self.status}, {self.reason!r}, location={self.location!r})"


def route_request(
    table: RouteTable,
    method: bytes,
    req: ClientRequest,
    *,
    https: bool,
    max_body: int | None,
) -> Route | Refusal:
    """The route a request goes to, or why it goes nowhere. Pure: table and request in."""
    if method == b"CONNECT":
        return Refusal(405, "CONNECT is not served on this listener", close=True)
    if req.bad_target is not None:
        return Refusal(400, f"cannot route this path: {req.bad_target}", close=True,
                       code="bad_path")
    if req.bad_host is not None:
        return Refusal(400, f"bad Host: {req.bad_host}", close=True, code="bad_host")
    host = req.host.decode("latin-1")
    path = req.target.decode("latin-1")
    match = table.lookup(host, path)
    if match is None:
        # Host and path come from the client: the answer (and its log line) shows a prefix.
        return Refusal(404, f"no route for {clip(host + path)}")
    route = match.route
    if route.tls_redirect and not https:
        location = f"https://{normalize_host(host)}{path}"
        return Refusal(308, f"redirect to {location}", location=location)
    if not route.backends:
        wake = route.wake
        if wake is not None:
            if wake.failure:
                return Refusal(502, f"route {route.name}: its backend fails to start: "
                               f"{wake.failure}", route=route.name, gate=route.gate)
            return Refusal(503, f"route {route.name} is asleep", wake=wake,
                           route=route.name, gate=route.gate)
        return Refusal(503, f"route {route.name} has no ready backends", gate=route.gate)
    if max_body is not None and req.content_length > max_body:
        return Refusal(413, f"request body over {max_body} bytes", code="body_too_large",
                       gate=route.gate)
    return route


__all__ = ["Refusal", "route_request"]
