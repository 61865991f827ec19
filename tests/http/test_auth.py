"""Authentication at the front: JWTs against a JWKS (rotation, rate-limited refetch,
claims, algorithms), basic auth against bcrypt hashes, and the gate on real sockets
(HTTP/1.1 and HTTP/2: 401 with WWW-Authenticate, 403, the identity header a client
cannot forge, gRPC statuses)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import bcrypt
import httpx
import jwt
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from nodeagent.config import ConfigError, JwtAuth, RouteAuth, parse_htpasswd, redacted
from nodeagent.config.gateway import BasicAuth
from nodeagent.http import Backend, Route, RouteSpec
from nodeagent.http.auth import AuthFailure, BasicAuthenticator, JwtAuthenticator
from nodeagent.http.gate import GateRegistry
from nodeagent.http.jwks import JwksCache, JwksError, cache_seconds, read_key_set
from tests.http.helpers import Upstream, running_front, start_tcp

ISSUER = "https://issuer.test"


class Issuer:
    """Signing keys and the JWKS they publish; `rotate()` adds a new key and drops the old."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, rsa.RSAPrivateKey]] = []
        self.fetches = 0
        self.fail = False
        self.cache_control: str | None = "max-age=300"
        self.rotate()

    def rotate(self) -> None:
        kid = f"k{len(self.keys) + 1}"
        self.keys = [(kid, rsa.generate_private_key(public_exponent=65537, key_size=2048))]

    def jwks(self) -> bytes:
        out = []
        for kid, key in self.keys:
            jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
            out.append({**jwk, "kid": kid, "use": "sig"})
        return json.dumps({"keys": out}).encode()

    async def fetch(self, url: str) -> tuple[bytes, str | None]:
        self.fetches += 1
        if self.fail:
            raise JwksError("HTTP 500")
        return self.jwks(), self.cache_control

    def token(self, **claims: Any) -> str:
        kid, key = self.keys[0]
        now = int(time.time())
        body = {"iss": ISSUER, "aud": "app", "sub": "alice", "exp": now + 60, "iat": now,
                **claims}
        body = {k: v for k, v in body.items() if v is not None}
        return jwt.encode(body, key, algorithm="RS256", headers={"kid": kid})


def jwt_config(**kwargs: Any) -> JwtAuth:
    return JwtAuth(issuer=ISSUER, jwks_url="http://jwks.test/keys", audiences=("app",),
                   **kwargs)


def authenticator(issuer: Issuer, **kwargs: Any) -> JwtAuthenticator:
    config = jwt_config(**kwargs)
    cache = JwksCache(config.jwks_url, config.jwks_max_age, config.jwks_min_refetch,
                      issuer.fetch)
    return JwtAuthenticator(config, cache)


def bearer(token: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", b"Bearer " + token.encode())]


async def test_a_valid_token_passes_with_its_subject() -> None:
    issuer = Issuer()
    auth = authenticator(issuer)
    assert await auth.authenticate(bearer(issuer.token())) == "alice"
    assert await auth.authenticate(bearer(issuer.token(sub="bob"))) == "bob"
    assert issuer.fetches == 1  # the key set is cached


# Times are offsets from when the test runs, not from collection: a whole suite runs for
# many minutes, and "nbf 10 minutes ahead" taken at collection is in the past by then.
@pytest.mark.parametrize(("claims", "reason", "status"), [
    ({"exp": -120}, "auth_expired", 401),
    ({"aud": "other"}, "auth_invalid", 401),
    ({"iss": "https://evil.test"}, "auth_invalid", 401),
    ({"exp": None}, "auth_invalid", 401),
    ({"nbf": 600}, "auth_invalid", 401),
])
async def test_bad_claims_are_refused(claims: dict[str, Any], reason: str, status: int) -> None:
    now = int(time.time())
    claims = {k: now + v if k in ("exp", "nbf") and v is not None else v
              for k, v in claims.items()}
    issuer = Issuer()
    out = await authenticator(issuer).authenticate(bearer(issuer.token(**claims)))
    assert isinstance(out, AuthFailure) and (out.reason, out.status) == (reason, status)
    assert out.challenge is not None and out.challenge.startswith("Bearer ")


async def test_clock_skew_within_leeway_passes() -> None:
    issuer = Issuer()
    token = issuer.token(exp=int(time.time()) - 10)
    assert await authenticator(issuer, leeway=30).authenticate(bearer(token)) == "alice"
    out = await authenticator(issuer, leeway=0).authenticate(bearer(token))
    assert isinstance(out, AuthFailure) and out.reason == "auth_expired"


async def test_required_and_valued_claims() -> None:
    issuer = Issuer()
    auth = authenticator(issuer, required_claims=("email",), claims={"groups": "admin"})
    out = await auth.authenticate(bearer(issuer.token(groups=["admin"])))
    assert isinstance(out, AuthFailure) and out.status == 401  # no email
    out = await auth.authenticate(bearer(issuer.token(email="a@x", groups=["dev"])))
    assert isinstance(out, AuthFailure) and (out.status, out.reason) == (403, "auth_forbidden")
    assert await auth.authenticate(bearer(issuer.token(email="a@x", groups=["dev", "admin"]))
                                   ) == "alice"


async def test_missing_and_garbage_tokens() -> None:
    issuer = Issuer()
    auth = authenticator(issuer)
    for headers in ([], [(b"authorization", b"Basic eDp5")], bearer("")):
        out = await auth.authenticate(headers)
        assert isinstance(out, AuthFailure) and out.reason == "auth_missing"
    for token in ("x", "a.b.c", "\x00" * 50, "e30.e30.", "." * 5000):
        out = await auth.authenticate(bearer(token))
        assert isinstance(out, AuthFailure) and out.reason == "auth_invalid"


async def test_alg_none_and_hs256_with_the_public_key_are_refused() -> None:
    issuer = Issuer()
    auth = authenticator(issuer)
    claims = {"iss": ISSUER, "aud": "app", "sub": "mallory", "exp": int(time.time()) + 60}
    none = jwt.encode(claims, None, algorithm="none", headers={"kid": "k1"})
    out = await auth.authenticate(bearer(none))
    assert isinstance(out, AuthFailure) and out.reason == "auth_invalid"
    # The classic confusion: an HMAC token keyed with the issuer's public key.
    pem = issuer.keys[0][1].public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    header = base64.urlsafe_b64encode(b'{"alg":"HS256","kid":"k1","typ":"JWT"}').rstrip(b"=")
    payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=")
    import hashlib
    import hmac
    sig = base64.urlsafe_b64encode(hmac.new(pem, header + b"." + payload, hashlib.sha256)
                                   .digest()).rstrip(b"=")
    out = await auth.authenticate(bearer((header + b"." + payload + b"." + sig).decode()))
    assert isinstance(out, AuthFailure) and out.reason == "auth_invalid"
    with pytest.raises(ValueError):
        jwt_config(algorithms=("HS256",))  # not even configurable


async def test_a_token_signed_by_another_key_with_the_same_kid_fails() -> None:
    issuer, impostor = Issuer(), Issuer()
    out = await authenticator(issuer).authenticate(bearer(impostor.token()))
    assert isinstance(out, AuthFailure) and out.reason == "auth_invalid"


async def test_an_ec_key_in_the_set_and_a_key_of_another_type() -> None:
    issuer = Issuer()
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ec_jwk = {**json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec_key.public_key())),
              "kid": "e1"}
    rsa_doc = json.loads(issuer.jwks())

    async def fetch(url: str) -> tuple[bytes, str | None]:
        return json.dumps({"keys": [*rsa_doc["keys"], ec_jwk]}).encode(), None

    config = jwt_config()
    auth = JwtAuthenticator(config, JwksCache(config.jwks_url, fetch=fetch))
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": "app", "sub": "eve", "exp": now + 60}
    assert await auth.authenticate(bearer(jwt.encode(claims, ec_key, algorithm="ES256",
                                                     headers={"kid": "e1"}))) == "eve"
    # ES256 claimed with the RSA key's kid: the key is bound to RSA.
    out = await auth.authenticate(bearer(jwt.encode(claims, ec_key, algorithm="ES256",
                                                    headers={"kid": "k1"})))
    assert isinstance(out, AuthFailure)


async def test_rotation_refetches_on_an_unknown_kid_at_most_once_per_min_refetch(
        autojump_clock: trio.testing.MockClock) -> None:
    issuer = Issuer()
    auth = authenticator(issuer, jwks_min_refetch=10)
    old = issuer.token()
    assert await auth.authenticate(bearer(old)) == "alice"
    assert issuer.fetches == 1
    issuer.rotate()
    new = issuer.token()
    # The first fetch was just now: an unknown kid waits for min_refetch.
    out = await auth.authenticate(bearer(new))
    assert isinstance(out, AuthFailure) and out.reason == "auth_unknown_key"
    await trio.sleep(11)
    assert await auth.authenticate(bearer(new)) == "alice"
    assert issuer.fetches == 2
    # A flood of made-up kids: one fetch per min_refetch, not one per request.
    for i in range(50):
        forged = jwt.encode({"iss": ISSUER, "aud": "app", "sub": "x",
                             "exp": int(time.time()) + 60}, issuer.keys[0][1],
                            algorithm="RS256", headers={"kid": f"nope{i}"})
        out = await auth.authenticate(bearer(forged))
        assert isinstance(out, AuthFailure) and out.reason == "auth_unknown_key"
    assert issuer.fetches == 2
    # The old key is gone from the set (it was rotated out).
    await trio.sleep(11)
    out = await auth.authenticate(bearer(old))
    assert isinstance(out, AuthFailure) and out.reason == "auth_unknown_key"


async def test_the_set_expires_by_max_age_and_a_failed_fetch_keeps_the_keys(
        autojump_clock: trio.testing.MockClock) -> None:
    issuer = Issuer()
    issuer.cache_control = "public, max-age=60"
    auth = authenticator(issuer, jwks_min_refetch=5, jwks_max_age=3600)
    assert await auth.authenticate(bearer(issuer.token())) == "alice"
    await trio.sleep(30)
    assert await auth.authenticate(bearer(issuer.token())) == "alice"
    assert issuer.fetches == 1
    await trio.sleep(31)
    issuer.fail = True
    assert await auth.authenticate(bearer(issuer.token())) == "alice"  # stale keys kept
    assert issuer.fetches == 2 and auth.keys.last_error == "HTTP 500"
    assert await auth.authenticate(bearer(issuer.token())) == "alice"
    assert issuer.fetches == 2  # not retried before min_refetch


async def test_no_keys_at_all_is_503() -> None:
    issuer = Issuer()
    issuer.fail = True
    out = await authenticator(issuer).authenticate(bearer(issuer.token()))
    assert isinstance(out, AuthFailure) and (out.status, out.reason) == (503,
                                                                         "auth_unavailable")


def test_cache_seconds_and_key_sets() -> None:
    assert cache_seconds(None, min_refetch=10, max_age=300) == 300
    assert cache_seconds("max-age=60", min_refetch=10, max_age=300) == 60
    assert cache_seconds("public, max-age=99999", min_refetch=10, max_age=300) == 300
    assert cache_seconds("max-age=1", min_refetch=10, max_age=300) == 10
    assert cache_seconds("no-store", min_refetch=10, max_age=300) == 10
    keys = read_key_set(json.dumps({"keys": [
        {"kty": "oct", "k": "c2VjcmV0", "kid": "h"},
        {"kty": "RSA", "use": "enc", "n": "x", "e": "AQAB", "kid": "enc"},
        {"kty": "EC", "crv": "P-256", "x": "a", "y": "b", "kid": "e"}]}).encode())
    assert list(keys) == ["e"]
    for body in (b"nope", b"[]", b'{"keys": [{"kty": "oct", "k": "eA"}]}'):
        with pytest.raises(JwksError):
            read_key_set(body)


# -------------------------------------------------------------------- basic auth

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()


def basic(user: str, password: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", b"Basic " + base64.b64encode(f"{user}:{password}".encode()))]


async def test_basic_auth() -> None:
    auth = BasicAuthenticator(parse_htpasswd(f"alice:{HASH}\n# comment\n"), "r")
    assert await auth.authenticate(basic("alice", "s3cret")) == "alice"
    assert await auth.authenticate(basic("alice", "s3cret")) == "alice"  # remembered
    for headers in (basic("alice", "wrong"), basic("bob", "s3cret"),
                    basic("alice", "x" * 100), [(b"authorization", b"Basic !!!")],
                    [(b"authorization", b"Basic " + base64.b64encode(b"nocolon"))]):
        out = await auth.authenticate(headers)
        assert isinstance(out, AuthFailure) and out.reason == "auth_invalid"
        assert out.challenge == 'Basic realm="r", charset="UTF-8"'
    out = await auth.authenticate([])
    assert isinstance(out, AuthFailure) and out.reason == "auth_missing"


def test_htpasswd_takes_only_bcrypt_and_never_echoes_a_hash() -> None:
    for line, word in (("a:$apr1$abc$def", "MD5"), ("a:{SHA}abcd", "SHA-1"),
                       ("a:plain", "not bcrypt"), ("nocolon", "user:hash")):
        with pytest.raises(ValueError, match=word) as info:
            parse_htpasswd(line)
        assert "abc" not in str(info.value) and "plain" not in str(info.value)
    with pytest.raises(ValueError, match="twice"):
        parse_htpasswd(f"a:{HASH}\na:{HASH}")
    auth = RouteAuth(basic=BasicAuth(htpasswd=f"alice:{HASH}"))
    assert HASH not in repr(auth)
    assert HASH not in json.dumps(redacted(auth.model_dump(mode="json")))


def test_a_missing_htpasswd_file_is_a_config_error(tmp_path: Any) -> None:
    from nodeagent.config import HttpListener
    from nodeagent.server.routetables import build_route_table
    listener = HttpListener.model_validate({"listen": "127.0.0.1:0", "routes": [{
        "target": "127.0.0.1:1", "auth": {"basic": {"htpasswd_file": str(tmp_path / "no")}}}]})
    with pytest.raises(ConfigError, match="htpasswd_file"):
        build_route_table(listener)


# -------------------------------------------------------------------- the gate on sockets


async def test_gated_route_over_http1_and_h2(nursery: trio.Nursery) -> None:
    issuer = Issuer()
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    gates = GateRegistry()
    gates.jwks.fetch = issuer.fetch
    gate = gates.gate("secure", RouteAuth(jwt=jwt_config()), None)
    open_gate = gates.gate("users", RouteAuth(basic=BasicAuth(htpasswd=f"alice:{HASH}"),
                                              identity_header="x-user"), None)
    specs = [RouteSpec(None, "/secure", Route("secure", (Backend(None, "127.0.0.1", port),),
                                               gate=gate)),
             RouteSpec(None, "/users", Route("users", (Backend(None, "127.0.0.1", port),),
                                              gate=open_gate)),
             RouteSpec(None, "/open", Route("open", (Backend(None, "127.0.0.1", port),)))]
    forged = {"x-nodeagent-identity": "root", "x-forwarded-user": "root", "x-user": "root"}
    async with running_front(specs) as f:
        for http2 in (False, True):
            async with httpx.AsyncClient(trust_env=False, timeout=10, http1=not http2,
                                         http2=http2) as c:
                r = await c.get(f"{f.url}/secure/x", headers=forged)
                assert r.status_code == 401, r.text
                assert r.headers["www-authenticate"] == f'Bearer realm="{ISSUER}"'
                assert "401 Unauthorized: route secure: a bearer token is required" in r.text
                r = await c.get(f"{f.url}/secure/x", headers={
                    **forged, "authorization": "Bearer " + issuer.token(sub="bob")})
                assert r.status_code == 200
                seen = dict((k.lower(), v) for k, v in r.json()["headers"])
                assert seen["x-nodeagent-identity"] == "bob"
                assert "x-forwarded-user" not in seen
                assert seen["x-user"] == "root"  # another route's identity header
                assert seen["authorization"].startswith("Bearer ")  # for the backend
                r = await c.get(f"{f.url}/users", headers=forged, auth=("alice", "nope"))
                assert r.status_code == 401
                assert r.headers["www-authenticate"].startswith('Basic realm="nodeagent"')
                r = await c.get(f"{f.url}/users", headers=forged, auth=("alice", "s3cret"))
                assert r.status_code == 200
                seen = dict((k.lower(), v) for k, v in r.json()["headers"])
                assert seen["x-user"] == "alice" and "authorization" not in seen
                assert "x-nodeagent-identity" not in seen
                r = await c.get(f"{f.url}/open", headers=forged)
                seen = dict((k.lower(), v) for k, v in r.json()["headers"])
                assert r.status_code == 200 and "x-nodeagent-identity" not in seen
                assert "x-forwarded-user" not in seen
        async with httpx.AsyncClient(trust_env=False, timeout=10, http1=False,
                                     http2=True) as c:
            grpc = {"content-type": "application/grpc", "te": "trailers"}
            r = await c.post(f"{f.url}/secure/svc/M", content=b"\0" * 5, headers=grpc)
            assert r.status_code == 200 and r.headers["grpc-status"] == "16"  # UNAUTHENTICATED
            assert "bearer%20token" in r.headers["grpc-message"].lower() or \
                "bearer token" in r.headers["grpc-message"]
        stats = f.front.stats
        assert stats.refused_auth_missing == 3 and stats.refused_auth_invalid == 2
        assert gate is not None and gate.as_dict()["refused"] == {"auth_missing": 3}
        assert gate.as_dict()["passed"] == 2


async def test_a_gated_route_without_backends_asks_for_credentials_first(
        nursery: trio.Nursery) -> None:
    gates = GateRegistry()
    gate = gates.gate("empty", RouteAuth(basic=BasicAuth(htpasswd=f"alice:{HASH}")), None)
    async with running_front([RouteSpec(None, "/", Route("empty", (), gate=gate))]) as f, \
            httpx.AsyncClient(trust_env=False, timeout=10) as c:
        assert (await c.get(f"{f.url}/")).status_code == 401
        assert (await c.get(f"{f.url}/", auth=("alice", "s3cret"))).status_code == 503


async def test_a_token_that_passed_is_remembered_within_its_validity_and_key_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    issuer = Issuer()
    auth = authenticator(issuer, leeway=5)
    token = issuer.token()
    assert await auth.authenticate(bearer(token)) == "alice"
    calls = []
    real_decode = jwt.decode
    monkeypatch.setattr(jwt, "decode", lambda *a, **k: calls.append(1) or real_decode(*a, **k))
    assert await auth.authenticate(bearer(token)) == "alice"
    assert calls == []  # no signature check for the same token again
    # Past its exp + leeway, the remembered entry no longer answers: PyJWT checks again.
    exp = real_decode(token, options={"verify_signature": False})["exp"]
    monkeypatch.setattr(time, "time", lambda: exp + 6)
    await auth.authenticate(bearer(token))
    assert calls == [1]


@pytest.mark.needs("htpasswd")
async def test_a_file_apaches_htpasswd_wrote(tmp_path: Any) -> None:
    path = tmp_path / "users"
    await trio.run_process(["htpasswd", "-B", "-C", "4", "-b", "-c", str(path), "alice",
                            "pw one"], capture_stdout=True, capture_stderr=True)
    await trio.run_process(["htpasswd", "-B", "-C", "4", "-b", str(path), "bob", "two"],
                           capture_stdout=True, capture_stderr=True)
    auth = BasicAuthenticator(parse_htpasswd(path.read_text()), "r")
    assert await auth.authenticate(basic("alice", "pw one")) == "alice"
    assert await auth.authenticate(basic("bob", "two")) == "bob"
    assert isinstance(await auth.authenticate(basic("bob", "pw one")), AuthFailure)
    md5 = tmp_path / "md5"
    await trio.run_process(["htpasswd", "-m", "-b", "-c", str(md5), "carol", "x"],
                           capture_stdout=True, capture_stderr=True)
    with pytest.raises(ValueError, match="MD5"):
        parse_htpasswd(md5.read_text())
