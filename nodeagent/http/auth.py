"""Who a request is: a JWT checked against a JWKS (`JwtAuthenticator`), or basic auth
against bcrypt hashes (`BasicAuthenticator`). Each `authenticate(headers)` returns the
identity (a string for the backend) or an `AuthFailure` (401 with its challenge, or 403
for a valid token whose claims do not allow the route), with a reason code the front
counts and logs. Neither ever puts a token, password or hash in a failure's message.

JWTs are verified by PyJWT (signature, `exp`/`nbf`/`iat` with the route's leeway, issuer,
audience, required claims); this module only picks the key (`jwks.JwksCache`) and maps
PyJWT's errors to reasons. Only the route's allowed algorithms are accepted, all of them
asymmetric (config.gateway), and the key is bound to the algorithm (PyJWT refuses a token
whose `alg` is not its key's). A token that passed is remembered (bounded) with its
validity window and the key set's generation: the same token again costs a dict probe and
a clock read, not a signature check (~200 µs here), until it expires or the keys change.

Basic auth compares with `bcrypt.checkpw` (constant time). bcrypt costs tens of ms of CPU
by design, which would stall every connection of the event loop, so it runs on a worker
thread (the one place the front uses threads: the library forces it), two at a time, and
refuses with 503 once 64 checks wait. A password that passed is remembered as an
HMAC-SHA256 under a per-process random key (never the password itself), so a client
that sends it on every request pays bcrypt once; an unknown user costs a bcrypt check
against a dummy hash like a known one, so timing does not tell which users exist.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import bcrypt
import jwt
import trio

from nodeagent.config.gateway import JwtAuth
from nodeagent.http.jwks import JwksCache

AuthReason = Literal["auth_missing", "auth_invalid", "auth_expired", "auth_unknown_key",
                     "auth_forbidden", "auth_unavailable"]


@dataclass(frozen=True, slots=True)
class AuthFailure:
    """Why a request is not let through: status 401 (with `challenge` for the
    WWW-Authenticate header), 403, or 503 when the check itself cannot run now."""

    status: int
    reason: AuthReason
    message: str
    challenge: str | None = None


Outcome = str | AuthFailure

_REMEMBERED_TOKENS = 10_000


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for n, v in headers:
        if n == name:
            return v
    return None


def _cookie(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for n, v in headers:
        if n == b"cookie":
            for part in v.split(b";"):
                key, sep, value = part.strip().partition(b"=")
                if sep and key == name:
                    return value
    return None


class JwtAuthenticator:
    """A route's JWT check (see the module docstring)."""

    kind: Literal["jwt"] = "jwt"  # what `gate` looks at instead of importing this module

    def __init__(self, config: JwtAuth, keys: JwksCache) -> None:
        self.config = config
        self.keys = keys
        self.algorithms = frozenset(config.algorithms)
        self.audiences = list(config.audiences)
        self.require = ["exp", "iss", "aud", *config.required_claims]
        self.cookie = config.cookie.encode() if config.cookie else None
        self.challenge = f'Bearer realm="{config.issuer[:100].replace(chr(34), "")}"'
        # token → (identity, key set generation, valid from, valid until): tokens that
        # passed, so a client sending the same one on every request pays PyJWT once.
        self._verified: dict[bytes, tuple[str, int, float, float]] = {}

    def _fail(self, reason: AuthReason, message: str, error: str | None = None) -> AuthFailure:
        challenge = self.challenge
        if error is not None:
            challenge += f', error="{error}"'
        return AuthFailure(401, reason, message, challenge)

    async def authenticate(self, headers: list[tuple[bytes, bytes]]) -> Outcome:
        token: bytes | None = None
        value = _header(headers, b"authorization")
        if value is not None:
            scheme, _, rest = value.partition(b" ")
            if scheme.lower() == b"bearer" and rest.strip():
                token = rest.strip()
        if token is None and self.cookie is not None:
            token = _cookie(headers, self.cookie)
        if token is None:
            return self._fail("auth_missing", "a bearer token is required")
        keys = self.keys
        known = self._verified.get(token)
        if known is not None and known[1] == keys.generation and not keys.stale():
            remembered, _, not_before, expires = known
            if not_before <= time.time() < expires:
                return remembered
        try:
            head = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            return self._fail("auth_invalid", "the token is not a JWT", "invalid_token")
        alg, kid = head.get("alg"), head.get("kid")
        if alg not in self.algorithms:
            return self._fail("auth_invalid", "the token's algorithm is not allowed",
                              "invalid_token")
        if kid is not None and not isinstance(kid, str):
            return self._fail("auth_invalid", "the token's kid is not a string",
                              "invalid_token")
        if keys.stale():
            await keys.refresh()
        key = keys.key(kid, alg)
        if key is None and (kid is None or kid not in keys.jwks):
            await keys.refresh()  # a rotation: the issuer may have a new key
            key = keys.key(kid, alg)
        if key is None:
            if not keys.jwks:
                return AuthFailure(503, "auth_unavailable",
                                   "the issuer's keys cannot be fetched now")
            return self._fail("auth_unknown_key", "the token is signed by an unknown key",
                              "invalid_token")
        config = self.config
        try:
            claims = jwt.decode(token, key, algorithms=[alg], audience=self.audiences,
                                issuer=config.issuer, leeway=config.leeway,
                                options={"require": self.require})
        except jwt.ExpiredSignatureError:
            return self._fail("auth_expired", "the token has expired", "invalid_token")
        except jwt.ImmatureSignatureError:
            return self._fail("auth_invalid", "the token is not valid yet", "invalid_token")
        except jwt.MissingRequiredClaimError as exc:
            return self._fail("auth_invalid", f"the token lacks the {exc.claim!r} claim",
                              "invalid_token")
        except jwt.InvalidAudienceError:
            return self._fail("auth_invalid", "the token is for another audience",
                              "invalid_token")
        except jwt.InvalidIssuerError:
            return self._fail("auth_invalid", "the token is from another issuer",
                              "invalid_token")
        except jwt.InvalidSignatureError:
            return self._fail("auth_invalid", "the token's signature does not verify",
                              "invalid_token")
        except (jwt.PyJWTError, ValueError, TypeError):
            return self._fail("auth_invalid", "the token is not valid", "invalid_token")
        for name, wanted in config.claims.items():
            if not _holds(claims.get(name), wanted):
                return AuthFailure(403, "auth_forbidden",
                                   f"the token's {name!r} claim does not allow this route")
        identity = claims.get(config.identity_claim)
        if not isinstance(identity, str | int) or isinstance(identity, bool):
            return self._fail("auth_invalid",
                              f"the token has no {config.identity_claim!r} claim",
                              "invalid_token")
        # Remembered while its exp (and nbf) allow, under this key set only: the same
        # token again skips the signature (config and claims cannot have changed).
        verified = self._verified
        if len(verified) >= _REMEMBERED_TOKENS:
            verified.clear()
        nbf = claims.get("nbf")
        verified[token] = (str(identity), keys.generation,
                           (nbf if isinstance(nbf, int | float) else 0) - config.leeway,
                           claims["exp"] + config.leeway)
        return str(identity)


def _holds(value: Any, wanted: str) -> bool:
    if isinstance(value, list):
        return wanted in value
    if isinstance(value, str) and " " in value:  # OAuth's space-separated scope
        return wanted in value.split(" ")
    return bool(value == wanted)


@functools.cache
def _dummy_hash() -> bytes:
    """A bcrypt hash of random bytes nobody knows: unknown users are checked against it."""
    return bcrypt.hashpw(os.urandom(16), bcrypt.gensalt(10))


_MAX_WAITING = 64
_REMEMBERED = 4096
# Two bcrypt checks at once per process (the machine's CPUs, not the event loop's).
_BCRYPT_THREADS = trio.CapacityLimiter(2)


class BasicAuthenticator:
    """A route's basic auth (see the module docstring)."""

    kind: Literal["basic"] = "basic"

    def __init__(self, users: dict[str, bytes], realm: str,
                 limiter: trio.CapacityLimiter | None = None) -> None:
        self.users = users
        self.challenge = f'Basic realm="{realm}", charset="UTF-8"'
        self._key = os.urandom(32)
        self._passed: dict[bytes, str] = {}
        self._limiter = limiter

    def _fail(self, reason: AuthReason, message: str) -> AuthFailure:
        return AuthFailure(401, reason, message, self.challenge)

    async def authenticate(self, headers: list[tuple[bytes, bytes]]) -> Outcome:
        value = _header(headers, b"authorization")
        if value is None:
            return self._fail("auth_missing", "a user name and password are required")
        scheme, _, encoded = value.partition(b" ")
        if scheme.lower() != b"basic":
            return self._fail("auth_missing", "a user name and password are required")
        try:
            raw = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            return self._fail("auth_invalid", "the credentials are not base64")
        user_bytes, sep, password = raw.partition(b":")
        if not sep:
            return self._fail("auth_invalid", "the credentials are not user:password")
        mac = hmac.new(self._key, raw, hashlib.sha256).digest()
        user = self._passed.get(mac)
        if user is not None:
            return user
        name = user_bytes.decode("utf-8", "replace")
        hashed = self.users.get(name)
        limiter = self._limiter or _BCRYPT_THREADS
        if limiter.statistics().tasks_waiting >= _MAX_WAITING:
            return AuthFailure(503, "auth_unavailable", "too many password checks waiting")
        # bcrypt takes at most 72 bytes; checkpw raises beyond, so longer ones fail here.
        ok = len(password) <= 72 and await trio.to_thread.run_sync(
            bcrypt.checkpw, password, hashed if hashed is not None else _dummy_hash(),
            limiter=limiter)
        if not ok or hashed is None:
            return self._fail("auth_invalid", "wrong user name or password")
        if len(self._passed) >= _REMEMBERED:
            self._passed.clear()
        self._passed[mac] = name
        return name


__all__ = ["AuthFailure", "AuthReason", "BasicAuthenticator", "JwtAuthenticator", "Outcome"]
