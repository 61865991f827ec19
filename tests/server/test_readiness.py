"""The server's readiness rule (nodeagent/server/readiness.py), without a server."""

from __future__ import annotations

from nodeagent.config import RoutesConfig
from nodeagent.server.readiness import ReadinessGate, nodes_routed_to


def routes() -> RoutesConfig:
    return RoutesConfig.model_validate({
        "tcp": [{"listen": "127.0.0.1:1", "node": "edge-1", "target": "127.0.0.1:22"}],
        "http": [{"listen": "127.0.0.1:2", "routes": [
            {"host": "a.test", "node": "edge-2", "target": "127.0.0.1:80"},
            {"host": "direct.test", "target": "10.0.0.1:80"}]}],
        "ingress": {"rules": [{"name": "shop/web", "host": "w.test", "backends": [
            {"node": "edge-3", "target": "10.1.0.5:8080"},
            {"target": "10.2.0.1:80"}]}]},
        "connect_nodes": {"edge-4": {}},
        "udp": [{"listen": "127.0.0.1:3", "node": "edge-5", "target": "127.0.0.1:53"}],
        "load_balancers": [{"name": "apps/dns", "ports": [{"protocol": "udp", "port": 53,
                                                           "backends": [
            {"node": "edge-6", "target": "10.6.0.5:53"}]}]}],
    })


def test_the_nodes_a_replica_waits_for_are_those_its_routes_send_to() -> None:
    assert nodes_routed_to(routes()) == {"edge-1", "edge-2", "edge-3", "edge-4", "edge-5",
                                         "edge-6"}
    assert nodes_routed_to(RoutesConfig()) == set()


def test_ready_once_every_expected_tunnel_is_held_and_then_until_draining() -> None:
    gate = ReadinessGate(started=100.0, grace=30.0)
    expected = ["edge-1", "edge-2"]
    why = gate.check(101.0, draining=False, have_routes=True, expected=expected,
                     held=["edge-1"])
    assert why is not None and "1 node(s)" in why and "edge-2" in why
    assert gate.check(102.0, draining=False, have_routes=True, expected=expected,
                      held=["edge-1", "edge-2"]) is None
    assert gate.became == "tunnels"
    # A node leaving later does not take the replica out of rotation...
    assert gate.check(103.0, draining=False, have_routes=True, expected=expected,
                      held=[]) is None
    # ...draining does.
    assert gate.check(104.0, draining=True, have_routes=True, expected=expected,
                      held=expected) == "draining"


def test_ready_after_the_grace_when_a_node_never_comes() -> None:
    gate = ReadinessGate(started=0.0, grace=30.0)
    assert gate.check(29.9, draining=False, have_routes=True, expected=["gone"],
                      held=[]) is not None
    assert gate.check(30.0, draining=False, have_routes=True, expected=["gone"],
                      held=[]) is None
    assert gate.became == "grace" and gate.missing == ["gone"]


def test_not_ready_without_routes_within_the_grace() -> None:
    gate = ReadinessGate(started=0.0, grace=10.0)
    why = gate.check(1.0, draining=False, have_routes=False, expected=[], held=[])
    assert why is not None and why.startswith("no routes yet")
    assert gate.check(10.0, draining=False, have_routes=False, expected=[], held=[]) is None
