"""Node bandwidth annotations → the servers' RoutesConfig.bandwidth (pure)."""

from __future__ import annotations

import pytest

from nodeagent.controller.bandwidth import node_bandwidth, parse_rate
from nodeagent.controller.compute import parse_tunnels
from tests.controller.test_compute import node, run


def test_rates_read_as_kubernetes_quantities() -> None:
    assert parse_rate("2000000") == 2e6
    assert parse_rate("500k") == 5e5 and parse_rate("1.5M") == 1.5e6
    assert parse_rate("10Mi") == 10 * 2**20 and parse_rate(" 1Gi ") == 2**30
    for bad in ("fast", "-1", "10MB", "1e6", ""):
        with pytest.raises(ValueError, match="bytes per second"):
            parse_rate(bad)
    assert node_bandwidth({"other": "x"}) is None
    limit = node_bandwidth({"nodeagent.io/bandwidth-to-node": "1Mi"})
    assert limit is not None and (limit.to_node, limit.from_node) == (2**20, None)
    with pytest.raises(ValueError, match="to_node"):
        node_bandwidth({"nodeagent.io/bandwidth-to-node": "10"})  # under 1 KiB/s


def test_node_annotations_reach_the_servers_routes_and_bad_ones_are_problems() -> None:
    shaped = node("edge-1", "192.168.1.10")
    shaped["metadata"]["annotations"] = {"nodeagent.io/bandwidth-to-node": "10Mi",
                                         "nodeagent.io/bandwidth-from-node": "1M"}
    bad = node("edge-2", "192.168.1.11")
    bad["metadata"]["annotations"] = {"nodeagent.io/bandwidth-from-node": "lots"}
    tunnels, _ = parse_tunnels([])
    out = run([shaped, bad, node("edge-3", "192.168.1.12")], tunnels)
    assert out.routes.bandwidth_of("edge-1") == (10 * 2**20, 1e6)
    assert out.routes.bandwidth_of("edge-2") == (None, None)
    assert out.routes.bandwidth_of("edge-3") == (None, None)
    (problem,) = [p for p in out.problems if p.reason == "InvalidBandwidth"]
    assert (problem.kind, problem.name) == ("Node", "edge-2")
    assert "bandwidth-from-node" in problem.message
