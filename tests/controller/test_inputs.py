"""Which cache changes recompute the config, which call for the leader's writes, and how
the leader's write task runs them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import trio
import trio.testing

from nodeagent.controller.controller import LeaderWrites
from nodeagent.controller.inputs import (
    LeaderWrite,
    feeds_config,
    leader_writes,
    secret_feeds_config,
    secret_references,
)
from nodeagent.kube import CacheEvent

NODE = {"metadata": {"name": "n1", "resourceVersion": "1", "labels": {"site": "a"}},
        "spec": {"podCIDRs": ["10.1.0.0/24"]},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.7.10"}],
                   "conditions": [{"type": "Ready", "status": "True"}]}}
INGRESS = {"metadata": {"name": "shop", "namespace": "a", "resourceVersion": "1",
                        "annotations": {"nodeagent.io/ssl-redirect": "false"}},
           "spec": {"rules": [], "tls": [{"secretName": "shop-tls"}, {"hosts": ["x"]}]},
           "status": {}}


def modified(obj: dict[str, Any], change: Any) -> CacheEvent:
    new = copy.deepcopy(obj)
    change(new)
    new["metadata"]["resourceVersion"] = "2"
    return CacheEvent("MODIFIED", new, obj)


def test_only_what_the_computation_reads_feeds_config() -> None:
    assert feeds_config("nodes", CacheEvent("ADDED", NODE))
    assert feeds_config("nodes", CacheEvent("DELETED", NODE, NODE))
    assert not feeds_config("nodes", modified(NODE, lambda o: o["status"]["conditions"][0]
                                              .update(status="False")))
    assert not feeds_config("nodes", modified(NODE, lambda o: o["metadata"].update(
        managedFields=[{"manager": "kubelet"}])))
    assert feeds_config("nodes", modified(NODE, lambda o: o["metadata"]["labels"].update(
        site="b")))
    assert feeds_config("nodes", modified(NODE, lambda o: o["status"]["addresses"].clear()))
    assert feeds_config("nodes", modified(NODE, lambda o: o["spec"].update(podCIDRs=[])))
    assert not feeds_config("ingresses", modified(INGRESS, lambda o: o.update(
        status={"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}})))
    assert feeds_config("ingresses", modified(INGRESS, lambda o: o["metadata"][
        "annotations"].clear()))
    tunnel = {"metadata": {"name": "t", "finalizers": []}, "spec": {}}
    assert not feeds_config("clustertunnels", modified(tunnel, lambda o: o["metadata"].update(
        finalizers=["nodeagent.io/cleanup"])))
    assert feeds_config("clustertunnels", modified(tunnel, lambda o: o["metadata"].update(
        deletionTimestamp="2024-01-01T00:00:00Z")))
    report = {"metadata": {"name": "nodeagent-watchers-c2", "namespace": "ns"}, "data": {}}
    assert not feeds_config("watchers", CacheEvent("ADDED", report))
    pod = {"metadata": {"name": "web-0", "namespace": "shop", "uid": "u"},
           "spec": {"nodeName": "edge-1"}, "status": {"phase": "Pending", "podIP": None}}
    assert not feeds_config("pods", modified(pod, lambda o: o["status"].update(
        phase="Running", conditions=[{"type": "Ready", "status": "True"}])))
    assert feeds_config("pods", modified(pod, lambda o: o["status"].update(
        podIP="10.1.0.5", podIPs=[{"ip": "10.1.0.5"}])))


def test_secrets_feed_config_only_when_an_ingress_names_them() -> None:
    refs = secret_references([INGRESS])
    assert refs == {("a", "shop-tls")}
    named = {"metadata": {"name": "shop-tls", "namespace": "a"}, "data": {"tls.crt": "eA=="}}
    other = {"metadata": {"name": "shop-tls", "namespace": "b"}, "data": {"tls.crt": "eA=="}}
    assert secret_feeds_config(CacheEvent("ADDED", named), refs)
    assert not secret_feeds_config(CacheEvent("ADDED", other), refs)
    assert not secret_feeds_config(modified(named, lambda o: o["metadata"].update(
        labels={"x": "y"})), refs)
    assert secret_feeds_config(modified(named, lambda o: o["data"].update(
        {"tls.key": "eQ=="})), refs)


def test_what_the_leader_redoes_for_changes_that_are_not_config() -> None:
    report = {"metadata": {"name": "nodeagent-watchers-c2", "namespace": "ns"}}
    assert leader_writes("watchers", CacheEvent("ADDED", report), "ns") == {
        LeaderWrite.TUNNEL_STATUS}
    server = {"metadata": {"name": "nodeagent-server", "namespace": "ns"}, "status": {}}
    assert leader_writes("services", modified(server, lambda o: o.update(status={
        "loadBalancer": {}})), "ns") == {LeaderWrite.INGRESS_STATUS, LeaderWrite.PKI,
                                         LeaderWrite.SERVICE_STATUS}
    assert leader_writes("services", modified(server, lambda o: None), "elsewhere") == set()
    # Someone else's write on a Service's status: the leader puts its own back (the
    # LoadBalancer Services it serves).
    user = {"metadata": {"name": "dns", "namespace": "app"}, "status": {}}
    assert leader_writes("services", modified(user, lambda o: o.update(status={
        "loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}})), "ns") == {
        LeaderWrite.SERVICE_STATUS}
    assert leader_writes("services", modified(user, lambda o: o.update(spec={})),
                         "ns") == set()
    assert leader_writes("ingresses", modified(INGRESS, lambda o: o.update(status={
        "loadBalancer": {}})), "ns") == {LeaderWrite.INGRESS_STATUS}
    assert leader_writes("ingresses", modified(INGRESS, lambda o: o["spec"].update(
        rules=[{}])), "ns") == set()
    ca = {"metadata": {"name": "nodeagent-ca", "namespace": "ns"}}
    assert leader_writes("secrets", CacheEvent("DELETED", ca, ca), "ns") == {LeaderWrite.PKI}


async def test_leader_writes_run_when_marked_and_retry_only_failures(
        autojump_clock: trio.testing.MockClock) -> None:
    calls: list[LeaderWrite] = []
    failing = {LeaderWrite.PKI}

    def write(which: LeaderWrite) -> Any:
        async def run() -> bool:
            calls.append(which)
            return which not in failing
        return run

    writes = LeaderWrites({w: write(w) for w in LeaderWrite}, delay=0.05, retry=5.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writes.run)
        writes.mark(LeaderWrite.TUNNEL_STATUS, LeaderWrite.PKI)
        writes.mark(LeaderWrite.TUNNEL_STATUS)
        await trio.sleep(1)
        assert calls == [LeaderWrite.PKI, LeaderWrite.TUNNEL_STATUS]  # once each, in order
        await trio.sleep(5)
        assert calls[2:] == [LeaderWrite.PKI]  # the failed one again, alone
        failing.clear()
        await trio.sleep(5)
        assert calls[3:] == [LeaderWrite.PKI]
        await trio.sleep(60)
        assert len(calls) == 4  # nothing due: nothing runs
        nursery.cancel_scope.cancel()


async def test_urgent_leader_writes_go_first_and_the_rest_wait_their_delay(
        autojump_clock: trio.abc.Clock) -> None:
    # The PKI write does not wait behind the status writes, which wait `delay` so that a
    # fan-out's config delivery has the CPU first.
    calls: list[tuple[LeaderWrite, float]] = []

    def write(which: LeaderWrite) -> Any:
        async def run() -> bool:
            calls.append((which, trio.current_time()))
            return True
        return run

    writes = LeaderWrites({w: write(w) for w in LeaderWrite}, delay=1.0, retry=5.0,
                          urgent=frozenset({LeaderWrite.PKI}), urgent_delay=0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writes.run)
        start = trio.current_time()
        writes.mark(*LeaderWrite)
        await trio.sleep(3)
        assert [w for w, _ in calls] == [LeaderWrite.PKI, LeaderWrite.EVENTS,
                                         LeaderWrite.INGRESS_STATUS, LeaderWrite.TUNNEL_STATUS,
                                         LeaderWrite.SERVICE_STATUS]
        assert calls[0][1] - start == pytest.approx(0.05)
        assert all(t - start == pytest.approx(1.05) for _, t in calls[1:])
        writes.mark(LeaderWrite.EVENTS)  # no urgent one due: the normal delay
        await trio.sleep(3)
        assert calls[5][0] is LeaderWrite.EVENTS
        assert calls[5][1] - start == pytest.approx(4.0)
        nursery.cancel_scope.cancel()


def test_a_services_udp_idle_timeout_feeds_config_and_other_annotations_do_not() -> None:
    svc = {"metadata": {"name": "dns", "namespace": "app", "annotations": {}},
           "spec": {"type": "LoadBalancer"}}
    assert feeds_config("services", modified(svc, lambda o: o["metadata"].update(
        annotations={"nodeagent.io/udp-idle-timeout": "5"})))
    assert not feeds_config("services", modified(svc, lambda o: o["metadata"].update(
        annotations={"example.com/note": "x"})))
    assert not feeds_config("services", modified(svc, lambda o: o.update(status={
        "loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}})))
