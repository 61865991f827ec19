"""The controller process against the fake API server: which changes recompute the config
(only inputs of it) and which only bring the leader's writes back (status, watcher reports).

Assertions about "no recompute" read `recompute_triggers`, which the cache handlers bump
synchronously as they decide: once the controller's cache holds a change, the decision
for it has been made, so no sleeping is involved."""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from nodeagent.config import NodeConfig
from nodeagent.controller.bootstrap import (
    CA_CONFIGMAP,
    SERVER_SERVICE,
    SERVER_TLS_SECRET,
    certificate_names,
    secret_value,
)
from nodeagent.controller.controller import Controller, ControllerSettings, serve_controller
from nodeagent.controller.status import WATCHERS_GC_AFTER, WATCHERS_LABEL
from nodeagent.kube import (
    CONFIGMAPS,
    ENDPOINTSLICES,
    INGRESSCLASSES,
    INGRESSES,
    NODES,
    PODS,
    SECRETS,
    SERVICES,
    Cache,
    KubeClient,
    NotFound,
    Resource,
)
from nodeagent.kube.events import rfc3339
from nodeagent.testing.fakekube.server import FakeKube
from nodeagent.trust import pki
from tests.controller.identity import add_agent_token, obtain_identity
from tests.controller.pods import pod, target_ref
from tests.controller.test_configserver import get

NS = "default"


async def wait_for(predicate: Callable[[], bool], what: str, within: float = 10.0) -> None:
    """Poll a condition on plain data the controller updates (no event to wait on)."""
    with trio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.02)


async def seen(cache: Cache, obj: dict[str, Any]) -> None:
    """Until the controller's cache holds this exact write of `obj`."""
    meta = obj["metadata"]
    await cache.wait_until(lambda c: (c.get(meta["name"], meta.get("namespace")) or {}).get(
        "metadata", {}).get("resourceVersion") == meta["resourceVersion"])


async def start_controller(nursery: trio.Nursery, fake: FakeKube, tmp_path: Path
                           ) -> Controller:
    settings = ControllerSettings(
        namespace=NS, identity="c1", listen_host="127.0.0.1", listen_port=0,
        kubeconfig=fake.write_kubeconfig(tmp_path / "controller-kubeconfig"),
        lease_duration=3.0, leader_retry=0.5, tls_names=("127.0.0.1",))
    controller: Controller = await nursery.start(functools.partial(serve_controller, settings))
    await wait_for(lambda: controller.is_leader, "leadership")
    return controller


def rule_paths(controller: Controller) -> list[str]:
    servers = controller.versions.get("servers")
    return [] if servers is None else [r.path for r in servers[1].ingress.rules]


async def create_app(kube: KubeClient) -> dict[str, Any]:
    await kube.create(INGRESSCLASSES, {"metadata": {"name": "nodeagent"}, "spec": {
        "controller": "nodeagent.io/ingress-controller"}})
    await kube.create(NODES, {"metadata": {"name": "edge-1", "labels": {"site": "a"}},
                              "spec": {"podCIDRs": ["10.1.0.0/24"]},
                              "status": {"addresses": [
                                  {"type": "InternalIP", "address": "192.168.7.10"}]}})
    web = pod(NS, "web-0", "edge-1", "10.1.0.5")
    created = await kube.create(PODS, web)  # the API server drops a new Pod's status
    await kube.update_status(PODS, dict(created, status=web["status"]))
    await kube.create(SERVICES, {"metadata": {"name": "web", "namespace": NS}, "spec": {
        "ports": [{"name": "http", "port": 80}]}})
    await kube.create(ENDPOINTSLICES, {
        "metadata": {"name": "web-1", "namespace": NS,
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
        "endpoints": [{"addresses": ["10.1.0.5"], "nodeName": "edge-1",
                       "targetRef": target_ref(NS, "web-0"),
                       "conditions": {"ready": True}}]})
    return await kube.create(INGRESSES, ingress("/"))


def ingress(path: str, **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": "shop", "namespace": NS}, "spec": {
        "ingressClassName": "nodeagent", **extra, "rules": [{"host": "shop.test", "http": {
            "paths": [{"path": path, "pathType": "Prefix", "backend": {"service": {
                "name": "web", "port": {"name": "http"}}}}]}}]}}


async def replace(kube: KubeClient, resource: Resource, obj: dict[str, Any],
                  change: Callable[[dict[str, Any]], None], *, status: bool = False
                  ) -> dict[str, Any]:
    meta = obj["metadata"]
    current = await kube.get(resource, meta["name"], namespace=meta.get("namespace"))
    change(current)
    return await (kube.update_status if status else kube.update)(resource, current)


async def test_watcher_reports_feed_status_not_config_and_ingresses_feed_config(
        nursery: trio.Nursery, fake_kube: FakeKube, kube: KubeClient, tmp_path: Path) -> None:
    controller = await start_controller(nursery, fake_kube, tmp_path)
    created = await create_app(kube)
    await wait_for(lambda: rule_paths(controller) == ["/"], "the Ingress in the config")

    # Another replica's watcher report, created and rewritten: never a recompute.
    triggers = controller.recompute_triggers
    report = await kube.create(CONFIGMAPS, {
        "metadata": {"name": "nodeagent-watchers-c2", "namespace": NS,
                     "labels": {WATCHERS_LABEL: "true"}},
        "data": {"nodes": "edge-1", "updated": rfc3339()}})
    await seen(controller.caches["watchers"], report)
    report = await replace(kube, CONFIGMAPS, report, lambda o: o["data"].update(
        nodes="", updated=rfc3339()))
    await seen(controller.caches["watchers"], report)
    assert controller.recompute_triggers == triggers

    # An Ingress spec change: a recompute that publishes the new path.
    recomputes = controller.recomputes
    changed = await replace(kube, INGRESSES, created,
                            lambda o: o["spec"]["rules"][0]["http"]["paths"][0].update(
                                path="/api"))
    await seen(controller.caches["ingresses"], changed)
    assert controller.recompute_triggers == triggers + 1
    await wait_for(lambda: rule_paths(controller) == ["/api"], "the new path in the config")
    assert controller.recomputes > recomputes


async def test_status_writes_do_not_recompute_but_the_leader_keeps_status_right(
        nursery: trio.Nursery, fake_kube: FakeKube, kube: KubeClient, tmp_path: Path) -> None:
    controller = await start_controller(nursery, fake_kube, tmp_path)
    await create_app(kube)
    server = await kube.create(SERVICES, {"metadata": {
        "name": SERVER_SERVICE, "namespace": NS}, "spec": {
        "type": "LoadBalancer", "ports": [{"port": 80}]}})
    await wait_for(lambda: rule_paths(controller) == ["/"], "the Ingress in the config")
    await seen(controller.caches["services"], server)
    triggers = controller.recompute_triggers

    # The servers' LoadBalancer address appears: the leader writes it into the Ingress
    # status (its own write is a status-only change too: neither recomputes).
    server = await replace(kube, SERVICES, server, lambda o: o.update(status={
        "loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}), status=True)
    await seen(controller.caches["services"], server)

    def address_written(cache: Cache) -> bool:
        obj = cache.get("shop", NS) or {}
        return bool((obj.get("status") or {}).get("loadBalancer", {}).get("ingress") == [
            {"ip": "203.0.113.7"}])

    with trio.fail_after(10):
        await controller.caches["ingresses"].wait_until(address_written)
    # Someone else overwrites it: the leader puts it back, still without a recompute.
    current = await kube.get(INGRESSES, "shop", namespace=NS)
    overwritten = await kube.update_status(INGRESSES, dict(current, status={
        "loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}))
    await seen(controller.caches["ingresses"], overwritten)
    with trio.fail_after(10):
        await controller.caches["ingresses"].wait_until(address_written)

    # A Node heartbeat (conditions) is no config input; a label is.
    node = await replace(kube, NODES, {"metadata": {"name": "edge-1"}}, lambda o: o.update(
        status=dict(o.get("status") or {}, conditions=[
            {"type": "Ready", "status": "True", "lastHeartbeatTime": rfc3339()}])),
        status=True)
    await seen(controller.caches["nodes"], node)
    # A TLS Secret no Ingress names (e.g. another controller's certificate) is not one
    # either. (Opaque Secrets such as Helm release records are not even cached: the
    # informer's field selector asks only for kubernetes.io/tls.)
    unnamed = await kube.create(SECRETS, {"metadata": {"name": "other-tls", "namespace": NS},
                                          "type": "kubernetes.io/tls",
                                          "stringData": {"tls.crt": "x", "tls.key": "y"}})
    await seen(controller.caches["secrets"], unnamed)
    assert controller.recompute_triggers == triggers

    node = await replace(kube, NODES, node, lambda o: o["metadata"]["labels"].update(
        site="b"))
    await seen(controller.caches["nodes"], node)
    assert controller.recompute_triggers == triggers + 1


async def test_a_tls_secret_an_ingress_names_feeds_config(
        nursery: trio.Nursery, fake_kube: FakeKube, kube: KubeClient, tmp_path: Path) -> None:
    controller = await start_controller(nursery, fake_kube, tmp_path)
    created = await create_app(kube)
    await replace(kube, INGRESSES, created, lambda o: o["spec"].update(
        tls=[{"hosts": ["shop.test"], "secretName": "shop-tls"}]))

    def problems() -> list[str]:
        outcome = controller.status.outcome
        return [] if outcome is None else [p.reason for p in outcome.problems]

    await wait_for(lambda: problems() == ["TLSSecretMissing"], "the missing Secret noticed")
    triggers = controller.recompute_triggers
    secret = await kube.create(SECRETS, {"metadata": {"name": "shop-tls", "namespace": NS},
                                         "type": "kubernetes.io/tls",
                                         "data": {"tls.crt": "bm90IGEgY2VydA==",
                                                  "tls.key": "bm90IGEga2V5"}})
    await seen(controller.caches["secrets"], secret)
    assert controller.recompute_triggers == triggers + 1
    await wait_for(lambda: problems() == ["TLSSecretInvalid"], "the Secret read")


async def test_the_leaders_ca_signs_node_certificates_that_read_the_nodes_config(
        nursery: trio.Nursery, fake_kube: FakeKube, kube: KubeClient, tmp_path: Path) -> None:
    """The whole wiring: the leader creates the CA; the replica's TLS listener serves with a
    certificate from it; an agent's token gets a certificate; it reads its node's config."""
    controller = await start_controller(nursery, fake_kube, tmp_path)
    await create_app(kube)
    await wait_for(lambda: (controller.versions.get("node/edge-1") or (0, NodeConfig()))[1]
                   .allows("10.1.0.5", 8080), "edge-1 config with its pod")
    with trio.fail_after(10):
        await controller.caches["secrets"].wait_until(lambda _: controller.bootstrap.ca
                                                      is not None)
    ca_pem = (await kube.get(CONFIGMAPS, CA_CONFIGMAP, namespace=NS))["data"]["ca.crt"]
    url = f"https://127.0.0.1:{controller.listen_port}"
    identity = await obtain_identity(url, ca_pem, add_agent_token(fake_kube, "edge-1",
                                                                  namespace=NS), "node")
    status, body = await get(controller.listen_port, "/v1/config/nodes/edge-1",
                             identity.client_context())
    assert status == 200 and b"10.1.0.5" in body, body
    assert (await get(controller.listen_port, "/v1/config/nodes/edge-2",
                      identity.client_context()))[0] == 403


async def test_the_servers_certificate_is_reissued_at_half_life(
        nursery: trio.Nursery, fake_kube: FakeKube, kube: KubeClient, tmp_path: Path) -> None:
    """Nothing in the cluster changes when the servers' certificate reaches half-life: the
    leader's own timer re-issues it (a 365-day certificate used to last until its names
    changed)."""
    controller = await start_controller(nursery, fake_kube, tmp_path)

    async def server_secret() -> dict[str, Any] | None:
        try:
            return await kube.get(SECRETS, SERVER_TLS_SECRET, namespace=NS)
        except NotFound:
            return None

    with trio.fail_after(10):
        while (await server_secret()) is None:  # noqa: ASYNC110 - polling the API
            await trio.sleep(0.05)
    ca = controller.bootstrap.ca
    assert ca is not None
    dns, ips = controller.bootstrap.server_names()
    # A certificate with the right names, whose half-life is 4 s away (3-4 s: X.509
    # times are whole seconds).
    started = trio.current_time()
    short = pki.issue_server_certificate(ca, dns, ips, valid_for=dt.timedelta(seconds=8),
                                         not_before=dt.datetime.now(dt.UTC))
    secret = await server_secret()
    assert secret is not None
    secret["data"] = {}
    secret["stringData"] = {"tls.crt": short.certificate_pem.decode(),
                            "tls.key": short.key_pem.decode()}
    await kube.update(SECRETS, secret)
    with trio.fail_after(15):
        while True:
            current = await server_secret()
            pem = secret_value(current or {}, "tls.crt")
            if pem and pem != short.certificate_pem.decode().strip():
                break
            await trio.sleep(0.1)
    # Kept until its half-life, not replaced on sight.
    assert trio.current_time() - started >= 2.9, trio.current_time() - started
    renewed = pki.load_certificate(pem.encode())
    assert renewed.not_valid_after_utc - renewed.not_valid_before_utc > dt.timedelta(days=1)
    assert certificate_names(pem) >= set(dns) | set(ips)


async def test_metrics_count_recomputes_and_watch_restarts_by_resource(
        nursery: trio.Nursery, fake_kube: FakeKube, kube: KubeClient, tmp_path: Path) -> None:
    controller = await start_controller(nursery, fake_kube, tmp_path)

    def sample(name: str, **labels: str) -> float:
        value = controller.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    assert sample("nodeagent_controller_recompute_seconds_count") >= 1
    assert sample("nodeagent_controller_watch_restarts_total", resource="nodes",
                  reason="error") + sample("nodeagent_controller_watch_restarts_total",
                                           resource="nodes", reason="closed") == 0
    # Every watch cut mid-stream: each informer opens its watch again, counted per resource.
    fake_kube.drop_watches()
    await wait_for(lambda: all(sample("nodeagent_controller_watch_restarts_total",
                                      resource=r, reason="error") +
                               sample("nodeagent_controller_watch_restarts_total",
                                      resource=r, reason="closed") >= 1
                               for r in ("nodes", "ingresses", "clustertunnels")),
                   "watch restarts counted")
    recomputes = sample("nodeagent_controller_recompute_seconds_count")
    await create_app(kube)
    await wait_for(lambda: rule_paths(controller) == ["/"], "the Ingress in the config")
    assert sample("nodeagent_controller_recompute_seconds_count") > recomputes

    # The endpoint's Pod gets another address: the endpoint is refused, counted by reason.
    def backends() -> int:
        servers = controller.versions.get("servers")
        return 0 if servers is None else len(servers[1].ingress.rules[0].backends)

    await wait_for(lambda: backends() == 1, "the endpoint of its Pod")  # once its IP is seen
    assert sample("nodeagent_controller_refused_backends", reason="not_pod_address") == 0
    current = await kube.get(PODS, "web-0", namespace=NS)
    await kube.update_status(PODS, dict(current, status={"podIP": "10.1.0.6",
                                                         "podIPs": [{"ip": "10.1.0.6"}]}))
    await wait_for(lambda: backends() == 0, "the endpoint refused")
    assert sample("nodeagent_controller_refused_backends", reason="not_pod_address") == 1


async def test_the_leader_deletes_the_watcher_reports_of_replicas_long_gone(
        nursery: trio.Nursery, fake_kube: FakeKube, kube: KubeClient, tmp_path: Path) -> None:
    """Every rollout of the controller leaves its old replicas' reports behind: the
    leader deletes those not renewed for WATCHERS_GC_AFTER, and only those."""
    def report(name: str, updated: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": NS,
                             "labels": {WATCHERS_LABEL: "true"}},
                "data": {"nodes": "edge-1", "updated": updated}}

    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=WATCHERS_GC_AFTER + 60)
    for name, updated in (("nodeagent-watchers-gone", rfc3339(long_ago)),
                          ("nodeagent-watchers-live", rfc3339()),
                          # A stamp with no zone and one that is no time: never deleted,
                          # and never counted as connected nodes either (no crash).
                          ("nodeagent-watchers-naive", long_ago.replace(tzinfo=None)
                           .isoformat()),
                          ("nodeagent-watchers-odd", "yesterday")):
        fake_kube.put_object(report(name, updated))
    controller = await start_controller(nursery, fake_kube, tmp_path)

    def names() -> set[str]:
        return {o["metadata"]["name"] for o in fake_kube.objects("configmaps", namespace=NS)
                if WATCHERS_LABEL in o["metadata"].get("labels", {})}

    await wait_for(lambda: "nodeagent-watchers-gone" not in names(),
                   "the stale report deleted")
    await wait_for(lambda: "nodeagent-watchers-c1" in names(), "this replica's own report")
    assert {"nodeagent-watchers-live", "nodeagent-watchers-naive",
            "nodeagent-watchers-odd"} <= names()
    assert controller.watchers.connected_nodes() == {"edge-1"}  # the live report's
