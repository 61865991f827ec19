"""An Ingress's authentication and rate-limit annotations → `RouteAuth` and `RateLimit`
for its rules (pure: the Ingress and its namespace's Secrets in, settings and problems
out; docs/auth.md and docs/limits.md list the annotations).

Basic auth names a Secret of type `nodeagent.io/htpasswd` in the Ingress's own namespace
(never another: a namespace user must not make the front check passwords it cannot read;
the controller watches Secrets of that type only); its `auth` key (as
ingress-nginx's) or `htpasswd` key holds htpasswd lines with bcrypt hashes. A bad
annotation or Secret is a Problem on the Ingress, and its rules are then *not* served:
an Ingress that asked for authentication never falls back to being open.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from nodeagent.config.gateway import BasicAuth, JwtAuth, RateLimit, RouteAuth
from nodeagent.config.routes import IngressRoutes, IngressRule

PREFIX = "nodeagent.io/"
JWT_ISSUER = PREFIX + "auth-jwt-issuer"
JWT_JWKS_URL = PREFIX + "auth-jwt-jwks-url"
JWT_AUDIENCE = PREFIX + "auth-jwt-audience"  # comma-separated
JWT_ALGORITHMS = PREFIX + "auth-jwt-algorithms"  # comma-separated
JWT_REQUIRED_CLAIMS = PREFIX + "auth-jwt-required-claims"  # comma-separated names
JWT_CLAIMS = PREFIX + "auth-jwt-claims"  # name=value,name=value
JWT_LEEWAY = PREFIX + "auth-jwt-leeway"  # seconds
JWT_COOKIE = PREFIX + "auth-jwt-cookie"
JWT_IDENTITY_CLAIM = PREFIX + "auth-jwt-identity-claim"
BASIC_SECRET = PREFIX + "auth-basic-secret"
BASIC_REALM = PREFIX + "auth-basic-realm"
IDENTITY_HEADER = PREFIX + "auth-identity-header"
RATE = PREFIX + "rate-limit-rps"
BURST = PREFIX + "rate-limit-burst"
CLIENT_RATE = PREFIX + "rate-limit-per-client-rps"
CLIENT_BURST = PREFIX + "rate-limit-per-client-burst"

Obj = dict[str, Any]

HTPASSWD_SECRET_TYPE = "nodeagent.io/htpasswd"
"""The type a basic-auth Secret must have: the controller watches Secrets of this type
(and kubernetes.io/tls) only, never the cluster's other Secrets."""


class GateAnnotationError(ValueError):
    """What is wrong with the annotations (the message names no secret value)."""


def _list(value: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in value.split(",") if p.strip())


def basic_secret_name(annotations: Mapping[str, Any]) -> str | None:
    """The Secret the basic-auth annotation names (a reference the Ingress reads)."""
    value = annotations.get(BASIC_SECRET)
    return str(value) if value else None


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}"
                     for e in exc.errors(include_input=False, include_url=False))


def route_auth(annotations: Mapping[str, Any], namespace: str,
               secret: Callable[[str, str], Obj | None]) -> RouteAuth | None:
    """The Ingress's RouteAuth, None when it asks for none. GateAnnotationError."""
    jwt_asked = any(k.startswith(PREFIX + "auth-jwt-") for k in annotations)
    basic_name = basic_secret_name(annotations)
    if not jwt_asked and basic_name is None:
        return None
    if jwt_asked and basic_name is not None:
        raise GateAnnotationError("give JWT or basic auth annotations, not both")
    extra: dict[str, Any] = {}
    if IDENTITY_HEADER in annotations:
        extra["identity_header"] = str(annotations[IDENTITY_HEADER])
    try:
        if basic_name is not None:
            obj = secret(namespace, basic_name)
            if obj is None or obj.get("type") != HTPASSWD_SECRET_TYPE:
                raise GateAnnotationError(f"Secret {namespace}/{basic_name} ({BASIC_SECRET}) "
                                          f"not found, or not of type {HTPASSWD_SECRET_TYPE}")
            data = obj.get("data") or {}
            raw = data.get("auth", data.get("htpasswd"))
            if not isinstance(raw, str):
                raise GateAnnotationError(f"Secret {namespace}/{basic_name} has no `auth` "
                                          "or `htpasswd` key")
            try:
                text = base64.b64decode(raw, validate=True).decode("utf-8")
            except (binascii.Error, ValueError):
                raise GateAnnotationError(f"Secret {namespace}/{basic_name}: not base64 "
                                          "UTF-8 text") from None
            basic: dict[str, Any] = {"htpasswd": text}
            if BASIC_REALM in annotations:
                basic["realm"] = str(annotations[BASIC_REALM])
            try:
                return RouteAuth(basic=BasicAuth(**basic), **extra)
            except ValidationError as exc:
                raise GateAnnotationError(f"Secret {namespace}/{basic_name}: "
                                          f"{_errors(exc)}") from None
        jwt: dict[str, Any] = {
            "issuer": str(annotations.get(JWT_ISSUER, "")),
            "jwks_url": str(annotations.get(JWT_JWKS_URL, "")),
            "audiences": _list(str(annotations.get(JWT_AUDIENCE, ""))),
        }
        if JWT_ALGORITHMS in annotations:
            jwt["algorithms"] = _list(str(annotations[JWT_ALGORITHMS]))
        if JWT_REQUIRED_CLAIMS in annotations:
            jwt["required_claims"] = _list(str(annotations[JWT_REQUIRED_CLAIMS]))
        if JWT_CLAIMS in annotations:
            pairs = [p.partition("=") for p in _list(str(annotations[JWT_CLAIMS]))]
            if any(not sep or not k for k, sep, _ in pairs):
                raise GateAnnotationError(f"{JWT_CLAIMS}: write name=value,name=value")
            jwt["claims"] = {k.strip(): v.strip() for k, _, v in pairs}
        if JWT_LEEWAY in annotations:
            jwt["leeway"] = annotations[JWT_LEEWAY]
        if JWT_COOKIE in annotations:
            jwt["cookie"] = str(annotations[JWT_COOKIE])
        if JWT_IDENTITY_CLAIM in annotations:
            jwt["identity_claim"] = str(annotations[JWT_IDENTITY_CLAIM])
        return RouteAuth(jwt=JwtAuth(**jwt), **extra)
    except ValidationError as exc:
        raise GateAnnotationError(_errors(exc)) from None


def rate_limit(annotations: Mapping[str, Any]) -> RateLimit | None:
    """The Ingress's RateLimit, None when it sets none. GateAnnotationError."""
    fields = {"rate": RATE, "burst": BURST, "per_client_rate": CLIENT_RATE,
              "per_client_burst": CLIENT_BURST}
    given = {f: annotations[a] for f, a in fields.items() if a in annotations}
    if not given:
        return None
    try:
        return RateLimit(**given)
    except ValidationError as exc:
        raise GateAnnotationError(_errors(exc)) from None


def with_cluster_defaults(routes: IngressRoutes, jwt: JwtAuth | None,
                          limit: RateLimit | None) -> IngressRoutes:
    """The Ingress routes with a ClusterTunnel's `ingressJwt` and `ingressRateLimit` put
    on every rule that has no auth (or no rate limit) of its own."""
    if jwt is None and limit is None:
        return routes

    def fill(rule: IngressRule) -> IngressRule:
        update: dict[str, Any] = {}
        if jwt is not None and rule.auth is None:
            update["auth"] = RouteAuth(jwt=jwt)
        if limit is not None and rule.rate_limit is None:
            update["rate_limit"] = limit
        return rule.model_copy(update=update) if update else rule

    default = routes.default_backend
    return routes.model_copy(update={
        "rules": tuple(fill(r) for r in routes.rules),
        "default_backend": fill(default) if default is not None else None})


__all__ = [
    "HTPASSWD_SECRET_TYPE",
    "GateAnnotationError",
    "basic_secret_name",
    "rate_limit",
    "route_auth",
    "with_cluster_defaults",
]
