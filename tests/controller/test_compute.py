"""compute(): objects in, per-node NodeConfig and the servers' RoutesConfig out."""

from __future__ import annotations

from typing import Any

from nodeagent.config import NodeConfig
from nodeagent.configstream.protocol import config_line
from nodeagent.controller.compute import (
    ConfigVersions,
    compute,
    parse_tunnels,
    server_replicas,
)
from nodeagent.controller.ingress import translate_ingresses
from tests.controller.pods import pods_for
from tests.controller.test_ingress import OURS, endpoint, ingress, path, rule, service, slice_


def node(name: str, ip: str, labels: dict[str, str] | None = None,
         pod_cidrs: list[str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"podCIDRs": pod_cidrs or []},
            "status": {"addresses": [{"type": "InternalIP", "address": ip},
                                     {"type": "Hostname", "address": name}]}}


def tunnel(name: str, spec: dict[str, Any], created: str = "2026-01-01T00:00:00Z"
           ) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": created}, "spec": spec}


def run(nodes: list[dict[str, Any]], tunnels: Any, services: list[dict[str, Any]] | None = None,
        endpoint_slices: list[dict[str, Any]] | None = None) -> Any:
    return compute(nodes=nodes, tunnels=tunnels, translation=translation(),
                   services=services or [], endpoint_slices=endpoint_slices or [])


def translation() -> Any:
    return translate_ingresses(
        ingresses=[ingress("shop", [rule("shop.test", path("/"))])], ingress_classes=[OURS],
        services=[service()], endpoint_slices=[slice_("web", endpoint("10.1.0.5"))],
        secrets=[], nodes=[node("edge-1", "192.168.1.10", pod_cidrs=["10.1.0.0/24"])],
        pods=pods_for([slice_("web", endpoint("10.1.0.5"))]))


def test_nodes_allow_their_ingress_backends_and_the_tunnels_node_ports() -> None:
    tunnels, problems = parse_tunnels([tunnel("default", {
        "allowedNodePorts": [10250], "egress": [{"cidr": "10.96.0.0/12", "ports": ["443"]}],
        "intercept": {"rules": [{"name": "svc", "destinations": ["10.96.0.0/12"]}]},
        "nodeSelector": {"edge": "true"}})])
    assert problems == []
    out = run([node("edge-1", "192.168.1.10", {"edge": "true"}, ["10.1.0.0/24"]),
               node("cloud-1", "10.0.0.4")], tunnels)
    edge = out.nodes["edge-1"]
    assert edge.allows("10.1.0.5", 8080)          # its Ingress backend
    assert not edge.allows("10.1.0.5", 8081)
    assert edge.allows("192.168.1.10", 10250) and edge.allows("127.0.0.1", 10250)
    assert not edge.allows("192.168.1.10", 22)
    assert edge.intercept is not None and edge.intercept.rules[0].name == "svc"
    cloud = out.nodes["cloud-1"]                   # not selected by the tunnel
    assert cloud.intercept is None and not cloud.allows("10.0.0.4", 10250)
    assert out.routes.node_for_address("10.1.0.77") == "edge-1"
    assert out.routes.egress_allows("10.96.0.10", 443, node="edge-1")
    # Only for the nodes the tunnel covers: cloud-1 is outside its nodeSelector.
    assert not out.routes.egress_allows("10.96.0.10", 443, node="cloud-1")
    assert out.routes.check_egress("cloud-1", "10.96.0.10", 443) == "not_allowed"
    assert [r.host for r in out.routes.ingress.rules] == ["shop.test"]


def test_udp_intercept_rules_dns_zones_and_udp_egress_reach_agents_and_servers() -> None:
    """A ClusterTunnel with Kubernetes' spelling (protocol: UDP): the node gets the udp
    intercept rule with its DNS zones, the servers get the udp egress for that node only
    (a udp rule allows UDP, not TCP)."""
    tunnels, problems = parse_tunnels([tunnel("default", {
        "nodeSelector": {"edge": "true"},
        "egress": [{"cidr": "10.200.0.10/32", "ports": ["53"], "protocol": "UDP"},
                   "udp/10.200.0.0/24:5000-5010"],
        "intercept": {"mode": "tproxy", "rules": [{
            "name": "cloud-dns", "protocol": "UDP", "destinations": ["10.96.0.10/32"],
            "ports": [53], "dns_zones": ["svc.cloud.internal"],
            "dns_resolver": "10.200.0.10:53"}]}})])
    assert problems == []
    out = run([node("edge-1", "192.168.1.10", {"edge": "true"}), node("cloud-1", "10.0.0.4")],
              tunnels)
    intercept = out.nodes["edge-1"].intercept
    assert intercept is not None
    (rule,) = intercept.rules
    assert rule.protocol == "udp" and rule.dns_zones == ("svc.cloud.internal.",)
    assert str(rule.dns_resolver) == "10.200.0.10:53"
    routes = out.routes
    assert routes.check_egress("edge-1", "10.200.0.10", 53, "udp") is None
    assert routes.check_egress("edge-1", "10.200.0.10", 53, "tcp") == "not_allowed"
    assert routes.check_egress("edge-1", "10.200.0.7", 5005, "udp") is None
    assert routes.check_egress("cloud-1", "10.200.0.10", 53, "udp") == "not_allowed"


def test_invalid_and_overlapping_tunnels_are_problems() -> None:
    tunnels, problems = parse_tunnels([
        tunnel("old", {}), tunnel("young", {}, created="2026-06-01T00:00:00Z"),
        tunnel("broken", {"serverUrl": "http://nope"}),
        {"metadata": {"name": "leaving", "deletionTimestamp": "2026-07-01T00:00:00Z"},
         "spec": {"intercept": {"rules": [{"name": "x", "destinations": ["10.0.0.0/8"]}]}}},
    ])
    assert [t.name for t in tunnels] == ["old", "young"]
    assert [(p.name, p.reason) for p in problems] == [("broken", "InvalidSpec")]
    out = run([node("n", "10.0.0.1")], tunnels)
    assert [(p.name, p.reason) for p in out.problems] == [("young", "Overlapping")]


def test_versions_rise_only_when_content_changes() -> None:
    versions = ConfigVersions()
    assert versions.get("node/a") is None
    assert versions.update("node/a", NodeConfig())
    assert not versions.update("node/a", NodeConfig())
    got = versions.get("node/a")
    assert got is not None and got[0] == 1 and got[1].version == 1
    assert versions.update("node/a", NodeConfig(allow=("127.0.0.1:80",)))  # type: ignore[arg-type]
    got = versions.get("node/a")
    assert got is not None and got[0] == 2 and got[1].version == 2


def test_versions_encode_the_line_of_a_version_once() -> None:
    versions = ConfigVersions()
    assert versions.line("node/a") is None
    versions.update("node/a", NodeConfig(allow=("10.0.0.1:80",)))  # type: ignore[arg-type]
    first = versions.line("node/a")
    assert first == (1, config_line(1, NodeConfig(allow=("10.0.0.1:80",))))  # type: ignore[arg-type]
    assert versions.line("node/a")[1] is first[1]  # type: ignore[index]
    # Equal content, a new object: same version, same bytes.
    assert not versions.update("node/a", NodeConfig(allow=("10.0.0.1:80",)))  # type: ignore[arg-type]
    assert versions.line("node/a")[1] is first[1]  # type: ignore[index]
    assert versions.update("node/a", NodeConfig())
    assert versions.line("node/a") == (2, config_line(2, NodeConfig()))


def test_each_node_gets_the_egress_of_its_own_tunnel_only() -> None:
    tunnels, _ = parse_tunnels([
        tunnel("edge", {"nodeSelector": {"site": "edge"}, "egress": ["10.50.0.0/16:443"]}),
        tunnel("lab", {"nodeSelector": {"site": "lab"}, "egress": ["10.60.0.0/16:*"]})])
    out = run([node("e1", "192.168.1.1", {"site": "edge"}), node("l1", "192.168.2.1",
                                                                 {"site": "lab"}),
               node("x1", "192.168.3.1")], tunnels)
    assert [(s.name, s.nodes) for s in out.routes.scopes] == [("edge", ("e1",)),
                                                               ("lab", ("l1",))]
    assert out.routes.egress == ()  # no union for everyone
    assert out.routes.egress_allows("10.50.1.1", 443, node="e1")
    assert not out.routes.egress_allows("10.60.1.1", 443, node="e1")
    assert out.routes.egress_allows("10.60.1.1", 22, node="l1")
    assert not out.routes.egress_allows("10.50.1.1", 443, node="l1")
    assert not out.routes.egress_allows("10.50.1.1", 443, node="x1")


APISERVER = {"metadata": {"name": "kubernetes", "namespace": "default"},
             "spec": {"clusterIP": "10.96.0.1", "clusterIPs": ["10.96.0.1"],
                      "ports": [{"port": 443}]}}
APISERVER_SLICE = {"metadata": {"name": "kubernetes", "namespace": "default",
                                "labels": {"kubernetes.io/service-name": "kubernetes"}},
                   "endpoints": [{"addresses": ["172.18.0.2"]}]}
DB = {"metadata": {"name": "db", "namespace": "shop"}, "spec": {"clusterIP": "10.96.4.4"}}


def test_the_api_server_and_service_range_are_protected_even_under_a_wide_rule() -> None:
    tunnels, _ = parse_tunnels([tunnel("all", {"egress": ["0.0.0.0/0:*"]})])
    out = run([node("e1", "192.168.1.1")], tunnels, [APISERVER, DB], [APISERVER_SLICE])
    # No serviceCidrs given: the ClusterIPs seen, and the API server's endpoints.
    assert [str(c) for c in out.routes.protected] == [
        "10.96.0.1/32", "10.96.4.4/32", "172.18.0.2/32"]
    for host in ("172.18.0.2", "10.96.0.1", "10.96.4.4", "169.254.169.254", "127.0.0.1"):
        assert out.routes.check_egress("e1", host, 443) == "protected", host
    assert out.routes.check_egress("e1", "203.0.113.9", 443) is None
    # A tunnel that names the apiserver's address exactly unlocks it (and nothing else).
    tunnels, _ = parse_tunnels([tunnel("all", {
        "egress": ["0.0.0.0/0:*", "172.18.0.2/32:443"],
        "serviceCidrs": ["10.96.0.0/12"]})])
    out = run([node("e1", "192.168.1.1")], tunnels, [APISERVER, DB], [APISERVER_SLICE])
    assert [str(c) for c in out.routes.protected] == [
        "10.96.0.0/12", "10.96.0.1/32", "172.18.0.2/32"]
    assert out.routes.check_egress("e1", "172.18.0.2", 443) is None
    assert out.routes.check_egress("e1", "172.18.0.2", 6443) == "protected"
    assert out.routes.check_egress("e1", "10.96.4.4", 443) == "protected"


def test_relays_only_where_a_tunnels_policy_names_source_nodes_and_destinations() -> None:
    nodes = [node("a", "192.168.1.1", {"role": "gw"}, ["10.1.0.0/24"]),
             node("b", "192.168.1.2", {}, ["10.2.0.0/24"])]
    out = run(nodes, parse_tunnels([tunnel("t", {})])[0])
    assert not out.routes.relay_allows("a", "10.2.0.5", 80)  # default: none
    tunnels, problems = parse_tunnels([tunnel("t", {"relays": [
        {"fromNodeSelector": {"role": "gw"}, "to": ["10.2.0.0/24:80"]}]})])
    assert problems == []
    out = run(nodes, tunnels)
    assert out.routes.relay_allows("a", "10.2.0.5", 80)
    assert not out.routes.relay_allows("a", "10.2.0.5", 22)
    assert not out.routes.relay_allows("b", "10.1.0.5", 80)  # b is not selected


def test_routes_list_the_known_nodes_and_the_denied_ones() -> None:
    tunnels, _ = parse_tunnels([tunnel("t", {"allowedNodePorts": [10250],
                                             "deniedNodes": ["b"]})])
    out = run([node("a", "192.168.1.1"), node("b", "192.168.1.2")], tunnels)
    assert out.routes.nodes == ("a", "b") and out.routes.denied_nodes == ("b",)
    assert out.routes.admits("a") and not out.routes.admits("b")
    assert not out.routes.admits("gone")
    assert out.nodes["a"].allows("192.168.1.1", 10250)
    assert out.nodes["b"] == NodeConfig()  # revoked: allows nothing


def test_the_connect_front_reaches_covered_nodes_by_name_address_and_allowed_pod_ports() -> None:
    tunnels, problems = parse_tunnels([
        tunnel("edge", {"allowedPodPorts": [8443], "nodeSelector": {"edge": "true"},
                        "deniedNodes": ["edge-3"]})])
    assert problems == []
    ext = node("edge-1", "192.168.1.10", {"edge": "true"}, ["10.1.0.0/24"])
    ext["status"]["addresses"].append({"type": "ExternalIP", "address": "203.0.113.7"})
    out = run([ext, node("edge-3", "192.168.1.30", {"edge": "true"}),
               node("cloud-1", "10.0.0.4")], tunnels)
    connect = out.routes.connect_nodes
    # Covered and not denied only; the default allowedNodePorts is kubelet's 10250.
    assert sorted(connect) == ["edge-1"]
    assert connect["edge-1"].addresses == ("192.168.1.10", "203.0.113.7", "edge-1")
    assert [(r.first, r.last) for r in connect["edge-1"].ports] == [(10250, 10250)]
    assert [(r.first, r.last) for r in connect["edge-1"].pod_ports] == [(8443, 8443)]
    assert out.routes.connect_node_for("203.0.113.7") == "edge-1"
    # The agent's own control-plane rules say the same: its addresses on 10250, its pods
    # on 8443, nothing else; the ordinary allow list does not let pods' 8443 in.
    edge = out.nodes["edge-1"]
    for host, port, allowed in [("192.168.1.10", 10250, True), ("127.0.0.1", 10250, True),
                                ("203.0.113.7", 10250, True), ("10.1.0.9", 8443, True),
                                ("192.168.1.10", 22, False), ("10.1.0.9", 10250, False),
                                ("10.2.0.9", 8443, False)]:
        assert edge.allows_control_plane(host, port) is allowed, (host, port)
    assert not edge.allows("10.1.0.9", 8443)
    assert out.nodes["edge-3"] == NodeConfig()
    assert out.nodes["cloud-1"].control_plane == ()


def _dnat_rules(config: NodeConfig) -> list[tuple[str, tuple[str, ...], tuple[Any, ...]]]:
    rules = config.intercept.rules if config.intercept else ()
    return [(r.name, r.destinations, r.ports) for r in rules
            if r.name.startswith("control-plane-")]


def test_cloud_nodes_catch_dials_to_the_other_covered_nodes_addresses() -> None:
    """The DNAT path: the nodes cloudNodeSelector names get an intercept rule for the
    other covered nodes' IP addresses on allowedNodePorts (host traffic too), and the
    servers decide their streams like a CONNECT (control_plane_sources)."""
    tunnels, problems = parse_tunnels([tunnel("t", {
        "allowedNodePorts": [10250, "9100-9101"], "cloudNodeSelector": {"cloud": "true"},
        "deniedNodes": ["edge-3", "cloud-9"],
        "intercept": {"rules": [{"name": "svc", "destinations": ["10.96.0.0/12"]}]}})])
    assert problems == []
    ext = node("edge-1", "192.168.1.10")
    ext["status"]["addresses"].append({"type": "ExternalIP", "address": "203.0.113.7"})
    cloud = {"cloud": "true"}
    nodes = [ext, node("edge-2", "192.168.1.2"), node("edge-3", "192.168.1.30"),
             node("cloud-1", "10.0.0.4", cloud), node("cloud-2", "10.0.0.5", cloud),
             node("cloud-9", "10.0.0.9", cloud)]
    out = run(nodes, tunnels)
    assert problems == [] and out.problems == []
    # Addresses sorted as addresses (192.168.1.2 before .10), IPs only (no Hostname), no
    # denied node, no cloud node's own address.
    expected = [("control-plane-0", ("192.168.1.2/32", "192.168.1.10/32", "203.0.113.7/32"),
                 ("10250", "9100-9101"))]
    for name in ("cloud-1", "cloud-2"):
        config = out.nodes[name]
        assert _dnat_rules(config) == expected
        assert config.intercept is not None
        # The tunnel's own rule stays, and the caught dials include the host's own.
        assert [r.name for r in config.intercept.rules] == ["svc", "control-plane-0"]
        assert config.intercept.rules[1].host_traffic
    assert _dnat_rules(out.nodes["edge-1"]) == []
    assert out.nodes["cloud-9"] == NodeConfig()  # denied: nothing
    assert out.routes.control_plane_sources == ("cloud-1", "cloud-2")
    # Cloud nodes stay reachable through the CONNECT front (egress selection `cluster`).
    assert "cloud-1" in out.routes.connect_nodes
    # A Node added changes the set (and only the cloud nodes' configs and the routes);
    # one removed takes its addresses out.
    versions = ConfigVersions()
    for name, config in out.nodes.items():
        versions.update(f"node/{name}", config)
    versions.update("servers", out.routes)
    more = run([*nodes, node("edge-4", "192.168.1.40")], tunnels)
    changed = {name for name, config in more.nodes.items()
               if versions.update(f"node/{name}", config)}
    assert changed == {"cloud-1", "cloud-2", "edge-4"}
    assert "192.168.1.40/32" in _dnat_rules(more.nodes["cloud-1"])[0][1]
    fewer = run([n for n in nodes if n["metadata"]["name"] != "edge-2"], tunnels)
    assert _dnat_rules(fewer.nodes["cloud-1"])[0][1] == ("192.168.1.10/32", "203.0.113.7/32")
    # Unchanged input: no new version for anyone.
    again = run([*nodes, node("edge-4", "192.168.1.40")], tunnels)
    assert not any(versions.update(f"node/{n}", c) for n, c in again.nodes.items())


def test_no_cloud_node_selector_no_dnat_path_and_bad_ones_are_problems() -> None:
    nodes = [node("edge-1", "192.168.1.10"), node("cloud-1", "10.0.0.4", {"cloud": "true"})]
    tunnels, problems = parse_tunnels([tunnel("t", {"allowedNodePorts": [10250]})])
    out = run(nodes, tunnels)
    assert out.routes.control_plane_sources == () and out.nodes["cloud-1"].intercept is None
    # An empty selector would make every node a cloud node: refused.
    tunnels, problems = parse_tunnels([tunnel("t", {"cloudNodeSelector": {}})])
    assert tunnels == [] and [p.reason for p in problems] == ["InvalidSpec"]
    assert "every node a cloud node" in problems[0].message
    # No covered node left to reach (or no node ports): the cloud node gets no rule.
    tunnels, _ = parse_tunnels([tunnel("t", {"cloudNodeSelector": {"cloud": "true"},
                                             "nodeSelector": {"cloud": "true"}})])
    out = run(nodes, tunnels)
    assert out.nodes["cloud-1"].intercept is None
    assert out.routes.control_plane_sources == ("cloud-1",)
    # A rule name taken by the tunnel's own intercept: a Problem, the tunnel's rules stay.
    tunnels, _ = parse_tunnels([tunnel("t", {"cloudNodeSelector": {"cloud": "true"},
                                             "intercept": {"rules": [{
                                                 "name": "control-plane-0",
                                                 "destinations": ["10.96.0.0/12"]}]}})])
    out = run(nodes, tunnels)
    assert [(p.name, p.reason) for p in out.problems] == [("t", "InvalidCloudNodeRule")]
    assert "same name" in out.problems[0].message
    intercept = out.nodes["cloud-1"].intercept
    assert intercept is not None and [r.destinations for r in intercept.rules] == [
        ("10.96.0.0/12",)]


def test_each_tunnel_with_a_cloud_selector_adds_a_rule_for_its_own_nodes() -> None:
    tunnels, problems = parse_tunnels([
        tunnel("a", {"nodeSelector": {"site": "a"}, "cloudNodeSelector": {"cloud": "true"}},
               created="2026-01-01T00:00:00Z"),
        tunnel("b", {"nodeSelector": {"site": "b"}, "allowedNodePorts": [10250, 10255],
                     "cloudNodeSelector": {"cloud": "true"}}, created="2026-01-02T00:00:00Z"),
    ])
    assert problems == []
    out = run([node("a-1", "192.168.1.1", {"site": "a"}),
               node("b-1", "192.168.2.1", {"site": "b"}),
               node("cloud-1", "10.0.0.4", {"cloud": "true"})], tunnels)
    assert _dnat_rules(out.nodes["cloud-1"]) == [
        ("control-plane-0", ("192.168.1.1/32",), ("10250",)),
        ("control-plane-1", ("192.168.2.1/32",), ("10250", "10255"))]


def test_replicas_are_the_tunnel_services_endpoints_ready_or_not() -> None:
    """With Service nodeagent-tunnel (publishNotReadyAddresses), every not terminating
    endpoint counts, ready or not: a new replica becomes ready only once agents reached
    it, and they aim for it only if it counts. The server Service is then ignored."""
    def slice_of(service: str, *endpoints: dict[str, Any]) -> dict[str, Any]:
        es = slice_(service, *endpoints, port=8443, port_name="tunnel")
        es["metadata"]["namespace"] = "nodeagent"
        return es

    tunnel_slices = [slice_of("nodeagent-tunnel", endpoint("10.2.0.1"),
                              endpoint("10.2.0.2", ready=False),
                              endpoint("10.2.0.3", terminating=True))]
    server_slices = [slice_of("nodeagent-server", endpoint("10.2.0.1"),
                              endpoint("10.2.0.2", ready=False))]
    assert server_replicas(tunnel_slices, "nodeagent") == 2
    assert server_replicas(tunnel_slices + server_slices, "nodeagent") == 2
    assert server_replicas(server_slices, "nodeagent") == 1  # an older install: ready ones
    assert server_replicas([slice_of("nodeagent-tunnel",
                                      endpoint("10.2.0.3", terminating=True))],
                           "nodeagent") is None


def test_servers_announce_the_ready_replicas_of_the_server_service() -> None:
    """The routes carry how many server replicas serve the public address: the ready,
    not terminating endpoints of Service nodeagent-server in the controller's namespace
    (a replica rolled out is draining: it no longer counts)."""
    def server_slice(*endpoints: dict[str, Any], ns: str = "nodeagent") -> dict[str, Any]:
        es = slice_("nodeagent-server", *endpoints, port=8443, port_name="tunnel")
        es["metadata"]["namespace"] = ns
        return es

    slices = [server_slice(endpoint("10.2.0.1"), endpoint("10.2.0.2"),
                           endpoint("10.2.0.3", terminating=True),
                           endpoint("10.2.0.4", ready=False)),
              server_slice(endpoint("10.2.0.2"), endpoint("10.2.0.5")),  # a second slice
              server_slice(endpoint("10.9.0.1"), ns="elsewhere")]
    assert server_replicas(slices, "nodeagent") == 3
    assert server_replicas(slices, "empty") is None
    assert server_replicas(slices, None) is None
    out = compute(nodes=[node("edge-1", "192.168.1.10")], tunnels=[],
                  translation=translation(), services=[], endpoint_slices=slices,
                  namespace="nodeagent")
    # The servers announce it in their handshake; agents also get it in their config, so
    # a replica added during a rollout is dialed at once.
    assert out.routes.replicas == 3
    assert out.nodes["edge-1"].server_replicas == 3
    assert run([], []).routes.replicas is None
    # Servers with --workers 2: the routes still count pods (each server multiplies by
    # its own workers in its handshake); a node holds a tunnel to every worker of each.
    out = compute(nodes=[node("edge-1", "192.168.1.10")], tunnels=[],
                  translation=translation(), services=[], endpoint_slices=slices,
                  namespace="nodeagent", server_workers=2)
    assert out.routes.replicas == 3
    assert out.nodes["edge-1"].server_replicas == 6
