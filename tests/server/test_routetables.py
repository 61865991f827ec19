"""The routes a server runs: what an HTTP front reads follows every route update, and an
update that would change the listeners is refused whole."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from nodeagent.config import ConfigError, RoutesConfig
from tests.server.test_policy import make_server


def http_routes(target: str, listen: str = "127.0.0.1:18080") -> dict[str, Any]:
    return {"http": [{"name": "public", "listen": listen, "routes": [
        {"host": "app.example.com", "node": "edge-1", "target": target}]}]}


def backend_of(table: Any) -> str:
    match = table().lookup("app.example.com", "/")
    assert match is not None
    backend = match.route.backends[0]
    return f"{backend.host}:{backend.port}"


def test_an_http_listeners_table_follows_route_updates() -> None:
    server = make_server(http_routes("127.0.0.1:3000"))
    # What serve_server hands the listener's HttpFront, read per request.
    table = functools.partial(server.route_tables.http_table, 0)
    assert backend_of(table) == "127.0.0.1:3000"
    server.apply_routes(RoutesConfig.model_validate(http_routes("127.0.0.1:4000")))
    assert backend_of(table) == "127.0.0.1:4000"


def test_an_update_that_moves_a_listener_changes_nothing() -> None:
    server = make_server(http_routes("127.0.0.1:3000"))
    moved = RoutesConfig.model_validate(http_routes("127.0.0.1:4000", "127.0.0.1:18081"))
    with pytest.raises(ConfigError, match="cannot change while running"):
        server.apply_routes(moved)
    assert backend_of(functools.partial(server.route_tables.http_table, 0)) == \
        "127.0.0.1:3000"
