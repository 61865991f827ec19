"""Ingress annotations for authentication and rate limits → the rules' RouteAuth and
RateLimit (pure translation; a bad one is a Problem and the Ingress is not served)."""

from __future__ import annotations

import base64
from typing import Any

import bcrypt

from tests.controller.test_ingress import NS, ingress, path, rule, translate

HASH = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()
JWT = {"nodeagent.io/auth-jwt-issuer": "https://issuer.test",
       "nodeagent.io/auth-jwt-jwks-url": "https://issuer.test/jwks.json",
       "nodeagent.io/auth-jwt-audience": "shop, admin",
       "nodeagent.io/auth-jwt-claims": "groups=dev",
       "nodeagent.io/auth-jwt-leeway": "5"}


def htpasswd_secret(name: str = "users", key: str = "auth",
                    text: str = f"alice:{HASH}\n") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS}, "type": "nodeagent.io/htpasswd",
            "data": {key: base64.b64encode(text.encode()).decode()}}


def test_jwt_annotations_and_rate_limits_reach_every_rule() -> None:
    t = translate([ingress("s", [rule("a.test", path("/")), rule("b.test", path("/x"))],
                           annotations={**JWT, "nodeagent.io/rate-limit-rps": "50",
                                        "nodeagent.io/rate-limit-per-client-rps": "2",
                                        "nodeagent.io/auth-identity-header": "X-User"})])
    assert t.problems == ()
    for r in t.routes.rules:
        assert r.auth is not None and r.auth.jwt is not None
        assert r.auth.jwt.audiences == ("shop", "admin")
        assert r.auth.jwt.claims == {"groups": "dev"} and r.auth.jwt.leeway == 5
        assert r.auth.identity_header == "x-user"
        assert r.rate_limit is not None and (r.rate_limit.rate,
                                             r.rate_limit.per_client_rate) == (50, 2)


def test_basic_auth_from_a_secret_of_the_ingress_namespace() -> None:
    ann = {"nodeagent.io/auth-basic-secret": "users", "nodeagent.io/auth-basic-realm": "Shop"}
    t = translate([ingress("s", [rule("a.test", path("/"))], annotations=ann)],
                  secrets=[htpasswd_secret()])
    (r,) = t.routes.rules
    assert r.auth is not None and r.auth.basic is not None
    assert r.auth.basic.htpasswd == f"alice:{HASH}\n" and r.auth.basic.realm == "Shop"
    # The same name in another namespace is not read.
    other = dict(htpasswd_secret(), metadata={"name": "users", "namespace": "other"})
    t = translate([ingress("s", [rule("a.test", path("/"))], annotations=ann)],
                  secrets=[other])
    assert t.routes.rules == () and [p.reason for p in t.problems] == ["InvalidAuthOrLimits"]
    assert "not found" in t.problems[0].message


def test_bad_annotations_serve_nothing_and_say_why_without_secrets() -> None:
    cases = [
        ({**JWT, "nodeagent.io/auth-jwt-algorithms": "HS256"}, [], "algorithms"),
        ({"nodeagent.io/auth-jwt-issuer": "x"}, [], "audiences"),
        ({**JWT, "nodeagent.io/auth-basic-secret": "users"}, [htpasswd_secret()], "not both"),
        ({"nodeagent.io/auth-basic-secret": "users"},
         [htpasswd_secret(text="alice:$apr1$salt$hash")], "MD5"),
        ({"nodeagent.io/auth-basic-secret": "users"}, [htpasswd_secret(key="other")],
         "no `auth`"),
        ({"nodeagent.io/rate-limit-burst": "5"}, [], "rate"),
        ({"nodeagent.io/rate-limit-rps": "-1"}, [], "rate"),
    ]
    for given, secrets, word in cases:
        t = translate([ingress("s", [rule("a.test", path("/"))], annotations=given)],
                      secrets=secrets)
        assert t.routes.rules == (), given
        (problem,) = t.problems
        assert problem.reason == "InvalidAuthOrLimits" and word in problem.message, \
            problem.message
        assert "$apr1$salt" not in problem.message and HASH not in problem.message


def test_cluster_tunnel_defaults_fill_only_ingresses_without_their_own() -> None:
    from nodeagent.controller.clustertunnel import ClusterTunnelSpec
    from nodeagent.controller.ingressgate import with_cluster_defaults
    spec = ClusterTunnelSpec.model_validate({
        "ingressJwt": {"issuer": "https://corp.test", "jwks_url": "https://corp.test/jwks",
                       "audiences": ["apps"]},
        "ingressRateLimit": {"per_client_rate": 5}})
    own = {**JWT, "nodeagent.io/rate-limit-rps": "50"}
    t = translate([ingress("plain", [rule("a.test", path("/"))]),
                   ingress("own", [rule("b.test", path("/"))], annotations=own)])
    routes = with_cluster_defaults(t.routes, spec.ingress_jwt, spec.ingress_rate_limit)
    by_host = {r.host: r for r in routes.rules}
    plain, mine = by_host["a.test"], by_host["b.test"]
    assert plain.auth is not None and plain.auth.jwt is not None
    assert plain.auth.jwt.issuer == "https://corp.test"
    assert plain.rate_limit is not None and plain.rate_limit.per_client_rate == 5
    assert mine.auth is not None and mine.auth.jwt is not None
    assert mine.auth.jwt.issuer == "https://issuer.test"  # its own annotations win
    assert mine.rate_limit is not None and mine.rate_limit.rate == 50
    assert with_cluster_defaults(t.routes, None, None) is t.routes
