"""What a route asks of the front before its request goes on: authentication (`RouteAuth`:
a JWT checked against a JWKS, or basic auth against bcrypt hashes) and request rate limits
(`RateLimit`). The same models sit on standalone `HttpRoute`s and on the controller's
`IngressRule`s (computed from Ingress annotations); docs/auth.md and docs/limits.md say
how to use them.

Deny by default where a choice is security's: only asymmetric JWT algorithms (a JWKS holds
public keys; an HS* token checked against one is the classic algorithm-confusion attack,
and `none` is never accepted), an audience is required, and only bcrypt hashes are read
from an htpasswd (its MD5 `$apr1$`, SHA-1 `{SHA}` and crypt forms are refused by name).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from nodeagent.config.base import ConfigPath, Model

JwtAlgorithm = Literal["RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
                       "ES256", "ES384", "ES512", "EdDSA"]

# Header names the front sets itself; a client's copy is always dropped (headers.py).
_HEADER_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}\Z")
_BCRYPT = re.compile(r"\$2[aby]\$[0-9]{2}\$[./A-Za-z0-9]{53}\Z")
_USER = re.compile(r"[^:\s]{1,128}\Z")


def parse_htpasswd(text: str) -> dict[str, bytes]:
    """`user:hash` lines → user → bcrypt hash. ValueError names the line (never the hash)
    for a line that is not one, a hash that is not bcrypt, or a user given twice."""
    users: dict[str, bytes] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, hashed = line.partition(":")
        if not sep or not _USER.fullmatch(user):
            raise ValueError(f"htpasswd line {number}: not user:hash")
        if not _BCRYPT.fullmatch(hashed):
            kind = ("MD5 ($apr1$)" if hashed.startswith("$apr1$") else
                    "SHA-1 ({SHA})" if hashed.startswith("{SHA}") else "not bcrypt")
            raise ValueError(f"htpasswd line {number} (user {user!r}): the hash is {kind}; "
                             "only bcrypt hashes are accepted (htpasswd -B)")
        if user in users:
            raise ValueError(f"htpasswd line {number}: user {user!r} given twice")
        users[user] = hashed.encode("ascii")
    return users


class JwtAuth(Model):
    """A bearer JWT signed by a key of `jwks_url`'s set, for `issuer` and `audiences`."""

    issuer: str = Field(min_length=1)
    jwks_url: str = Field(pattern=r"^https?://[^\s]+$")
    # At least one: a token minted for another service of the same issuer must not pass.
    audiences: tuple[str, ...] = Field(min_length=1)
    algorithms: tuple[JwtAlgorithm, ...] = ("RS256", "ES256", "EdDSA")
    # Claims that must be present (exp, iss and aud always are).
    required_claims: tuple[str, ...] = ()
    # Claims that must hold a value (a string claim equal to it, or a list claim holding
    # it): a valid token without it gets 403, not 401.
    claims: dict[str, str] = {}
    # Clock skew allowed on exp, nbf and iat, in seconds.
    leeway: float = Field(default=30.0, ge=0, le=600)
    # Also read the token from this cookie when there is no Authorization header.
    cookie: str | None = Field(default=None, pattern=r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,128}$")
    # The claim passed to the backend as the identity.
    identity_claim: str = "sub"
    # The key set is fetched again after the response's Cache-Control max-age, at most
    # this long (and at least `jwks_min_refetch`); a token naming an unknown key (a
    # rotation) fetches it at once, at most once per `jwks_min_refetch` seconds.
    jwks_max_age: float = Field(default=300.0, ge=1, le=86400)
    jwks_min_refetch: float = Field(default=10.0, ge=0, le=3600)


class BasicAuth(Model):
    """HTTP basic auth against bcrypt hashes: an htpasswd file (standalone) or its text
    (controller mode: from the Secret the Ingress names)."""

    realm: str = Field(default="nodeagent", pattern=r'^[^"\\\r\n]{1,128}$')
    htpasswd_file: ConfigPath | None = None
    # Secret: kept out of repr, redacted in dumps (config.base.SECRET_FIELDS).
    htpasswd: str | None = Field(default=None, repr=False)

    @model_validator(mode="after")
    def _one(self) -> BasicAuth:
        if (self.htpasswd_file is None) == (self.htpasswd is None):
            raise ValueError("give exactly one of htpasswd_file or htpasswd")
        if self.htpasswd is not None:
            parse_htpasswd(self.htpasswd)
        return self


class RouteAuth(Model):
    """Who may use a route: a JWT, or basic auth. The identity that passed goes to the
    backend in `identity_header` (a client's own copy of it is always dropped)."""

    jwt: JwtAuth | None = None
    basic: BasicAuth | None = None
    identity_header: str = "x-nodeagent-identity"

    @field_validator("identity_header")
    @classmethod
    def _header(cls, v: str) -> str:
        v = v.lower()
        if not _HEADER_NAME.fullmatch(v) or v in ("authorization", "host", "cookie"):
            raise ValueError(f"{v!r} is not a header name the front may set")
        return v

    @model_validator(mode="after")
    def _one(self) -> RouteAuth:
        if (self.jwt is None) == (self.basic is None):
            raise ValueError("give exactly one of jwt or basic")
        return self


class RateLimit(Model):
    """Token buckets for a route's requests: all clients together (`rate`, `burst`) and
    each client address (`per_client_rate`, `per_client_burst`; an IPv6 client per /64).
    Over → 429 with Retry-After (gRPC: RESOURCE_EXHAUSTED)."""

    rate: float | None = Field(default=None, ge=0.001, le=1e6)  # requests per second
    burst: int | None = Field(default=None, ge=1, le=10_000_000)  # default: rate, at least 1
    per_client_rate: float | None = Field(default=None, ge=0.001, le=1e6)
    per_client_burst: int | None = Field(default=None, ge=1, le=10_000_000)

    @model_validator(mode="after")
    def _some(self) -> RateLimit:
        if self.rate is None and self.per_client_rate is None:
            raise ValueError("give rate, per_client_rate or both")
        if self.burst is not None and self.rate is None:
            raise ValueError("burst needs rate")
        if self.per_client_burst is not None and self.per_client_rate is None:
            raise ValueError("per_client_burst needs per_client_rate")
        return self


class NodeBandwidth(Model):
    """A node's tunnel bandwidth at the server, in bytes per second each way (None:
    unlimited): `to_node` paces what the server sends into the tunnel (downloads through
    the node's routes), `from_node` what it reads from it (uploads, intercepted traffic).
    Other nodes' tunnels are never slowed by one node's limit (docs/limits.md)."""

    to_node: float | None = Field(default=None, ge=1024, le=1e11)
    from_node: float | None = Field(default=None, ge=1024, le=1e11)


__all__ = ["BasicAuth", "JwtAlgorithm", "JwtAuth", "NodeBandwidth", "RateLimit", "RouteAuth",
           "parse_htpasswd"]
