"""Authentication and rate limits at the front with real processes (standalone): a JWKS
served by a local HTTP server whose keys rotate mid-test, basic auth from an htpasswd
file, the identity the backend sees, 429 with Retry-After, and what `nodeagent debug
status` shows (without any secret)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import bcrypt
import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Certs, Upstream, agent_config, server_config

pytestmark = pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)

ISSUER = "https://issuer.test"


class KeyServer:
    """A JWKS over HTTP on 127.0.0.1; `rotate()` replaces the signing key."""

    def __init__(self) -> None:
        self.generation = 0
        self.fetches = 0
        self.rotate()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.fetches += 1
                body = server.jwks()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Cache-Control", "max-age=300")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/jwks.json"

    def rotate(self) -> None:
        self.generation += 1
        self.kid = f"key-{self.generation}"
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def jwks(self) -> bytes:
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        return json.dumps({"keys": [{**jwk, "kid": self.kid, "use": "sig"}]}).encode()

    def token(self, sub: str = "alice", **claims: Any) -> str:
        body = {"iss": ISSUER, "aud": "shop", "sub": sub, "exp": int(time.time()) + 60,
                **claims}
        return jwt.encode(body, self.key, algorithm="RS256", headers={"kid": self.kid})


@pytest.fixture
def keys() -> Iterator[KeyServer]:
    server = KeyServer()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def test_jwt_basic_and_rate_limits_end_to_end(tmp_path: Path, certs: Certs, upstream: Upstream,
                                              keys: KeyServer) -> None:
    password_hash = bcrypt.hashpw(b"opensesame", bcrypt.gensalt(4)).decode()
    (tmp_path / "htpasswd").write_text(f"carol:{password_hash}\n")
    cfg = server_config(tmp_path, certs, upstream)
    target = f"127.0.0.1:{upstream.http_port}"
    cfg["http"][0]["routes"] = [
        {"host": "jwt.test", "node": "edge-1", "target": target,
         "auth": {"jwt": {"issuer": ISSUER, "jwks_url": keys.url, "audiences": ["shop"],
                          "jwks_min_refetch": 0}}},
        {"host": "basic.test", "node": "edge-1", "target": target,
         "auth": {"basic": {"htpasswd_file": "htpasswd", "realm": "shop"}}},
        {"host": "limited.test", "node": "edge-1", "target": target,
         "rate_limit": {"per_client_rate": 0.01, "per_client_burst": 2}},
        {"host": "open.test", "node": "edge-1", "target": target},
    ]
    server = NodeagentProcess("server", cfg, tmp_path, "server").start()
    agent = NodeagentProcess("agent", agent_config(tmp_path, certs, upstream, cfg["tunnel"]),
                             tmp_path, "agent")
    url = "http://" + cfg["http"][0]["listen"]
    try:
        server.wait_ready()
        agent.start().wait_ready()
        server.wait_for(lambda s: s["agents"], what="agent connected")
        with httpx.Client(trust_env=False, timeout=10) as c:
            forged = {"x-nodeagent-identity": "root"}
            r = c.get(url + "/a", headers={"host": "jwt.test", **forged})
            assert r.status_code == 401 and "bearer token is required" in r.text
            assert r.headers["www-authenticate"] == f'Bearer realm="{ISSUER}"'
            r = c.get(url + "/a", headers={"host": "jwt.test", **forged,
                                           "authorization": f"Bearer {keys.token('bob')}"})
            assert r.status_code == 200 and "identity=bob" in r.text, r.text
            # The issuer rotates its key: the first token with the new kid refetches.
            old = keys.token("bob")
            keys.rotate()
            r = c.get(url + "/a", headers={"host": "jwt.test",
                                           "authorization": f"Bearer {keys.token('dave')}"})
            assert r.status_code == 200 and "identity=dave" in r.text
            assert keys.fetches == 2
            r = c.get(url + "/a", headers={"host": "jwt.test", "authorization": f"Bearer {old}"})
            assert r.status_code == 401 and "unknown key" in r.text
            r = c.get(url + "/", headers={"host": "basic.test", **forged},
                      auth=("carol", "wrong"))
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith(
                'Basic realm="shop"')
            r = c.get(url + "/", headers={"host": "basic.test", **forged},
                      auth=("carol", "opensesame"))
            assert r.status_code == 200 and "identity=carol" in r.text
            r = c.get(url + "/", headers={"host": "open.test", **forged})
            assert r.status_code == 200 and "identity=None" in r.text  # forged copy dropped
            statuses = [c.get(url + "/", headers={"host": "limited.test"}) for _ in range(3)]
            assert [r.status_code for r in statuses] == [200, 200, 429]
            assert int(statuses[2].headers["retry-after"]) >= 1
        status = server.status()
        http = status["http"]["http:public"]
        assert http["refused_auth_missing"] == 1 and http["refused_auth_invalid"] == 1
        assert http["refused_auth_unknown_key"] == 1
        assert http["refused_rate_limited_client"] == 1
        gates = status["route_gates"]
        assert gates["public[0]"]["jwks"]["key_ids"] == ["key-2"]
        assert gates["public[1]"]["users"] == 1
        transport = httpx.HTTPTransport(uds=str(server.socket))
        with httpx.Client(transport=transport, timeout=5) as debug:
            config = debug.get("http://debug/config").text
            metrics = debug.get("http://debug/metrics").text
        assert password_hash not in config and password_hash not in json.dumps(status)
        assert "auth_unknown_key" in metrics, metrics
    finally:
        server.kill()
        agent.kill()
    logs = server.logs()
    assert "Traceback" not in logs and password_hash not in logs
    assert "http refused" in logs and "auth_missing" in logs
