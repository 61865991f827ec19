"""What a SIGHUP reload may apply in place and what it names as needing a restart."""

from __future__ import annotations

from typing import Any

from nodeagent.config import ServerConfig
from nodeagent.server.reload import APPLIED_FIELDS, changed_fields

BASE: dict[str, Any] = {
    "tunnel": "tls://127.0.0.1:8443",
    "tls": {"cert_file": "/tls.crt", "key_file": "/tls.key"},
    "tokens": [{"node": "edge-1", "token": "edge-1-token-0123456789"}],
    "tcp": [{"name": "echo", "listen": "127.0.0.1:9000", "node": "edge-1",
             "target": "127.0.0.1:7"}],
}


def _config(**changes: Any) -> ServerConfig:
    return ServerConfig.model_validate({**BASE, **changes})


def test_routes_and_tokens_apply_and_the_rest_is_named_field_by_field() -> None:
    old = _config()
    new = _config(tokens=[{"node": "edge-2", "token": "edge-2-token-0123456789"}],
                  tcp=[dict(BASE["tcp"][0], target="127.0.0.1:8")],
                  tunnel="tls://127.0.0.1:9443", metrics_listen="127.0.0.1:9090",
                  keepalive={"interval": 5}, server_id="cloud-b")
    assert changed_fields(old, new, skip=APPLIED_FIELDS) == [
        "server_id", "tunnel.url", "metrics_listen", "keepalive.interval"]
    assert changed_fields(old, _config(), skip=APPLIED_FIELDS) == []


def test_every_routes_field_counts_as_applied() -> None:
    from nodeagent.config import RoutesConfig

    assert set(RoutesConfig.model_fields) <= APPLIED_FIELDS
    assert "tokens" in APPLIED_FIELDS and "metrics_listen" not in APPLIED_FIELDS
