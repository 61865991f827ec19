"""The CONNECT front's decisions as pure functions: request line → target, target + routes
→ the node and what its agent dials, or a refusal with its reason and status."""

from __future__ import annotations

import pytest

from nodeagent.config import (
    ConfigError,
    ConnectFrontConfig,
    ConnectTls,
    RoutesConfig,
    parse_config,
)
from nodeagent.server.connect import (
    REASONS,
    ConnectRoute,
    ProxyTarget,
    Refusal,
    check_client,
    decide,
    parse_target,
)

ROUTES = RoutesConfig.model_validate({
    "node_cidrs": {"edge-1": ["10.244.1.0/24"], "edge-2": ["10.244.2.0/24"],
                   "edge-3": ["10.244.3.0/24"]},
    "connect_nodes": {
        "edge-1": {"addresses": ["192.168.1.10", "203.0.113.7", "Edge-1.Site.Example"],
                   "ports": [10250, "9100-9101"], "pod_ports": [8443]},
        "edge-2": {"addresses": ["edge-2.site.example"]},  # default ports: kubelet only
        "edge-4": {"addresses": ["fd00::4"], "ports": [10250]},
    },
    "denied_nodes": ["edge-4"],
})


@pytest.mark.parametrize(("method", "target", "want"), [
    ("CONNECT", "192.168.1.10:10250", ProxyTarget("192.168.1.10", 10250)),
    ("CONNECT", "EDGE-1:10250", ProxyTarget("edge-1", 10250)),
    ("CONNECT", "[fd00::4]:10250", ProxyTarget("fd00::4", 10250)),
    ("GET", "http://edge-1:9100/metrics", ProxyTarget("edge-1", 9100, "/metrics")),
    ("GET", "http://192.168.1.10:10250", ProxyTarget("192.168.1.10", 10250, "/")),
    ("GET", "HTTP://edge-1/metrics?x=1", ProxyTarget("edge-1", 80, "/metrics?x=1")),
    ("GET", "http://[fd00::4]:9100/m", ProxyTarget("fd00::4", 9100, "/m")),
])
def test_request_lines_parse_into_targets(method: str, target: str, want: ProxyTarget) -> None:
    assert parse_target(method, target) == want


@pytest.mark.parametrize(("method", "target", "reason"), [
    ("CONNECT", "edge-1", "malformed"),  # no port
    ("CONNECT", "edge-1:0", "malformed"),
    ("CONNECT", "edge-1:65536", "malformed"),
    ("CONNECT", "edge-1:http", "malformed"),
    ("CONNECT", "fd00::4:10250", "malformed"),  # IPv6 needs brackets
    ("CONNECT", "[not-v6]:10250", "malformed"),
    ("CONNECT", "[fd00::4]10250", "malformed"),
    ("CONNECT", "ed ge:10250", "malformed"),
    ("CONNECT", "-edge:10250", "malformed"),
    ("CONNECT", "a" * 2000 + ":1", "malformed"),
    ("CONNECT", "/etc/passwd:1", "malformed"),
    # `$` with .match would let a final newline through: matched whole instead.
    ("CONNECT", "edge-1\n:10250", "malformed"),
    ("GET", "http://edge-1\n:9100/", "malformed"),
    ("GET", "/metrics", "not_proxy_request"),
    ("GET", "https://edge-1:10250/metrics", "https_absolute_form"),
    ("GET", "http://user@edge-1:9100/", "malformed"),
    ("GET", "http://edge-1:x/", "malformed"),
    ("GET", "http:///metrics", "malformed"),
])
def test_malformed_request_lines_are_400(method: str, target: str, reason: str) -> None:
    refusal = parse_target(method, target)
    assert isinstance(refusal, Refusal)
    assert refusal.reason == reason and refusal.status == 400
    assert "\n" not in refusal.message


@pytest.mark.parametrize(("host", "port", "want"), [
    # By node name: the agent dials the node's first IP address.
    ("edge-1", 10250, ConnectRoute("edge-1", "192.168.1.10", 10250, "node")),
    # By an address: that address.
    ("192.168.1.10", 9101, ConnectRoute("edge-1", "192.168.1.10", 9101, "node")),
    ("203.0.113.7", 10250, ConnectRoute("edge-1", "203.0.113.7", 10250, "node")),
    # By a Hostname address (matched case-insensitively): the first IP.
    ("edge-1.site.example", 9100, ConnectRoute("edge-1", "192.168.1.10", 9100, "node")),
    # A node with no IP address known: its loopback.
    ("edge-2.site.example", 10250, ConnectRoute("edge-2", "127.0.0.1", 10250, "node")),
    # A pod address inside the node's podCIDR, on an allowed pod port.
    ("10.244.1.9", 8443, ConnectRoute("edge-1", "10.244.1.9", 8443, "pod")),
])
def test_allowed_targets_route_to_the_owning_node(host: str, port: int,
                                                  want: ConnectRoute) -> None:
    assert decide(ProxyTarget(host, port), ROUTES) == want


@pytest.mark.parametrize(("host", "port", "reason", "status"), [
    ("edge-1", 22, "port_not_allowed", 403),
    ("192.168.1.10", 9102, "port_not_allowed", 403),
    ("edge-2", 9100, "port_not_allowed", 403),  # default: kubelet only
    ("10.244.1.9", 10250, "pod_not_allowed", 403),  # pod address, not a pod port
    ("10.244.2.9", 8443, "pod_not_allowed", 403),  # edge-2 allows no pod port
    ("10.244.3.9", 8443, "pod_not_allowed", 403),  # edge-3 is in no connect_nodes
    ("fd00::4", 10250, "node_denied", 403),
    ("edge-9", 10250, "unknown_node", 502),
    ("10.0.0.1", 10250, "unknown_node", 502),  # nobody's address: never dialed
    ("127.0.0.1", 10250, "unknown_node", 502),
    ("169.254.169.254", 80, "unknown_node", 502),
])
def test_refusals_carry_their_reason_and_status(host: str, port: int, reason: str,
                                                status: int) -> None:
    refusal = decide(ProxyTarget(host, port), ROUTES)
    assert isinstance(refusal, Refusal), refusal
    assert (refusal.reason, refusal.status) == (reason, status)
    assert REASONS[reason] == status


def test_routes_without_connect_nodes_reach_nothing() -> None:
    refusal = decide(ProxyTarget("edge-1", 10250), RoutesConfig())
    assert isinstance(refusal, Refusal) and refusal.reason == "unknown_node"


def test_front_config_is_off_by_default_and_checked() -> None:
    assert not ConnectFrontConfig().enabled
    assert ConnectFrontConfig.model_validate({"uds": "/run/x.sock"}).enabled
    with pytest.raises(ConfigError, match="client_ca_file"):
        parse_config(ConnectFrontConfig, {"listen": "0.0.0.0:8132"}, "server.yaml")
    with pytest.raises(ConfigError, match="every local user"):
        parse_config(ConnectFrontConfig, {"uds": "/run/x.sock", "uds_mode": 0o666},
                     "server.yaml")


def _tls(**allowed: list[str]) -> ConnectTls:
    return ConnectTls.model_validate({"client_ca_file": "/ca.crt", **allowed})


@pytest.mark.parametrize(("subjects", "organizations", "allowed", "passes"), [
    # The default: kube-apiserver's egress client (kubeadm's apiserver-kubelet-client).
    (["kube-apiserver-kubelet-client"], ["system:masters"], {}, True),
    (["kube-apiserver-kubelet-client"], ["kubeadm:cluster-admins"], {}, True),
    # A kubelet's client certificate from the same CA: refused.
    (["system:node:edge-2"], ["system:nodes"], {}, False),
    # An admin's: it shares the O, not the CN.
    (["kubernetes-admin"], ["system:masters"], {}, False),
    ([], [], {}, False),
    (["prometheus"], [], {"allowed_subjects": ["kube-apiserver-kubelet-client",
                                               "prometheus"]}, True),
    (["scraper-7"], ["monitoring"], {"allowed_organizations": ["monitoring"]}, True),
    (["system:node:edge-2"], ["system:nodes"], {"allowed_organizations": ["monitoring"]},
     False),
    (["anyone"], [], {"allowed_subjects": ["*"]}, True),
])
def test_only_allowed_client_identities_use_the_tls_listener(
        subjects: list[str], organizations: list[str], allowed: dict[str, list[str]],
        passes: bool) -> None:
    refusal = check_client(subjects, organizations, _tls(**allowed))
    if passes:
        assert refusal is None
    else:
        assert refusal is not None and refusal.reason == "client_not_allowed"
        assert refusal.status == 403 and "\n" not in refusal.message
        assert "allowed_subjects" in refusal.message


def test_an_empty_allow_list_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="both empty"):
        parse_config(ConnectTls, {"client_ca_file": "/ca.crt", "allowed_subjects": []},
                     "server.yaml")
