"""LoadBalancer Services → the servers' load balancers, the nodes' allow lists and each
Service's status: pure, with plain dicts (nodeagent/controller/loadbalancers.py)."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.config import AllowRule
from nodeagent.controller.compute import ComputeMemo, ConfigVersions, compute, parse_tunnels
from nodeagent.controller.ingress import translate_ingresses
from nodeagent.controller.lbstatus import configured_addresses
from nodeagent.controller.loadbalancers import (
    LOAD_BALANCER_CLASS,
    PORTS_CONDITION,
    PortState,
    reserved_ports,
    service_status,
    translate_load_balancers,
)
from tests.controller.pods import pods_for, target_ref
from tests.controller.test_compute import node, tunnel

NODES = [node("edge-1", "192.168.1.10", pod_cidrs=["10.1.0.0/24"]),
         node("edge-2", "192.168.1.11", pod_cidrs=["10.2.0.0/24"])]


def lb_service(name: str, ports: list[dict[str, Any]], *, created: str = "2026-01-01T00:00:00Z",
               namespace: str = "app", cls: str | None = LOAD_BALANCER_CLASS,
               **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "LoadBalancer", "ports": ports, **spec}
    if cls is not None:
        body["loadBalancerClass"] = cls
    return {"metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
            "spec": body}


def dns_slice(name: str = "dns", namespace: str = "app") -> dict[str, Any]:
    return {"metadata": {"name": f"{name}-1", "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "dns", "port": 5353, "protocol": "UDP"},
                      {"name": "dns-tcp", "port": 5353, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": ["10.1.0.5"], "nodeName": "edge-1", "conditions": {"ready": True},
                 "targetRef": target_ref(namespace, "dns-a")},
                {"addresses": ["10.2.0.7"], "nodeName": "edge-2", "conditions": {"ready": True},
                 "targetRef": target_ref(namespace, "dns-b")},
                {"addresses": ["10.2.0.8"], "nodeName": "edge-2",
                 "conditions": {"ready": False}, "targetRef": target_ref(namespace, "dns-c")},
            ]}


DNS_PORTS = [{"name": "dns", "port": 53, "protocol": "UDP"},
             {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]


def translate(services: list[dict[str, Any]], slices: list[dict[str, Any]] | None = None,
              **kwargs: Any) -> Any:
    slices = [dns_slice()] if slices is None else slices
    return translate_load_balancers(services=services, endpoint_slices=slices, nodes=NODES,
                                    pods=pods_for(slices), **{"classless": False, **kwargs})


def test_a_service_of_our_class_is_served_on_its_ports_across_ready_endpoints() -> None:
    out = translate([lb_service("dns", DNS_PORTS)])
    assert [s.name for s in out.services] == ["app/dns"]
    ports = {(p.protocol, p.port): p for p in out.services[0].ports}
    assert set(ports) == {("udp", 53), ("tcp", 53)}
    assert [(b.node, str(b.target)) for b in ports[("udp", 53)].backends] == [
        ("edge-1", "10.1.0.5:5353"), ("edge-2", "10.2.0.7:5353")]
    assert out.node_targets == {"edge-1": {("10.1.0.5", 5353, "udp"), ("10.1.0.5", 5353, "tcp")},
                                "edge-2": {("10.2.0.7", 5353, "udp"), ("10.2.0.7", 5353, "tcp")}}
    assert out.ports[("app", "dns")] == (PortState(53, "UDP"), PortState(53, "TCP"))
    assert out.problems == ()


def test_classless_services_only_when_a_tunnel_says_so_and_never_other_classes() -> None:
    classless = lb_service("dns", DNS_PORTS, cls=None)
    other = lb_service("other", [{"port": 80}], cls="example.com/lb")
    cluster_ip = dict(lb_service("plain", [{"port": 81}]), spec={"ports": [{"port": 81}]})
    assert translate([classless, other, cluster_ip]).services == ()
    assert [s.name for s in translate([classless, other, cluster_ip],
                                      classless=True).services] == ["app/dns"]
    tunnels, _ = parse_tunnels([tunnel("t", {"loadBalancers": {"classless": True,
                                                               "addresses": ["lb.example"]}})])
    assert tunnels[0].spec.load_balancers.classless
    assert configured_addresses(tunnels) == [{"hostname": "lb.example"}]
    being_deleted = lb_service("gone", [{"port": 82}])
    being_deleted["metadata"]["deletionTimestamp"] = "2026-01-02T00:00:00Z"
    assert translate([being_deleted]).services == ()


def test_a_port_conflict_goes_to_the_oldest_service_then_the_name_and_is_told() -> None:
    older = lb_service("b-old", [{"port": 53, "protocol": "UDP"}], created="2026-01-01T00:00:00Z")
    newer = lb_service("a-new", [{"port": 53, "protocol": "UDP"}, {"port": 80}],
                       created="2026-02-01T00:00:00Z")
    same_time = lb_service("c-same", [{"port": 53, "protocol": "UDP"}],
                           created="2026-01-01T00:00:00Z")
    for order in ([older, newer, same_time], [same_time, newer, older]):
        out = translate(order, slices=[])
        assert [s.name for s in out.services] == ["app/b-old", "app/a-new"]
        assert [(p.protocol, p.port) for p in out.services[1].ports] == [("tcp", 80)]
        assert out.ports[("app", "a-new")][0].error == "PortConflict"
        assert "app/b-old" in out.ports[("app", "a-new")][0].message
        assert out.ports[("app", "c-same")] == (PortState(
            53, "UDP", "PortConflict", out.ports[("app", "c-same")][0].message),)
        assert {(p.name, p.reason) for p in out.problems} == {
            ("a-new", "PortConflict"), ("c-same", "PortConflict")}
    # TCP 53 and UDP 53 are different ports: no conflict.
    tcp = lb_service("tcp53", [{"port": 53, "protocol": "TCP"}], created="2026-03-01T00:00:00Z")
    assert translate([older, tcp], slices=[]).problems == ()


def test_reserved_ports_sctp_and_source_ranges_are_refused_with_a_reason() -> None:
    servers = {"metadata": {"name": "nodeagent-server", "namespace": "nodeagent"},
               "spec": {"ports": [{"port": 443, "targetPort": 8443, "protocol": "TCP"}]}}
    reserved = reserved_ports([servers], "nodeagent", ["nodeagent-server"])
    assert reserved == {("TCP", 443), ("TCP", 8443)}
    out = translate([lb_service("web", [{"port": 443}, {"port": 8443, "protocol": "UDP"},
                                        {"port": 9, "protocol": "SCTP"}])],
                    slices=[], reserved=reserved)
    assert [(s.port, s.protocol, s.error) for s in out.ports[("app", "web")]] == [
        (443, "TCP", "PortReserved"), (8443, "UDP", None), (9, "SCTP", "UnsupportedProtocol")]
    ranged = lb_service("ranged", [{"port": 22}], loadBalancerSourceRanges=["10.0.0.0/8"])
    out = translate([ranged], slices=[])
    assert out.services == ()
    assert out.ports[("app", "ranged")][0].error == "SourceRangesUnsupported"
    status = service_status(out.ports[("app", "ranged")], [{"ip": "192.0.2.1"}], 1, [], "now")
    assert status["loadBalancer"] == {}  # nothing served: no address


def test_endpoints_not_tied_to_their_pod_or_node_are_not_served() -> None:
    es = dns_slice()
    es["endpoints"] += [
        {"addresses": ["10.9.0.1"], "nodeName": "edge-1", "conditions": {"ready": True},
         "targetRef": target_ref("app", "far")},  # outside edge-1's podCIDR
        {"addresses": ["10.1.0.9"], "nodeName": "edge-1", "conditions": {"ready": True}},
        {"addresses": ["10.1.0.10"], "conditions": {"ready": True}},
    ]
    out = translate([lb_service("dns", DNS_PORTS)], slices=[es])
    hosts = {b.target.host for p in out.services[0].ports for b in p.backends}
    assert hosts == {"10.1.0.5", "10.2.0.7"}
    assert {p.reason for p in out.problems} == {"EndpointRefused"}
    text = " ".join(p.message for p in out.problems)
    assert "off_node" in text and "no_target_ref" in text and "no_node_name" in text
    # None ready: the serving, terminating ones carry on; none at all: an open port.
    for endpoint in es["endpoints"]:
        endpoint["conditions"] = {"ready": False, "serving": True, "terminating": True}
    out = translate([lb_service("dns", DNS_PORTS)], slices=[es])
    assert {b.target.host for b in out.services[0].ports[0].backends} == {
        "10.1.0.5", "10.2.0.7", "10.2.0.8"}
    out = translate([lb_service("dns", DNS_PORTS)], slices=[])
    assert [len(p.backends) for p in out.services[0].ports] == [0, 0]


def test_compute_gives_nodes_udp_and_tcp_rules_and_servers_the_ports() -> None:
    slices = [dns_slice()]
    ingress = translate_ingresses(ingresses=[], ingress_classes=[], services=[],
                                  endpoint_slices=[], secrets=[], nodes=NODES)
    balancers = translate([lb_service("dns", DNS_PORTS)])
    out = compute(nodes=NODES, tunnels=[], translation=ingress, services=[],
                  endpoint_slices=slices, load_balancers=balancers)
    assert out.nodes["edge-1"].allow == (
        AllowRule(host="10.1.0.5", ports=("5353",), protocol="tcp"),  # type: ignore[arg-type]
        AllowRule(host="10.1.0.5", ports=("5353",), protocol="udp"))  # type: ignore[arg-type]
    assert [s.name for s in out.routes.load_balancers] == ["app/dns"]
    versions = ConfigVersions()
    assert versions.update("servers", out.routes)
    again = compute(nodes=NODES, tunnels=[], translation=ingress, services=[],
                    endpoint_slices=slices,
                    load_balancers=translate([lb_service("dns", DNS_PORTS)]))
    assert not versions.update("servers", again.routes)  # same content: no new version
    gone = compute(nodes=NODES, tunnels=[], translation=ingress, services=[],
                   endpoint_slices=slices)
    assert versions.update("servers", gone.routes) and gone.routes.load_balancers == ()
    assert gone.nodes["edge-1"].allow == ()


def test_status_lists_the_address_ports_errors_and_keeps_transition_times() -> None:
    states = (PortState(53, "UDP"), PortState(80, "TCP", "PortConflict", "taken by app/x"))
    other = {"type": "Example", "status": "True", "reason": "R", "message": "",
             "lastTransitionTime": "t0"}
    status = service_status(states, [{"ip": "192.0.2.1"}, {"hostname": "lb.example"}], 3,
                            [other], "t1")
    assert status["loadBalancer"]["ingress"] == [
        {"ip": "192.0.2.1", "ipMode": "Proxy", "ports": [
            {"port": 53, "protocol": "UDP"},
            {"port": 80, "protocol": "TCP", "error": "PortConflict"}]},
        {"hostname": "lb.example", "ports": [
            {"port": 53, "protocol": "UDP"},
            {"port": 80, "protocol": "TCP", "error": "PortConflict"}]}]
    assert status["conditions"][0] == other
    condition = status["conditions"][1]
    assert condition["type"] == PORTS_CONDITION and condition["status"] == "True"
    assert (condition["reason"], condition["observedGeneration"]) == ("PortConflict", 3)
    assert condition["lastTransitionTime"] == "t1"
    # Same status later: the transition time stays; resolved: it moves.
    again = service_status(states, [{"ip": "192.0.2.1"}], 3, status["conditions"], "t2")
    assert again["conditions"][1]["lastTransitionTime"] == "t1"
    fixed = service_status(states[:1], [{"ip": "192.0.2.1"}], 4, again["conditions"], "t3")
    assert fixed["conditions"][1]["status"] == "False"
    assert fixed["conditions"][1]["reason"] == "PortsServed"
    assert fixed["conditions"][1]["lastTransitionTime"] == "t3"
    nowhere = service_status(states[:1], [], 4, [], "t4")
    assert nowhere["loadBalancer"] == {} and \
        nowhere["conditions"][0]["reason"] == "NoPublicAddress"


@pytest.mark.parametrize("garbage", [
    {"spec": {"type": "LoadBalancer", "loadBalancerClass": LOAD_BALANCER_CLASS,
              "ports": [None, {"port": "53"}, {"port": 53, "protocol": 7}, "x"]}},
    {"metadata": None, "spec": {"type": "LoadBalancer",
                                "loadBalancerClass": LOAD_BALANCER_CLASS, "ports": None}},
    {"metadata": {"name": "dns", "namespace": "app"},
     "spec": {"type": "LoadBalancer", "loadBalancerClass": LOAD_BALANCER_CLASS,
              "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}},
])
def test_malformed_services_and_slices_never_raise(garbage: dict[str, Any]) -> None:
    slices = [dns_slice(), {"metadata": {"labels": {"kubernetes.io/service-name": "dns"},
                                         "namespace": "app"},
                            "ports": [{"name": "dns", "port": None, "protocol": "UDP"}, 5],
                            "endpoints": [None, {"addresses": ["not-an-ip", 7],
                                                 "nodeName": "edge-1"}]}]
    out = translate_load_balancers(services=[garbage], endpoint_slices=slices, nodes=NODES,
                                   pods=pods_for([dns_slice()]), classless=False)
    for service in out.services:
        for port in service.ports:
            assert all(b.node in ("edge-1", "edge-2") for b in port.backends)


@pytest.mark.parametrize(("value", "idle", "problem"), [
    (None, 60.0, False), ("5", 5.0, False), ("2.5s", 2.5, False), ("0", 60.0, True),
    ("nan", 60.0, True), ("soon", 60.0, True), ("99999", 60.0, True)])
def test_udp_idle_timeout_by_annotation(value: str | None, idle: float,
                                        problem: bool) -> None:
    svc = lb_service("dns", DNS_PORTS)
    if value is not None:
        svc["metadata"]["annotations"] = {"nodeagent.io/udp-idle-timeout": value}
    out = translate([svc])
    assert {p.idle_timeout for p in out.services[0].ports} == {idle}
    assert [p.reason for p in out.problems] == (["InvalidUdpIdleTimeout"] if problem else [])


def test_a_load_balancer_change_rebuilds_only_the_nodes_it_touches() -> None:
    memo = ComputeMemo()
    ingress = translate_ingresses(ingresses=[], ingress_classes=[], services=[],
                                  endpoint_slices=[], secrets=[], nodes=NODES)
    slices = [dns_slice()]
    first = compute(nodes=NODES, tunnels=[], translation=ingress, services=[],
                    endpoint_slices=slices, memo=memo,
                    load_balancers=translate([lb_service("dns", DNS_PORTS)]))
    built = memo.built
    only_edge_1 = dns_slice()
    only_edge_1["endpoints"] = only_edge_1["endpoints"][:1]
    second = compute(nodes=NODES, tunnels=[], translation=ingress, services=[],
                     endpoint_slices=[only_edge_1], memo=memo,
                     load_balancers=translate([lb_service("dns", DNS_PORTS)],
                                              slices=[only_edge_1]))
    assert memo.built == built + 1  # edge-2 lost its targets; edge-1's part is reused
    assert second.nodes["edge-1"] is first.nodes["edge-1"]
    assert second.nodes["edge-2"].allow == ()


def test_proxy_protocol_and_health_check_annotations_on_tcp_ports() -> None:
    svc = lb_service("dns", DNS_PORTS)
    svc["metadata"]["annotations"] = {"nodeagent.io/proxy-protocol": "v2",
                                      "nodeagent.io/health-check": "tcp interval=2"}
    out = translate([svc])
    ports = {p.protocol: p for p in out.services[0].ports}
    assert ports["tcp"].proxy_protocol == "v2"
    assert ports["tcp"].health_check is not None and ports["tcp"].health_check.interval == 2
    assert ports["udp"].proxy_protocol is None and ports["udp"].health_check is None
    assert out.problems == ()
    svc["metadata"]["annotations"] = {"nodeagent.io/proxy-protocol": "v9",
                                      "nodeagent.io/health-check": "icmp"}
    out = translate([svc])
    ports = {p.protocol: p for p in out.services[0].ports}
    assert ports["tcp"].proxy_protocol is None and ports["tcp"].health_check is None
    assert sorted(p.reason for p in out.problems) == ["InvalidHealthCheck",
                                                      "InvalidProxyProtocol"]
