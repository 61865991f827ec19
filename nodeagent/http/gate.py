"""The gate step of a request: a route's rate limits, then its authentication.

Between routing (`dispatch.route_request`, pure) and forwarding, both the HTTP/1.1 loop
and the HTTP/2 connection call `gate.admit(routed, creq, client)` for a route that has a
gate (`Route.gate`; a refusal after a route matched carries it too, so a sleeping or
backend-less route still asks who is calling before it says anything). It returns what
it was given when the request may go on, with the identity set in `creq.headers` (a
client's own copy of that header removed first; basic auth's Authorization removed, the
password is for the front), or a `Refusal`: 429 with Retry-After (gRPC
RESOURCE_EXHAUSTED), 401 with WWW-Authenticate (UNAUTHENTICATED), 403
(PERMISSION_DENIED), 503 when the keys or password checks are not available now. Each
refusal carries a reason code, which the connection counts and logs rate-limited
(`HttpStats.refused`), and is counted per route here for `nodeagent debug status`.

`GateRegistry` builds the gates from config and keeps a route's gate (its buckets, its
remembered passwords) across route-table rebuilds while its settings stay the same; the
JWKS caches are shared by URL (`jwks.JwksStore`).
"""

from __future__ import annotations

import urllib.parse
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from nodeagent.config.gateway import RateLimit, RouteAuth, parse_htpasswd
from nodeagent.http import grpcstatus
from nodeagent.http.dispatch import Refusal
from nodeagent.http.front import client_key
from nodeagent.http.headers import ClientRequest
from nodeagent.http.ratelimit import RateLimiter, retry_after
from nodeagent.http.routetable import Route

if TYPE_CHECKING:
    # Imported when a route first has authentication: they load PyJWT, cryptography,
    # bcrypt and httpx, which a server with open routes never needs (tests/test_imports.py).
    from nodeagent.http.auth import BasicAuthenticator, JwtAuthenticator
    from nodeagent.http.jwks import JwksStore

_GRPC = {401: grpcstatus.UNAUTHENTICATED, 403: grpcstatus.PERMISSION_DENIED,
         429: grpcstatus.RESOURCE_EXHAUSTED, 503: grpcstatus.UNAVAILABLE}
# Characters an identity keeps as they are in its header; others are percent-encoded
# (a claim may hold any Unicode, a control character included).
_SAFE = "@.-_~+:/=!$&'()*,;"


class RouteGate:
    """One route's limits and authentication (see the module docstring)."""

    def __init__(self, route: str, *, auth: JwtAuthenticator | BasicAuthenticator | None,
                 identity_header: str = "x-nodeagent-identity",
                 limiter: RateLimiter | None = None) -> None:
        self.route = route
        self.auth = auth
        self.identity_header = identity_header.encode("ascii")
        self.limiter = limiter
        self.strip_authorization = auth is not None and auth.kind == "basic"
        self.passed = 0
        self.refused: Counter[str] = Counter()

    async def admit(self, routed: Route | Refusal, creq: ClientRequest,
                    client: str) -> Route | Refusal:
        limiter = self.limiter
        if limiter is not None:
            limited = limiter.check(client_key(client), trio.current_time())
            if limited is not None:
                reason, wait = limited
                self.refused[reason] += 1
                return Refusal(429, f"route {self.route}: over its request rate",
                               code=reason, retry_after=retry_after(wait),
                               grpc=grpcstatus.RESOURCE_EXHAUSTED, route=self.route)
        auth = self.auth
        if auth is None:
            self.passed += 1
            return routed
        headers = creq.headers
        outcome = await auth.authenticate(headers)
        if not isinstance(outcome, str):  # an AuthFailure
            self.refused[outcome.reason] += 1
            extra = ([(b"www-authenticate", outcome.challenge.encode())]
                     if outcome.challenge is not None else [])
            return Refusal(outcome.status, f"route {self.route}: {outcome.message}",
                           code=outcome.reason, headers=extra, grpc=_GRPC[outcome.status],
                           route=self.route)
        self.passed += 1
        name = self.identity_header
        drop = b"authorization" if self.strip_authorization else name
        headers[:] = [(n, v) for n, v in headers if n != name and n != drop]
        headers.append((name, urllib.parse.quote(outcome, safe=_SAFE).encode("ascii")))
        return routed

    def as_dict(self) -> dict[str, Any]:
        auth: Any = self.auth
        kind = auth.kind if auth is not None else None
        return {
            "auth": kind,
            "issuer": auth.config.issuer if kind == "jwt" else None,
            "jwks": auth.keys.as_dict() if kind == "jwt" else None,
            "users": len(auth.users) if kind == "basic" else None,
            "identity_header": self.identity_header.decode(),
            "rate_limit": self.limiter.as_dict() if self.limiter is not None else None,
            "passed": self.passed, "refused": dict(self.refused),
        }


class GateRegistry:
    """The gates of a server's routes, by route name (see the module docstring)."""

    def __init__(self, jwks: JwksStore | None = None) -> None:
        self._jwks = jwks  # made when a route first checks JWTs
        self.gates: dict[str, tuple[Any, RouteGate]] = {}
        self._seen: set[str] = set()

    def gate(self, route: str, auth: RouteAuth | None,
             rate_limit: RateLimit | None) -> RouteGate | None:
        """The gate for `route` with these settings (the one it had if they did not
        change), or None for an open, unlimited route. ValueError for an htpasswd file
        that cannot be read or holds a non-bcrypt hash (the message names no hash)."""
        if auth is None and rate_limit is None:
            return None
        htpasswd = None
        if auth is not None and auth.basic is not None:
            basic = auth.basic
            if basic.htpasswd_file is not None:
                try:
                    htpasswd = Path(basic.htpasswd_file).read_text()
                except (OSError, UnicodeDecodeError) as exc:
                    raise ValueError(f"htpasswd_file {basic.htpasswd_file}: "
                                     f"{getattr(exc, 'strerror', None) or exc}") from None
            else:
                htpasswd = basic.htpasswd
        key = (auth, rate_limit, htpasswd)
        self._seen.add(route)
        known = self.gates.get(route)
        if known is not None and known[0] == key:
            return known[1]
        authenticator: JwtAuthenticator | BasicAuthenticator | None = None
        if auth is not None and auth.jwt is not None:
            from nodeagent.http.auth import JwtAuthenticator
            jwt_config = auth.jwt
            authenticator = JwtAuthenticator(jwt_config, self.jwks.cache(
                jwt_config.jwks_url, max_age=jwt_config.jwks_max_age,
                min_refetch=jwt_config.jwks_min_refetch))
        elif auth is not None and auth.basic is not None:
            assert htpasswd is not None
            from nodeagent.http.auth import BasicAuthenticator
            authenticator = BasicAuthenticator(parse_htpasswd(htpasswd), auth.basic.realm)
        limiter = None if rate_limit is None else RateLimiter(
            rate=rate_limit.rate, burst=rate_limit.burst,
            per_client_rate=rate_limit.per_client_rate,
            per_client_burst=rate_limit.per_client_burst)
        gate = RouteGate(route, auth=authenticator, limiter=limiter,
                         identity_header=auth.identity_header if auth is not None
                         else "x-nodeagent-identity")
        self.gates[route] = (key, gate)
        return gate

    def begin(self) -> None:
        """A rebuild starts: routes not asked for again by `end` are forgotten."""
        self._seen = set()

    def end(self) -> None:
        for name in list(self.gates):
            if name not in self._seen:
                del self.gates[name]
        if self._jwks is not None:
            self._jwks.keep_only({
                (g.auth.keys.url, g.auth.keys.max_age, g.auth.keys.min_refetch)
                for _, g in self.gates.values()
                if g.auth is not None and g.auth.kind == "jwt"})

    @property
    def jwks(self) -> JwksStore:
        if self._jwks is None:
            from nodeagent.http.jwks import JwksStore
            self._jwks = JwksStore()
        return self._jwks

    def as_dict(self) -> dict[str, Any]:
        return {name: gate.as_dict() for name, (_, gate) in sorted(self.gates.items())}


__all__ = ["GateRegistry", "RouteGate"]
