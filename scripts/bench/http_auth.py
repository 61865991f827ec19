"""What authentication costs at the HTTP front: the per-request cost of a JWT check with
a cached key (µs, in process), and wrk through one front process to an open route and
to a JWT-gated one, in the same run.

From the repository root (the HTTP part needs wrk):

    .venv/bin/python -m scripts.bench.http_auth [--rounds 3] [--seconds 3]

Micro: `JwtAuthenticator.authenticate` (RS256 2048-bit, ES256) for tokens new to the
front (the signature checked with the cached key) and for a token sent again
(remembered), and the remembered path of basic auth, median of --rounds batches.
HTTP: one upstream process (fixed 1 KiB answer), one front process with both routes, wrk
(keep-alive, 16 connections) against /open and /jwt (a valid RS256 bearer token),
interleaved for --rounds rounds; prints the front's CPU µs per request for each and the
ratio jwt/open per round (median and min-max): CPU per request is steadier than req/s on
a shared machine.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import re
import statistics
import subprocess
import time
from typing import Any

import bcrypt
import jwt
import trio
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from nodeagent.config import JwtAuth, RouteAuth
from nodeagent.http import Backend, HttpFront, Route, RouteSpec, RouteTable
from nodeagent.http.auth import BasicAuthenticator, JwtAuthenticator
from nodeagent.http.gate import GateRegistry
from nodeagent.http.jwks import JwksCache
from scripts.bench.http_front import _cpu_seconds, _run_upstream, open_direct

ISSUER = "https://issuer.bench"
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())


def _jwks() -> bytes:
    keys = [{**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(RSA_KEY.public_key())),
             "kid": "r"},
            {**json.loads(jwt.algorithms.ECAlgorithm.to_jwk(EC_KEY.public_key())),
             "kid": "e"}]
    return json.dumps({"keys": keys}).encode()


async def _fetch(url: str) -> tuple[bytes, str | None]:
    return _jwks(), None


def _token(key: Any, alg: str, kid: str, jti: int = 0) -> str:
    claims = {"iss": ISSUER, "aud": "bench", "sub": "bench-user",
              "exp": int(time.time()) + 3600, "jti": str(jti)}
    return jwt.encode(claims, key, algorithm=alg, headers={"kid": kid})


def _config() -> JwtAuth:
    return JwtAuth(issuer=ISSUER, jwks_url="http://jwks.bench/keys", audiences=("bench",))


async def _micro(rounds: int, n: int) -> None:
    config = _config()
    auth = JwtAuthenticator(config, JwksCache(config.jwks_url, fetch=_fetch))
    for name, key, alg, kid in (("RS256 (2048)", RSA_KEY, "RS256", "r"),
                                ("ES256", EC_KEY, "ES256", "e")):
        # Each token new to the front: the signature is checked with the cached key.
        tokens = [[(b"authorization", f"Bearer {_token(key, alg, kid, i)}".encode())]
                  for i in range(rounds * n // 4 + 1)]
        assert await auth.authenticate(tokens.pop()) == "bench-user"  # fetch the keys
        per = []
        for r in range(rounds):
            batch = tokens[r * (n // 4):(r + 1) * (n // 4)]
            t = time.perf_counter()
            for headers in batch:
                await auth.authenticate(headers)
            per.append((time.perf_counter() - t) / len(batch) * 1e6)
        print(f"{'JWT ' + name + ', new':20s} {statistics.median(per):7.1f} µs/request "
              f"(min {min(per):.1f}, max {max(per):.1f}; {rounds} x {n // 4})")
    cases: list[tuple[str, Any, list[tuple[bytes, bytes]]]] = []
    for name, key, alg, kid in (("RS256 (2048)", RSA_KEY, "RS256", "r"),
                                ("ES256", EC_KEY, "ES256", "e")):
        cases.append((f"JWT {name}, again", auth,
                      [(b"authorization", f"Bearer {_token(key, alg, kid)}".encode())]))
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(10))
    basic = BasicAuthenticator({"u": hashed}, "bench")
    cases.append(("basic, remembered", basic,
                  [(b"authorization", b"Basic " + base64.b64encode(b"u:pw"))]))
    for label, authenticator, headers in cases:
        assert await authenticator.authenticate(headers) in ("bench-user", "u")  # warm
        per = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(n):
                await authenticator.authenticate(headers)
            per.append((time.perf_counter() - t) / n * 1e6)
        print(f"{label:20s} {statistics.median(per):7.1f} µs/request "
              f"(min {min(per):.1f}, max {max(per):.1f}; {rounds} x {n})")
    t = time.perf_counter()
    ok = await basic.authenticate([(b"authorization", b"Basic " + base64.b64encode(b"u:no"))])
    print(f"{'basic, bcrypt cost 10':20s} {(time.perf_counter() - t) * 1e3:7.1f} ms "
          f"(a password not yet seen; on a worker thread) -> {type(ok).__name__}")


def _run_front(port: int, upstream_port: int) -> None:
    gates = GateRegistry()
    gates.jwks.fetch = _fetch
    backend = (Backend(None, "127.0.0.1", upstream_port),)
    gate = gates.gate("jwt", RouteAuth(jwt=_config()), None)
    table = RouteTable.build([RouteSpec(None, "/open", Route("open", backend)),
                              RouteSpec(None, "/jwt", Route("jwt", backend, gate=gate))])
    front = HttpFront(table=lambda: table, open_upstream=open_direct)
    trio.run(front.run, "127.0.0.1", port)


def _wrk(url: str, seconds: int, header: str | None) -> float:
    cmd = ["wrk", "-t1", "-c16", f"-d{seconds}s"]
    if header:
        cmd += ["-H", header]
    out = subprocess.run([*cmd, url], capture_output=True, text=True, check=True).stdout
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if non2xx:
        raise SystemExit(f"{url}: {non2xx.group(1)} non-2xx answers")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]


def _http(rounds: int, seconds: int) -> None:
    up_port, front_port = 18181, 18180
    procs = [multiprocessing.Process(target=_run_upstream, args=(up_port,), daemon=True),
             multiprocessing.Process(target=_run_front, args=(front_port, up_port),
                                     daemon=True)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    token = _token(RSA_KEY, "RS256", "r")
    pid = procs[1].pid or 0
    cpu: dict[str, list[float]] = {"open": [], "jwt": []}
    rps: dict[str, list[float]] = {"open": [], "jwt": []}
    try:
        for _ in range(rounds):
            for name, header in (("open", None), ("jwt", f"Authorization: Bearer {token}")):
                before = _cpu_seconds(pid)
                r = _wrk(f"http://127.0.0.1:{front_port}/{name}", seconds, header)
                cpu[name].append((_cpu_seconds(pid) - before) / (r * seconds) * 1e6)
                rps[name].append(r)
    finally:
        for p in procs:
            p.terminate()
    for name in ("open", "jwt"):
        print(f"front, {name:4s} route: {statistics.median(cpu[name]):5.0f} µs CPU/request "
              f"(min {min(cpu[name]):.0f}, max {max(cpu[name]):.0f}), "
              f"{statistics.median(rps[name]):,.0f} req/s")
    ratios = [j / o for j, o in zip(cpu["jwt"], cpu["open"], strict=True)]
    print(f"jwt / open, CPU per request: median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}; {rounds} interleaved rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.http_auth",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000, help="per micro round")
    parser.add_argument("--no-http", action="store_true", help="the micro benchmark only")
    args = parser.parse_args()
    trio.run(_micro, args.rounds, args.requests)
    if not args.no_http:
        _http(args.rounds, args.seconds)


if __name__ == "__main__":
    main()
