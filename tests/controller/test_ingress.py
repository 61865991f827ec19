"""translate_ingresses: Kubernetes objects in, the server's Ingress routes out."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from nodeagent.config import Backend, HostPort
from nodeagent.controller.ingress import IngressTranslation, translate_ingresses
from nodeagent.trust import pki
from tests.controller.pods import pod, pods_for, target_ref

NS = "shop"
OURS = {"metadata": {"name": "nodeagent"},
        "spec": {"controller": "nodeagent.io/ingress-controller"}}
NGINX = {"metadata": {"name": "nginx"}, "spec": {"controller": "k8s.io/ingress-nginx"}}


def ingress(name: str, rules: list[dict[str, Any]] | None = None, *, cls: str | None = "nodeagent",
            tls: list[dict[str, Any]] | None = None, default: dict[str, Any] | None = None,
            annotations: dict[str, str] | None = None, created: str = "2026-01-01T00:00:00Z",
            ) -> dict[str, Any]:
    spec: dict[str, Any] = {"rules": rules or []}
    if cls is not None:
        spec["ingressClassName"] = cls
    if tls is not None:
        spec["tls"] = tls
    if default is not None:
        spec["defaultBackend"] = default
    return {"metadata": {"name": name, "namespace": NS, "creationTimestamp": created,
                         "annotations": annotations or {}}, "spec": spec}


def rule(host: str | None, *paths: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"http": {"paths": list(paths)}}
    if host is not None:
        out["host"] = host
    return out


def path(p: str, svc: str = "web", port: int | str = 80, kind: str = "Prefix") -> dict[str, Any]:
    ref = {"number": port} if isinstance(port, int) else {"name": port}
    return {"path": p, "pathType": kind, "backend": {"service": {"name": svc, "port": ref}}}


def service(name: str = "web", ports: list[dict[str, Any]] | None = None,
            **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS},
            "spec": {"ports": ports or [{"name": "http", "port": 80, "targetPort": 8080}],
                     **spec}}


def endpoint(ip: str, node: str | None = "edge-1", *, pod: str | None = "",
             **conditions: bool) -> dict[str, Any]:
    """An endpoint; with a node, its targetRef names Pod `pod` (default: one named for
    the address, which `pods_for` creates) unless pod=None."""
    out: dict[str, Any] = {"addresses": [ip], "conditions": {"ready": True, **conditions}}
    if node is not None:
        out["nodeName"] = node
        if pod is not None:
            out["targetRef"] = target_ref(NS, pod or f"pod-{ip.replace(':', '-')}")
    return out


def slice_(svc: str = "web", *endpoints: dict[str, Any], port: int = 8080,
           port_name: str = "http") -> dict[str, Any]:
    return {"metadata": {"name": f"{svc}-abc", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": svc}},
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            "endpoints": list(endpoints)}


NODES = [{"metadata": {"name": "edge-1"},
          "spec": {"podCIDRs": ["10.1.0.0/24", "10.9.9.0/24"]},
          "status": {"addresses": [{"type": "InternalIP", "address": "192.168.7.10"},
                                   {"type": "Hostname", "address": "edge-1"}]}},
         {"metadata": {"name": "edge-2"},  # 10.1.0.6: a hostNetwork pod on it
          "status": {"addresses": [{"type": "InternalIP", "address": "10.1.0.6"}]}}]


def translate(ingresses: list[dict[str, Any]], services: list[dict[str, Any]] | None = None,
              slices: list[dict[str, Any]] | None = None, secrets: list[dict[str, Any]] | None
              = None, classes: list[dict[str, Any]] | None = None, *,
              pods: list[dict[str, Any]] | None = None,
              direct: frozenset[str] = frozenset()) -> IngressTranslation:
    """`pods`: default, those `pods_for` the slices; `direct`: the admin's
    directBackendNamespaces."""
    slices = slices if slices is not None else [slice_("web", endpoint("10.1.0.5"))]
    return translate_ingresses(
        ingresses=ingresses, ingress_classes=classes if classes is not None else [OURS, NGINX],
        services=services if services is not None else [service()],
        endpoint_slices=slices, secrets=secrets or [], nodes=NODES,
        pods=pods if pods is not None else pods_for(slices), direct_namespaces=direct)


def test_rule_becomes_a_route_to_ready_endpoints_through_their_node() -> None:
    t = translate([ingress("shop", [rule("shop.example.com", path("/api"))])],
                  slices=[slice_("web", endpoint("10.1.0.5"), endpoint("10.1.0.6", "edge-2"),
                                 endpoint("10.1.0.7", ready=False))])
    (r,) = t.routes.rules
    assert (r.name, r.host, r.path, r.path_type) == ("shop/shop", "shop.example.com", "/api",
                                                     "Prefix")
    assert r.backends == (Backend(node="edge-1", target=HostPort(host="10.1.0.5", port=8080)),
                          Backend(node="edge-2", target=HostPort(host="10.1.0.6", port=8080)))
    assert t.node_targets == {"edge-1": frozenset({("10.1.0.5", 8080)}),
                              "edge-2": frozenset({("10.1.0.6", 8080)})}
    assert t.problems == () and t.served == (("shop", "shop"),)


def test_terminating_endpoints_only_when_none_is_ready() -> None:
    draining = endpoint("10.1.0.9", ready=False, serving=True, terminating=True)
    t = translate([ingress("a", [rule("a.test", path("/"))])],
                  slices=[slice_("web", draining)])
    assert [b.target.host for b in t.routes.rules[0].backends] == ["10.1.0.9"]
    t = translate([ingress("a", [rule("a.test", path("/"))])],
                  slices=[slice_("web", draining, endpoint("10.1.0.5"))])
    assert [b.target.host for b in t.routes.rules[0].backends] == ["10.1.0.5"]


def test_no_endpoints_is_a_route_without_backends() -> None:
    t = translate([ingress("a", [rule("a.test", path("/"))])], slices=[])
    assert t.routes.rules[0].backends == () and t.problems == ()


def test_only_our_class_legacy_annotation_or_default_class() -> None:
    mine = ingress("mine", [rule("m.test", path("/"))])
    theirs = ingress("theirs", [rule("t.test", path("/"))], cls="nginx")
    legacy = ingress("legacy", [rule("l.test", path("/"))], cls=None,
                     annotations={"kubernetes.io/ingress.class": "nodeagent"})
    classless = ingress("classless", [rule("c.test", path("/"))], cls=None)
    t = translate([mine, theirs, legacy, classless])
    assert {r.host for r in t.routes.rules} == {"m.test", "l.test"}
    default_ours = dict(OURS, metadata={"name": "nodeagent", "annotations": {
        "ingressclass.kubernetes.io/is-default-class": "true"}})
    t = translate([classless], classes=[default_ours])
    assert [r.host for r in t.routes.rules] == ["c.test"]


def test_service_port_by_name_and_the_endpoint_slice_target_port() -> None:
    svc = service(ports=[{"name": "metrics", "port": 9000, "targetPort": "m"},
                         {"name": "http", "port": 80, "targetPort": "web"}])
    es = slice_("web", endpoint("10.1.0.5"), port=3000, port_name="http")
    t = translate([ingress("a", [rule("a.test", path("/", port="http"))])], [svc], [es])
    assert t.routes.rules[0].backends[0].target.port == 3000


def test_service_port_app_protocol_sets_the_backend_protocol() -> None:
    """appProtocol kubernetes.io/h2c or grpc: the routes' backends get HTTP/2 (h2c); any
    other value, or none, HTTP/1.1. Per Service port, by number or name."""
    svc = service(ports=[{"name": "http", "port": 80, "targetPort": 8080},
                         {"name": "grpc", "port": 81, "targetPort": 8080,
                          "appProtocol": "grpc"},
                         {"name": "h2c", "port": 82, "targetPort": 8080,
                          "appProtocol": "kubernetes.io/h2c"},
                         {"name": "ws", "port": 83, "targetPort": 8080,
                          "appProtocol": "kubernetes.io/ws"}])
    slices = [slice_("web", endpoint("10.1.0.5"), port_name=name)
              for name in ("http", "grpc", "h2c", "ws")]
    rules = [rule(f"{host}.test", path("/", port=port)) for host, port in
             (("a", 80), ("b", "grpc"), ("c", 82), ("d", "ws"))]
    t = translate([ingress("a", rules, default=path("/", port=81)["backend"])], [svc], slices)
    assert {r.host: r.backend_protocol for r in t.routes.rules} == {
        "a.test": "h1", "b.test": "h2c", "c.test": "h2c", "d.test": "h1"}
    assert t.routes.default_backend is not None
    assert t.routes.default_backend.backend_protocol == "h2c"


DIRECT = {"nodeagent.io/allow-direct-backends": "true"}


def test_external_name_service_is_a_direct_backend_only_when_opted_in() -> None:
    ext = service("ext", ports=[{"port": 443}], type="ExternalName",
                  externalName="169.254.169.254")
    rules = [rule("a.test", path("/", svc="ext", port=443)), rule("b.test", path("/"))]
    t = translate([ingress("a", rules)], [ext, service()])
    # Refused: a Problem (an Event on the Ingress); the Ingress's other rule is served.
    assert [(p.name, p.reason) for p in t.problems] == [("a", "DirectBackendRefused")]
    assert "allow-direct-backends" in t.problems[0].message
    assert [r.host for r in t.routes.rules] == ["b.test"]
    t = translate([ingress("a", rules, annotations=DIRECT)], [ext, service()],
                  direct=frozenset({NS}))
    assert t.problems == ()
    assert t.routes.rules[0].backends == (
        Backend(node=None, target=HostPort(host="169.254.169.254", port=443)),)


def test_the_direct_backends_annotation_alone_opens_nothing() -> None:
    """The namespace user writes the Ingress: its annotation is only the second key. The
    first is the cluster admin's (a ClusterTunnel's directBackendNamespaces); without
    it the annotation is ignored, with a Problem saying why."""
    ext = service("ext", ports=[{"port": 443}], type="ExternalName",
                  externalName="10.0.0.9")
    rules = [rule("a.test", path("/", svc="ext", port=443)), rule("b.test", path("/"))]
    slices = [slice_("web", endpoint("10.2.0.1", node=None), endpoint("10.1.0.5"))]
    for direct in (frozenset(), frozenset({"other"})):
        t = translate([ingress("a", rules, annotations=DIRECT)], [ext, service()], slices,
                      direct=direct)
        assert [p.reason for p in t.problems] == [
            "DirectBackendsNotAllowed", "DirectBackendRefused", "DirectBackendRefused"]
        assert f"not listed namespace {NS}" in t.problems[0].message
        assert [r.host for r in t.routes.rules] == ["b.test"]
        assert [b.target.host for b in t.routes.rules[0].backends] == ["10.1.0.5"]
        assert t.refused_backends == {"direct_not_allowed": 1, "external_name": 1,
                                      "nodeless": 1}
    # "*" lists every namespace; the admin's list without the annotation opens nothing.
    t = translate([ingress("a", rules, annotations=DIRECT)], [ext, service()], slices,
                  direct=frozenset({"*"}))
    assert t.problems == () and len(t.routes.rules) == 2
    t = translate([ingress("a", rules)], [ext, service()], slices, direct=frozenset({NS}))
    assert [p.reason for p in t.problems] == ["DirectBackendRefused"] * 2


def test_endpoint_without_a_node_is_dialed_directly_only_when_opted_in() -> None:
    slices = [slice_("web", endpoint("169.254.169.254", node=None), endpoint("10.1.0.5"))]
    t = translate([ingress("a", [rule("a.test", path("/"))])], slices=slices)
    assert [p.reason for p in t.problems] == ["DirectBackendRefused"]
    assert [b.target.host for b in t.routes.rules[0].backends] == ["10.1.0.5"]
    t = translate([ingress("a", [rule("a.test", path("/"))], annotations=DIRECT)],
                  slices=[slice_("web", endpoint("10.2.0.1", node=None))],
                  direct=frozenset({NS}))
    assert t.routes.rules[0].backends[0].node is None and t.node_targets == {}


def test_an_endpoint_is_believed_only_for_a_pod_of_the_services_namespace_on_its_node(
        ) -> None:
    """CVE-2021-25740's class: whoever writes an EndpointSlice could name another
    namespace's pod, or the node's own address (its sshd), inside the node's ranges. Only
    an endpoint whose targetRef is a Pod of the Service's namespace, on that node, holding
    that address, is believed."""
    mine = pod(NS, "web-0", "edge-1", "10.1.0.5")
    theirs = pod("bank", "db-0", "edge-1", "10.1.0.9")
    host = pod(NS, "agent-0", "edge-1", "192.168.7.10", host_network=True, ports=[8080])
    cases = {
        "ok": (endpoint("10.1.0.5", pod="web-0"), None),
        "no_target_ref": (endpoint("192.168.7.10", pod=None), "no_target_ref"),
        "target_not_pod": (dict(endpoint("10.1.0.5"), targetRef={
            "kind": "Node", "name": "edge-1"}), "target_not_pod"),
        "other_namespace": (dict(endpoint("10.1.0.9"), targetRef={
            "kind": "Pod", "namespace": "bank", "name": "db-0"}), "other_namespace"),
        "pod_not_found": (endpoint("10.1.0.9", pod="db-0"), "pod_not_found"),
        "uid": (dict(endpoint("10.1.0.5"), targetRef={
            "kind": "Pod", "namespace": NS, "name": "web-0", "uid": "old"}),
            "pod_uid_mismatch"),
        "other_node": (endpoint("10.1.0.5", "edge-2", pod="web-0"), "pod_on_other_node"),
        "not_its_ip": (endpoint("10.1.0.6", pod="web-0"), "not_pod_address"),
        # A pod on the node's network holds the node's address: only its declared ports.
        "host_ok": (endpoint("192.168.7.10", pod="agent-0"), None),
    }
    for label, (ep, reason) in cases.items():
        t = translate([ingress("a", [rule("a.test", path("/"))])],
                      slices=[slice_("web", ep)], pods=[mine, theirs, host])
        if reason is None:
            assert t.problems == () and len(t.routes.rules[0].backends) == 1, label
            assert t.refused_backends == {}, label
            continue
        if reason == "pod_on_other_node":  # edge-2's ranges do not hold 10.1.0.5 either
            t = translate([ingress("a", [rule("a.test", path("/"))])],
                          slices=[slice_("web", endpoint("10.1.0.6", "edge-2", pod="w"))],
                          pods=[pod(NS, "w", "edge-1", "10.1.0.6")])
        assert t.routes.rules[0].backends == () and t.node_targets == {}, label
        assert [p.reason for p in t.problems] == ["EndpointRefused"], label
        assert f"({reason}, 1:" in t.problems[0].message, label
        assert t.refused_backends == {reason: 1}, label
    # The node's sshd through a hostNetwork pod of the namespace: port not declared.
    t = translate([ingress("a", [rule("a.test", path("/"))])],
                  slices=[slice_("web", endpoint("192.168.7.10", pod="agent-0"), port=22)],
                  pods=[host])
    assert t.refused_backends == {"host_port_undeclared": 1}
    assert t.routes.rules[0].backends == ()
    # The admin's opt-in with the Ingress's annotation believes the endpoint (still
    # only inside its node's ranges).
    slices = [slice_("web", endpoint("192.168.7.10", pod=None), endpoint("169.254.169.254",
                                                                         pod=None))]
    t = translate([ingress("a", [rule("a.test", path("/"))], annotations=DIRECT)],
                  slices=slices, pods=[], direct=frozenset({NS}))
    assert [b.target.host for b in t.routes.rules[0].backends] == ["192.168.7.10"]
    assert t.refused_backends == {"off_node": 1}
    t = translate([ingress("a", [rule("a.test", path("/"))], annotations=DIRECT)],
                  slices=slices, pods=[])
    assert t.routes.rules[0].backends == ()


def test_an_endpoint_slice_cannot_put_foreign_addresses_on_a_node() -> None:
    """Whoever writes EndpointSlices names addresses; only the node's own (its podCIDRs,
    its addresses) reach its allow list."""
    slices = [slice_("web", endpoint("169.254.169.254"), endpoint("127.0.0.1"),
                     endpoint("10.1.0.5"), endpoint("192.168.7.10"),
                     endpoint("10.1.0.7", "edge-2"), endpoint("10.1.0.8", "ghost"))]
    t = translate([ingress("a", [rule("a.test", path("/"))])], slices=slices)
    assert t.node_targets == {"edge-1": frozenset({("10.1.0.5", 8080),
                                                   ("192.168.7.10", 8080)})}
    assert [b.target.host for b in t.routes.rules[0].backends] == ["10.1.0.5",
                                                                   "192.168.7.10"]
    assert [p.reason for p in t.problems] == ["EndpointNotOnNode"]
    assert "ignored (4: 10.1.0.7 on edge-2, 10.1.0.8 on ghost" in t.problems[0].message


def test_default_backend_and_path_types_and_wildcards() -> None:
    t = translate([ingress("a", [rule("*.apps.test", path("/exact", kind="Exact"),
                                      path("/x", kind="ImplementationSpecific"))],
                           default=path("/")["backend"])])
    hosts = {(r.host, r.path, r.path_type) for r in t.routes.rules}
    assert hosts == {("*.apps.test", "/exact", "Exact"),
                     ("*.apps.test", "/x", "ImplementationSpecific")}
    assert t.routes.default_backend is not None
    assert t.routes.default_backend.backends[0].target.host == "10.1.0.5"


def test_oldest_ingress_wins_the_default_backend() -> None:
    other = service("other")
    young = ingress("young", default=path("/", svc="other")["backend"],
                    created="2026-05-01T00:00:00Z")
    old = ingress("old", default=path("/")["backend"], created="2026-01-01T00:00:00Z")
    t = translate([young, old], [service(), other],
                  [slice_("web", endpoint("10.1.0.5")), slice_("other", endpoint("10.9.9.9"))])
    assert t.routes.default_backend is not None
    assert t.routes.default_backend.name == "shop/old"
    assert {r.rank for r in [t.routes.default_backend]} == {"2026-01-01T00:00:00Z"}


@pytest.fixture(scope="module")
def tls_secret() -> dict[str, Any]:
    ca = pki.create_ca("test CA")
    leaf = pki.issue_server_certificate(ca, ["secure.test"])
    return {"metadata": {"name": "secure-tls", "namespace": NS}, "type": "kubernetes.io/tls",
            "data": {"tls.crt": base64.b64encode(leaf.certificate_pem).decode(),
                     "tls.key": base64.b64encode(leaf.key_pem).decode()}}


def test_tls_secret_gives_a_certificate_and_a_redirect(tls_secret: dict[str, Any]) -> None:
    ing = ingress("s", [rule("secure.test", path("/")), rule("plain.test", path("/"))],
                  tls=[{"hosts": ["secure.test"], "secretName": "secure-tls"}])
    t = translate([ing], secrets=[tls_secret])
    (cert,) = t.routes.tls
    assert cert.hosts == ("secure.test",) and "BEGIN CERTIFICATE" in cert.cert_pem
    redirects = {r.host: r.tls_redirect for r in t.routes.rules}
    assert redirects == {"secure.test": True, "plain.test": False}
    off = ingress("s", [rule("secure.test", path("/"))],
                  tls=[{"hosts": ["secure.test"], "secretName": "secure-tls"}],
                  annotations={"nodeagent.io/ssl-redirect": "false"})
    assert translate([off], secrets=[tls_secret]).routes.rules[0].tls_redirect is False


def test_missing_or_malformed_tls_secret_is_a_problem_not_a_failure(
        tls_secret: dict[str, Any]) -> None:
    missing = ingress("m", [rule("m.test", path("/"))],
                      tls=[{"hosts": ["m.test"], "secretName": "nope"}])
    other_key = pki.issue_server_certificate(pki.create_ca("x"), ["x"]).key_pem
    mismatched = dict(tls_secret, metadata={"name": "bad", "namespace": NS},
                      data=dict(tls_secret["data"],
                                **{"tls.key": base64.b64encode(other_key).decode()}))
    garbage = dict(tls_secret, metadata={"name": "junk", "namespace": NS},
                   data={"tls.crt": base64.b64encode(b"nope").decode(), "tls.key": "!!"})
    bad = ingress("b", [rule("b.test", path("/"))],
                  tls=[{"hosts": ["b.test"], "secretName": "bad"},
                       {"hosts": ["b.test"], "secretName": "junk"}])
    t = translate([missing, bad], secrets=[mismatched, garbage])
    reasons = sorted((p.name, p.reason) for p in t.problems)
    assert reasons == [("b", "TLSSecretInvalid"), ("b", "TLSSecretInvalid"),
                       ("m", "TLSSecretMissing")]
    messages = " ".join(p.message for p in t.problems)
    assert "does not match" in messages and "not base64" in messages
    assert t.routes.tls == ()
    assert {r.host: r.tls_redirect for r in t.routes.rules} == {"m.test": False, "b.test": False}


def test_bad_objects_are_problems_and_the_rest_keeps_working() -> None:
    good = ingress("good", [rule("good.test", path("/"))])
    bad = ingress("bad", [rule("bad.test", path("/", svc="ghost"), path("no-slash"),
                               path("/p", port=81), path("/t", kind="Regex")),
                          rule("Bad Host!", path("/"))])
    t = translate([good, bad])
    assert [r.host for r in t.routes.rules] == ["good.test"]
    reasons = sorted(p.reason for p in t.problems)
    assert reasons == ["InvalidPath", "InvalidRule", "InvalidRule", "ServiceNotFound",
                       "ServicePortNotFound"]
    assert all(p.kind == "Ingress" and p.name == "bad" for p in t.problems)


def test_garbage_objects_never_raise() -> None:
    junk: list[dict[str, Any]] = [{}, {"metadata": None, "spec": None},
                                  {"spec": {"ingressClassName": "nodeagent",
                                            "rules": [{"http": {"paths": [{}]}}]}}]
    t = translate(junk, services=[{}], slices=[{"metadata": {}}], secrets=[{}])
    assert t.routes.rules == () and len(t.problems) == 1


def test_the_services_health_check_annotation_goes_on_its_rules() -> None:
    annotated = service()
    annotated["metadata"]["annotations"] = {
        "nodeagent.io/health-check": "http:/healthz interval=3"}
    t = translate([ingress("shop", [rule("a.test", path("/"))])], services=[annotated])
    (r,) = t.routes.rules
    assert r.health_check is not None and (r.health_check.kind, r.health_check.path,
                                           r.health_check.interval) == ("http", "/healthz", 3)
    annotated["metadata"]["annotations"]["nodeagent.io/health-check"] = "ping"
    t = translate([ingress("shop", [rule("a.test", path("/"))])], services=[annotated])
    assert t.routes.rules[0].health_check is None
    assert [p.reason for p in t.problems] == ["InvalidHealthCheck"]
