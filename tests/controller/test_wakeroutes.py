"""Scale to zero, the pure part: annotations → settings, the Ingress rules' `wake`, why a
workload fails to start, and what the config and the servers' reports read."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.controller.wakeroutes import (
    SettingsError,
    apply_wake,
    parse_duration,
    pod_failure,
    settings_view,
    wake_load_balancers,
    wake_settings,
    workload_owner,
)
from tests.controller.test_ingress import NS, endpoint, ingress, path, rule, service, slice_
from tests.controller.test_ingress import translate as translate_ingress
from tests.controller.test_loadbalancers import DNS_PORTS, lb_service
from tests.controller.test_loadbalancers import translate as translate_lbs


def sleepy(name: str = "web", **annotations: str) -> dict[str, Any]:
    svc = service(name, selector={"app": name})
    svc["metadata"]["annotations"] = {"nodeagent.io/idle-after": "15m", **annotations}
    return svc


def web_pod(name: str, *, ready: bool = False, waiting: str | None = None,
            message: str = "", owner: tuple[str, str] = ("ReplicaSet", "web-7f9")
            ) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [{"type": "Ready",
                                              "status": "True" if ready else "False"}]}
    if waiting:
        status["containerStatuses"] = [{"name": "web", "state": {"waiting": {
            "reason": waiting}}, "lastState": {"terminated": {"message": message}}}]
    return {"metadata": {"name": name, "namespace": NS, "labels": {"app": "web"},
                         "ownerReferences": [{"kind": owner[0], "name": owner[1],
                                              "controller": True}]},
            "spec": {"nodeName": "edge-1"}, "status": status}


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90), ("1.5s", 1.5), ("15m", 900), ("1h30m", 5400), ("250ms", 0.25)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "15x", "m15", "-5", "0s", "1h 30m", "9" * 400])
def test_bad_durations_are_refused_with_a_clear_error(text: str) -> None:
    with pytest.raises(SettingsError):
        parse_duration(text)


def test_settings_from_annotations_and_what_the_config_reads_of_them() -> None:
    assert wake_settings(service()) is None
    got = wake_settings(sleepy(**{"nodeagent.io/wake-timeout": "30s",
                                  "nodeagent.io/max-pending": "5",
                                  "nodeagent.io/workload": "statefulset/db"}))
    assert got is not None
    assert (got.idle_after, got.timeout, got.max_pending, got.workload) == (
        900, 30, 5, ("statefulsets", "db"))
    for bad in ({"nodeagent.io/idle-after": "100ms"}, {"nodeagent.io/max-pending": "-1"},
                {"nodeagent.io/max-pending": "many"}, {"nodeagent.io/wake-timeout": "2h"},
                {"nodeagent.io/workload": "daemonset/x"}, {"nodeagent.io/workload": "web"},
                {"nodeagent.io/starting-page": "maybe"}):
        with pytest.raises(SettingsError):
            wake_settings(sleepy(**bad))
    page = wake_settings(sleepy(**{"nodeagent.io/starting-page": "true"}))
    assert page is not None and page.starting_page and not got.starting_page
    # The controller's own state annotations do not feed the config.
    a, b = sleepy(), sleepy()
    b["metadata"]["annotations"]["nodeagent.io/scale-to-zero"] = '{"state":"sleeping"}'
    b["metadata"]["annotations"]["nodeagent.io/last-request"] = "2026-01-01T00:00:00Z"
    assert settings_view(a) == settings_view(b)
    assert settings_view(a) != settings_view(sleepy(**{"nodeagent.io/max-pending": "3"}))


def test_rules_of_an_opted_in_service_get_wake_and_others_do_not() -> None:
    t = translate_ingress([ingress("shop", [rule("a.test", path("/")),
                                            rule("b.test", path("/", svc="api"))])],
                          services=[sleepy(**{"nodeagent.io/wake-timeout": "45s"}),
                                    service("api")],
                          slices=[slice_("api", endpoint("10.1.0.5"))])
    assert t.rule_services == ((NS, "web"), (NS, "api"))
    out = apply_wake(t.routes, dict(enumerate(t.rule_services)), t.default_service,
                     [sleepy(**{"nodeagent.io/wake-timeout": "45s"}), service("api")], [],
                     enabled=True)
    a, b = out.routes.rules
    assert a.wake is not None and (a.wake.service, a.wake.timeout, a.wake.failure) == (
        f"{NS}/web", 45, "")
    assert b.wake is None
    assert set(out.enabled) == {(NS, "web")}
    # Switched off by a ClusterTunnel: nothing sleeps, the routes are as translated.
    off = apply_wake(t.routes, dict(enumerate(t.rule_services)), None, [sleepy()], [],
                     enabled=False)
    assert off.routes == t.routes and off.enabled == {}


def test_a_crashing_workload_is_the_rules_failure_only_while_nothing_is_ready() -> None:
    t = translate_ingress([ingress("shop", [rule("a.test", path("/"))])],
                          services=[sleepy()], slices=[])
    crash = web_pod("web-a", waiting="CrashLoopBackOff", message="panic: no DB\n")
    out = apply_wake(t.routes, dict(enumerate(t.rule_services)), None, [sleepy()], [crash],
                     enabled=True)
    (r,) = out.routes.rules
    assert r.wake is not None
    assert r.wake.failure == "pod web-a: CrashLoopBackOff: panic: no DB"
    ok = apply_wake(t.routes, dict(enumerate(t.rule_services)), None, [sleepy()],
                    [crash, web_pod("web-b", ready=True)], enabled=True)
    assert ok.routes.rules[0].wake is not None and ok.routes.rules[0].wake.failure == ""
    # A pod still starting is not failing.
    assert pod_failure(web_pod("web-c", waiting="ContainerCreating")) is None


def test_load_balancer_ports_of_an_opted_in_service_get_the_same_wake() -> None:
    """A LoadBalancer Service with idle-after: every port gets the wake an Ingress rule
    to it would (the same parsing, the same failure while it has no endpoints); other
    Services' ports, and every port with the feature off, get none."""
    dns = lb_service("dns", DNS_PORTS)
    dns["metadata"]["annotations"] = {"nodeagent.io/idle-after": "90s",
                                      "nodeagent.io/wake-timeout": "30s",
                                      "nodeagent.io/max-pending": "7"}
    dns["spec"]["selector"] = {"app": "dns"}
    other = lb_service("other", [{"name": "dns-tcp", "port": 5300, "protocol": "TCP"}],
                       namespace="app")
    t = translate_lbs([dns, other])
    empty = translate_ingress([], services=[], slices=[])
    out = apply_wake(empty.routes, {}, None, [dns, other], [], enabled=True)
    assert set(out.enabled) == {("app", "dns")}
    woken = {s.name: s for s in wake_load_balancers(t.services, out)}
    wakes = [(p.protocol, p.wake) for p in woken["app/dns"].ports]
    assert [(proto, w.service, w.timeout, w.max_pending, w.failure) for proto, w in wakes
            if w is not None] == [("udp", "app/dns", 30, 7, ""), ("tcp", "app/dns", 30, 7, "")]
    assert all(p.wake is None for p in woken["app/other"].ports)
    # Asleep (no endpoints) while its pods crash: the ports carry the failure.
    crash = web_pod("dns-a", waiting="CrashLoopBackOff", message="bad config")
    crash["metadata"].update(namespace="app", labels={"app": "dns"})
    asleep_ = translate_lbs([dns], slices=[])
    out = apply_wake(empty.routes, {}, None, [dns], [crash], enabled=True)
    (svc,) = wake_load_balancers(asleep_.services, out)
    assert {p.wake.failure for p in svc.ports if p.wake is not None} == {
        "pod dns-a: CrashLoopBackOff: bad config"}
    assert all(p.backends == () for p in svc.ports)
    # Switched off by a ClusterTunnel: the ports are as translated.
    off = apply_wake(empty.routes, {}, None, [dns], [], enabled=False)
    assert wake_load_balancers(t.services, off) == t.services


def test_a_bad_annotation_is_a_problem_on_the_service_and_it_does_not_sleep() -> None:
    bad = sleepy(**{"nodeagent.io/idle-after": "soon"})
    t = translate_ingress([ingress("shop", [rule("a.test", path("/"))])], services=[bad],
                          slices=[])
    out = apply_wake(t.routes, dict(enumerate(t.rule_services)), None, [bad], [],
                     enabled=True)
    assert out.routes.rules[0].wake is None
    (problem,) = out.problems
    assert (problem.kind, problem.name, problem.reason) == ("Service", "web",
                                                            "InvalidScaleToZero")


def test_the_workload_is_the_owner_of_the_services_pods() -> None:
    assert workload_owner(sleepy(), [web_pod("web-a")]) == ("ReplicaSet", "web-7f9")
    assert workload_owner(sleepy(), [web_pod("db-0", owner=("StatefulSet", "db"))]) == (
        "StatefulSet", "db")
    other = web_pod("x")
    other["metadata"]["labels"] = {"app": "other"}
    assert workload_owner(sleepy(), [other]) is None
