"""Recompute work follows what changed: the memos of translate_ingresses and compute
translate only the Ingresses and build only the node configs whose inputs changed (counted,
not timed), and give the same outcome as a computation from scratch; a config watch is
woken only for the keys a change touched."""

from __future__ import annotations

import copy
from typing import Any

import trio
import trio.testing

from nodeagent.config import AllowRule, NodeConfig
from nodeagent.controller.compute import ComputeMemo, ConfigVersions, compute, parse_tunnels
from nodeagent.controller.configserver import ConfigStreamServer
from nodeagent.controller.ingress import TranslationMemo, translate_ingresses
from nodeagent.controller.metrics import ControllerMetrics
from tests.controller.pods import pods_for
from tests.controller.test_compute import node, tunnel
from tests.controller.test_ingress import OURS, endpoint, ingress, path, rule, service, slice_

NODES, HOSTS = 20, 40


def cluster() -> dict[str, list[dict[str, Any]]]:
    """NODES nodes; HOSTS Ingresses, each with its Service and EndpointSlice, the
    backend of Ingress h on node h % NODES."""
    objects: dict[str, list[dict[str, Any]]] = {
        "nodes": [node(f"n{i}", f"192.168.0.{i + 1}", pod_cidrs=[f"10.{i}.0.0/24"])
                  for i in range(NODES)],
        "services": [], "slices": [], "ingresses": []}
    for h in range(HOSTS):
        n = h % NODES
        objects["services"].append(service(f"s{h}"))
        objects["slices"].append(slice_(f"s{h}", endpoint(f"10.{n}.0.{2 + h // NODES}",
                                                          node=f"n{n}")))
        objects["ingresses"].append(ingress(f"i{h}", [rule(f"h{h}.test", path(
            "/", svc=f"s{h}"))]))
    return objects


def run(objects: dict[str, list[dict[str, Any]]], tunnels: list[dict[str, Any]],
        tmemo: TranslationMemo | None = None, cmemo: ComputeMemo | None = None) -> Any:
    translation = translate_ingresses(
        ingresses=objects["ingresses"], ingress_classes=[OURS], services=objects["services"],
        endpoint_slices=objects["slices"], secrets=[], nodes=objects["nodes"],
        pods=objects["pods"] if "pods" in objects else pods_for(objects["slices"]),
        memo=tmemo)
    parsed, _ = parse_tunnels(tunnels)
    return compute(nodes=objects["nodes"], tunnels=parsed, translation=translation,
                   services=objects["services"], endpoint_slices=objects["slices"],
                   memo=cmemo)


def test_a_change_to_one_ingress_translates_it_and_builds_one_node_config() -> None:
    objects = cluster()
    tunnels = [tunnel("t", {"allowedNodePorts": [10250]})]
    tmemo, cmemo = TranslationMemo(), ComputeMemo()
    first = run(objects, tunnels, tmemo, cmemo)
    assert (tmemo.translated, cmemo.built) == (HOSTS, NODES)

    # Nothing changed: nothing translated or built, the very same node configs.
    again = run(objects, tunnels, tmemo, cmemo)
    assert (tmemo.translated, cmemo.built) == (HOSTS, NODES)
    assert all(again.nodes[n] is first.nodes[n] for n in first.nodes)

    # Ingress 7's backend moves to Service s3 (whose pod on n3 Ingress 3 already
    # reaches): one Ingress translated, one node concerned (n7 loses its target).
    objects["ingresses"][7] = ingress("i7", [rule("h7.test", path("/", svc="s3"))])
    changed = run(objects, tunnels, tmemo, cmemo)
    assert (tmemo.translated, cmemo.built) == (HOSTS + 1, NODES + 1)
    rebuilt = {n for n in changed.nodes if changed.nodes[n] is not first.nodes[n]}
    assert rebuilt == {"n7"}
    assert not changed.nodes["n7"].allows("10.7.0.2", 8080)
    assert changed.nodes["n3"].allows("10.3.0.2", 8080)
    # ... and the outcome is exactly a computation from scratch.
    fresh = run(objects, tunnels)
    assert changed.nodes == fresh.nodes and changed.routes == fresh.routes


def test_a_change_to_an_endpoint_slice_or_a_node_retranslates_only_its_readers() -> None:
    objects = cluster()
    tmemo, cmemo = TranslationMemo(), ComputeMemo()
    run(objects, [], tmemo, cmemo)

    # Service s5's endpoint moves to another address on n5: one Ingress, one node.
    objects["slices"][5] = slice_("s5", endpoint("10.5.0.99", node="n5"))
    out = run(objects, [], tmemo, cmemo)
    assert (tmemo.translated, cmemo.built) == (HOSTS + 1, NODES + 1)
    assert out.nodes["n5"].allows("10.5.0.99", 8080)

    # Node n4's podCIDR changes: the Ingresses with endpoints on it (i4, i24) are
    # translated again (their endpoints are now off the node: dropped), and n4 rebuilt.
    n4 = copy.deepcopy(objects["nodes"][4])
    n4["spec"]["podCIDRs"] = ["10.99.0.0/24"]
    objects["nodes"][4] = n4
    out = run(objects, [], tmemo, cmemo)
    assert (tmemo.translated, cmemo.built) == (HOSTS + 3, NODES + 2)
    assert not out.nodes["n4"].allows("10.4.0.2", 8080)
    fresh = run(objects, [])
    assert out.nodes == fresh.nodes and out.routes == fresh.routes
    assert [p.reason for p in out.problems] == [p.reason for p in fresh.problems] and \
        {p.reason for p in out.problems} == {"EndpointNotOnNode"}


def test_a_change_to_a_pod_retranslates_only_the_ingresses_its_endpoints_feed() -> None:
    objects = cluster()
    objects["pods"] = pods_for(objects["slices"])
    tmemo, cmemo = TranslationMemo(), ComputeMemo()
    run(objects, [], tmemo, cmemo)
    # A Pod's status conditions change: nothing translated again.
    objects["pods"][3] = copy.deepcopy(objects["pods"][3])
    objects["pods"][3]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    run(objects, [], tmemo, cmemo)
    assert tmemo.translated == HOSTS
    # Its IP changes (it was replaced): its Ingress alone, whose endpoint is now refused.
    objects["pods"][3] = copy.deepcopy(objects["pods"][3])  # a new object, as informers do
    objects["pods"][3]["status"]["podIP"] = "10.3.0.250"
    objects["pods"][3]["status"]["podIPs"] = [{"ip": "10.3.0.250"}]
    out = run(objects, [], tmemo, cmemo)
    assert tmemo.translated == HOSTS + 1
    assert not out.nodes["n3"].allows("10.3.0.2", 8080)
    fresh = run(objects, [])
    assert out.nodes == fresh.nodes and out.routes == fresh.routes


def test_a_tunnel_change_rebuilds_every_node_and_removed_objects_leave_the_memo() -> None:
    objects = cluster()
    tmemo, cmemo = TranslationMemo(), ComputeMemo()
    run(objects, [tunnel("t", {"allowedNodePorts": [10250]})], tmemo, cmemo)
    out = run(objects, [tunnel("t", {"allowedNodePorts": [10255]})], tmemo, cmemo)
    assert (tmemo.translated, cmemo.built) == (HOSTS, 2 * NODES)  # a fan-out
    assert out.nodes["n0"].allows("192.168.0.1", 10255)
    # ... that parses no node's addresses and podCIDRs again, nor walks the Services
    # for the protected ranges (only serviceCidrs would change those).
    assert (cmemo.parsed, cmemo.walked) == (NODES, 1)
    fresh = run(objects, [tunnel("t", {"allowedNodePorts": [10255]})])
    assert out.nodes == fresh.nodes and out.routes == fresh.routes
    out = run(objects, [tunnel("t", {"allowedNodePorts": [10255],
                                     "serviceCidrs": ["10.96.0.0/12"]})], tmemo, cmemo)
    assert (cmemo.parsed, cmemo.walked) == (NODES, 2)
    assert out.routes.protected == run(objects, [tunnel("t", {
        "allowedNodePorts": [10255], "serviceCidrs": ["10.96.0.0/12"]})]).routes.protected
    # A node's address changes: its facts alone are parsed again.
    n2 = copy.deepcopy(objects["nodes"][2])
    n2["status"]["addresses"][0]["address"] = "192.168.9.9"
    objects["nodes"][2] = n2
    out = run(objects, [tunnel("t", {"allowedNodePorts": [10255]})], tmemo, cmemo)
    assert cmemo.parsed == NODES + 1 and out.nodes["n2"].allows("192.168.9.9", 10255)
    assert not out.nodes["n2"].allows("192.168.0.3", 10255)

    del objects["ingresses"][HOSTS - 1]
    del objects["nodes"][NODES - 1]
    out = run(objects, [tunnel("t", {"allowedNodePorts": [10255]})], tmemo, cmemo)
    assert f"n{NODES - 1}" not in out.nodes and len(out.routes.ingress.rules) == HOSTS - 1
    assert len(tmemo._entries) == HOSTS - 1 and len(cmemo._parts) == NODES - 1


def translate(objects: dict[str, list[dict[str, Any]]], memo: TranslationMemo,
              direct: frozenset[str] = frozenset()) -> Any:
    # Lists made afresh at each call, as the caches' `list()` makes them.
    return translate_ingresses(
        ingresses=list(objects["ingresses"]), ingress_classes=[OURS],
        services=list(objects["services"]), endpoint_slices=list(objects["slices"]),
        secrets=[], nodes=list(objects["nodes"]), pods=objects["pods"],
        direct_namespaces=direct, memo=memo)


def test_a_recompute_none_of_whose_translation_inputs_changed_reuses_the_whole() -> None:
    # A ClusterTunnel edit (a fan-out) changes no input of the Ingress translation: the
    # very same translation comes back, without a look at any Ingress's entry.
    objects = cluster()
    objects["pods"] = pods_for(objects["slices"])
    memo = TranslationMemo()
    first = translate(objects, memo)
    assert translate(objects, memo) is first and memo.translated == HOSTS
    # Any input changed: not the whole, only what the change concerns is translated.
    objects["ingresses"][3] = ingress("i3", [rule("h3.test", path("/", svc="s4"))])
    changed = translate(objects, memo)
    assert changed is not first and memo.translated == HOSTS + 1
    assert changed.routes.rules != first.routes.rules
    objects["services"][5] = copy.deepcopy(objects["services"][5])  # an equal new object
    current = translate(objects, memo)
    assert current is not changed and translate(objects, memo) is current
    assert translate(objects, memo, frozenset({"default"})) is not current  # opt-in edit
    again = translate(objects, memo, frozenset({"default"}))
    assert again.routes == changed.routes
    assert again == translate_ingresses(
        ingresses=objects["ingresses"], ingress_classes=[OURS], services=objects["services"],
        endpoint_slices=objects["slices"], secrets=[], nodes=objects["nodes"],
        pods=objects["pods"], direct_namespaces=frozenset({"default"}))


def test_config_versions_compare_content_not_identity() -> None:
    versions = ConfigVersions()
    assert versions.update("node/a", NodeConfig(allow=(AllowRule(host="10.0.0.1"),)))
    # An equal config built anew: no new version.
    assert not versions.update("node/a", NodeConfig(allow=(AllowRule(host="10.0.0.1"),)))
    assert versions.update("node/a", NodeConfig(allow=(AllowRule(host="10.0.0.2"),)))
    # A config carrying another version number, same content: no new version either.
    assert not versions.update("node/a", NodeConfig(allow=(AllowRule(host="10.0.0.2"),),
                                                    version=7))
    current = versions.get("node/a")
    assert current is not None and current[0] == 2 and current[1].version == 2


async def test_a_notify_wakes_only_the_watches_of_the_keys_it_names() -> None:
    versions = ConfigVersions()
    for name in ("a", "b"):
        versions.update(f"node/{name}", NodeConfig(allow=(AllowRule(host="10.0.0.1"),)))

    async def no_tls() -> Any:
        raise AssertionError("not used")

    server = ConfigStreamServer(versions, tls=no_tls, metrics=ControllerMetrics())
    lines: dict[str, list[bytes]] = {"a": [], "b": []}

    async def consume(name: str) -> None:
        async for line in server._watch("nodes", name, -1):
            lines[name].append(line)

    async with trio.open_nursery() as nursery:
        for name in lines:
            nursery.start_soon(consume, name)
        await trio.testing.wait_all_tasks_blocked()
        assert [len(v) for v in lines.values()] == [1, 1]  # each its current config
        versions.update("node/a", NodeConfig(allow=(AllowRule(host="10.0.0.2"),)))
        server.notify(["node/a"])
        await trio.testing.wait_all_tasks_blocked()
        assert [len(v) for v in lines.values()] == [2, 1]
        assert b'"version":2' in lines["a"][1]
        # Only watched keys hold a wake-up, so the table stays bounded by the watches.
        assert set(server._waiting) <= {"node/a", "node/b"}
        nursery.cancel_scope.cancel()
    assert server._waiting == {} and not server.subscribers


def test_status_writes_and_node_heartbeats_keep_their_memo_entries() -> None:
    """The leader writes every Ingress's status, kubelets rewrite Node conditions: new
    objects with nothing the config reads changed translate and build nothing."""
    objects = cluster()
    tmemo, cmemo = TranslationMemo(), ComputeMemo()
    first = run(objects, [], tmemo, cmemo)
    for i, obj in enumerate(objects["ingresses"]):
        objects["ingresses"][i] = dict(copy.deepcopy(obj), status={"loadBalancer": {
            "ingress": [{"ip": "203.0.113.7"}]}})
    for i, obj in enumerate(objects["nodes"]):
        obj = copy.deepcopy(obj)
        obj["status"]["conditions"] = [{"type": "Ready", "status": "True",
                                        "lastHeartbeatTime": "2026-11-25T16:00:00Z"}]
        objects["nodes"][i] = obj
    out = run(objects, [], tmemo, cmemo)
    assert (tmemo.translated, cmemo.built) == (HOSTS, NODES)
    assert all(out.nodes[n] is first.nodes[n] for n in first.nodes)
