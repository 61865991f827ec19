"""JSON Web Key Sets the front checks JWTs against: fetched with httpx, cached, rotated.

One `JwksCache` per JWKS URL (`JwksStore` shares them between routes and keeps them across
route-table rebuilds). The set is fetched on first use, again once it expires (the
response's `Cache-Control: max-age`, clamped to [`min_refetch`, `max_age`]), and at once
when a token names a key id the set does not hold (the issuer rotated its keys), but at
most once per `min_refetch` seconds whatever tokens arrive: a flood of made-up key ids
costs one fetch, not one per request. Concurrent requests share one fetch in flight. A
failed fetch keeps the keys it had (an issuer's outage does not log everyone out) and is
not retried for `min_refetch`.

Only public signing keys are kept: a symmetric (`oct`) key or one marked for encryption is
dropped, so an HS* token can never be checked against a JWKS entry. Keys are parsed by
PyJWT (`PyJWK`), bound to one algorithm each: the JWK's own `alg`, or for a JWK without
one, the token's (among the route's allowed ones), memoised per key and algorithm.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import jwt
import trio

from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.http.jwks")

MAX_JWKS_BYTES = 1 << 20
"""A key set larger than this is refused (a real one is a few KiB)."""
FETCH_TIMEOUT = 5.0

_MAX_AGE = re.compile(r"(?:^|,)\s*max-age\s*=\s*\"?([0-9]{1,9})", re.IGNORECASE)
_NO_CACHE = re.compile(r"(?:^|,)\s*(no-cache|no-store)\b", re.IGNORECASE)

Fetcher = Callable[[str], Awaitable[tuple[bytes, str | None]]]
"""url → (body, Cache-Control value or None); raises JwksError."""


class JwksError(Exception):
    """The key set could not be fetched or read (the message names no key material)."""


async def fetch_jwks(url: str) -> tuple[bytes, str | None]:
    """GET `url` with httpx: the body (at most MAX_JWKS_BYTES) and its Cache-Control."""
    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT, follow_redirects=False) as client, \
                client.stream("GET", url, headers={"accept": "application/json"}) as resp:
            if resp.status_code != 200:
                raise JwksError(f"HTTP {resp.status_code}")
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > MAX_JWKS_BYTES:
                    raise JwksError(f"key set over {MAX_JWKS_BYTES} bytes")
            return bytes(body), resp.headers.get("cache-control")
    except httpx.HTTPError as exc:
        raise JwksError(f"{type(exc).__name__}: {exc}") from None


def cache_seconds(cache_control: str | None, *, min_refetch: float, max_age: float) -> float:
    """How long a fetched set is fresh: its max-age clamped to [min_refetch, max_age]."""
    if cache_control is None:
        return max_age
    if _NO_CACHE.search(cache_control):
        return min_refetch
    m = _MAX_AGE.search(cache_control)
    if m is None:
        return max_age
    return min(max(float(m.group(1)), min_refetch), max_age)


def read_key_set(body: bytes) -> dict[str, dict[str, Any]]:
    """kid → JWK of the public signing keys in a JWKS document ("" for a key without
    kid). JwksError when it is not one or holds no usable key."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise JwksError("not JSON") from None
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list):
        raise JwksError("no keys array")
    out: dict[str, dict[str, Any]] = {}
    for jwk in keys:
        if not isinstance(jwk, dict) or jwk.get("kty") not in ("RSA", "EC", "OKP"):
            continue  # oct (symmetric) keys never verify anything here
        if jwk.get("use", "sig") != "sig" or "d" in jwk:
            continue  # an encryption key, or a private key published by mistake
        kid = jwk.get("kid", "")
        if isinstance(kid, str):
            out.setdefault(kid, jwk)
    if not out:
        raise JwksError("no public signing key in the set")
    return out


@dataclass
class JwksCache:
    """The keys of one JWKS URL (see the module docstring)."""

    url: str
    max_age: float = 300.0
    min_refetch: float = 10.0
    fetch: Fetcher = fetch_jwks
    clock: Callable[[], float] = trio.current_time
    jwks: dict[str, dict[str, Any]] = field(default_factory=dict)
    expires: float = float("-inf")
    last_attempt: float = float("-inf")
    last_error: str | None = None
    fetches: int = 0
    failures: int = 0
    generation: int = 0
    """Bumped whenever the set's keys change (what checked tokens are remembered under)."""
    _bound: dict[tuple[str, str], jwt.PyJWK | None] = field(default_factory=dict)
    _inflight: trio.Event | None = None

    def key(self, kid: str | None, alg: str) -> jwt.PyJWK | None:
        """The key `kid` bound to `alg`, or None (unknown kid, or a key for another
        algorithm). A token without kid uses the set's only key, if it has one."""
        if kid is None:
            if len(self.jwks) != 1:
                return None
            kid = next(iter(self.jwks))
        memo = (kid, alg)
        bound = self._bound.get(memo, False)
        if bound is not False:
            return bound  # type: ignore[return-value]
        jwk = self.jwks.get(kid)
        if jwk is None:
            return None
        try:
            bound = jwt.PyJWK(jwk, algorithm=jwk.get("alg") or alg)
        except jwt.PyJWTError:
            bound = None
        if bound is not None and bound.algorithm_name != alg:
            bound = None
        self._bound[memo] = bound
        return bound

    def stale(self) -> bool:
        return self.clock() >= self.expires

    async def refresh(self) -> None:
        """Fetch the set unless one was tried in the last `min_refetch` seconds; waits
        for a fetch already in flight instead of starting another."""
        if self._inflight is not None:
            await self._inflight.wait()
            return
        now = self.clock()
        if now - self.last_attempt < self.min_refetch:
            return
        self.last_attempt = now
        done = self._inflight = trio.Event()
        try:
            self.fetches += 1
            try:
                body, cache_control = await self.fetch(self.url)
                jwks = read_key_set(body)
            except JwksError as exc:
                self.failures += 1
                self.last_error = str(exc)
                self.expires = self.clock() + self.min_refetch
                log.warning("jwks fetch failed", url=self.url, error=str(exc),
                            keys_kept=len(self.jwks))
                return
            if jwks != self.jwks:
                self.generation += 1
            self.jwks, self._bound, self.last_error = jwks, {}, None
            self.expires = self.clock() + cache_seconds(
                cache_control, min_refetch=self.min_refetch, max_age=self.max_age)
            log.info("jwks fetched", url=self.url, keys=len(jwks))
        finally:
            self._inflight = None
            done.set()

    def as_dict(self) -> dict[str, Any]:
        now = self.clock()
        return {"url": self.url, "key_ids": sorted(self.jwks),
                "fresh_for_seconds": round(self.expires - now, 1)
                if self.expires > now else 0,
                "fetches": self.fetches, "failures": self.failures,
                "last_error": self.last_error}


class JwksStore:
    """The JWKS caches by URL and settings, shared by every route that names them."""

    def __init__(self, fetch: Fetcher = fetch_jwks) -> None:
        self.fetch = fetch
        self.caches: dict[tuple[str, float, float], JwksCache] = {}

    def cache(self, url: str, *, max_age: float, min_refetch: float) -> JwksCache:
        key = (url, max_age, min_refetch)
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = JwksCache(url, max_age, min_refetch, self.fetch)
        return cache

    def keep_only(self, used: set[tuple[str, float, float]]) -> None:
        """Forget the caches no route names any more."""
        for key in list(self.caches):
            if key not in used:
                del self.caches[key]


__all__ = ["JwksCache", "JwksError", "JwksStore", "cache_seconds", "fetch_jwks",
           "read_key_set"]
