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


def test_the_backend_protocol_reaches_the_route() -> None:
    """A file's `backend_protocol` and an Ingress rule's become the `Route`'s, which the
    front reads per request to choose HTTP/1.1 or the shared h2c connection."""
    from nodeagent.config import HttpListener, IngressRoutes, IngressRule
    from nodeagent.server.routetables import build_ingress_table, build_route_table

    listener = HttpListener.model_validate({"listen": "127.0.0.1:0", "routes": [
        {"host": "g.test", "target": "127.0.0.1:9", "backend_protocol": "h2c"},
        {"host": "w.test", "target": "127.0.0.1:9"}]})
    table = build_route_table(listener)
    assert table.lookup("g.test", "/").route.backend_protocol == "h2c"  # type: ignore[union-attr]
    assert table.lookup("w.test", "/").route.backend_protocol == "h1"  # type: ignore[union-attr]
    ingress = IngressRoutes(rules=(IngressRule.model_validate(
        {"name": "ns/g", "host": "g.test", "backend_protocol": "h2c",
         "backends": [{"node": "edge-1", "target": "10.1.0.5:50051"}]}),))
    itable, refused = build_ingress_table(ingress)
    assert not refused
    assert itable.lookup("g.test", "/x").route.backend_protocol == "h2c"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="backend_protocol"):
        HttpListener.model_validate({"listen": "127.0.0.1:0", "routes": [
            {"target": "127.0.0.1:9", "backend_protocol": "h3"}]})
