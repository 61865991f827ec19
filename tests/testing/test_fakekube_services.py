"""Services' load balancer fields on the fake API server as kube-apiserver has them:
`spec.loadBalancerClass` rules, the `status` subresource (merge patch with a
resourceVersion, PUT), its validation and defaulting, through the production client and
through the real `kubectl` (`patch --subresource=status`, `get` showing EXTERNAL-IP)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from nodeagent.kube import SERVICES, Conflict, Invalid, KubeClient
from nodeagent.testing.fakekube import FakeKube
from nodeagent.testing.fakekube.kubectl import kubectl, needs_kubectl

LB = {"apiVersion": "v1", "kind": "Service",
      "metadata": {"name": "dns", "namespace": "default"},
      "spec": {"type": "LoadBalancer", "loadBalancerClass": "nodeagent.io/tunnel",
               "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}}
CONDITION = {"type": "LoadBalancerPortsError", "status": "False", "reason": "PortsServed",
             "message": "1 port(s) served", "lastTransitionTime": "2026-01-01T00:00:00Z"}


async def test_status_patch_validation_and_defaulting(kube: KubeClient) -> None:
    created = await kube.create(SERVICES, LB)
    assert "status" not in created or not created["status"].get("loadBalancer")
    rv = created["metadata"]["resourceVersion"]
    body = {"metadata": {"resourceVersion": rv}, "status": {
        "loadBalancer": {"ingress": [{"ip": "203.0.113.7", "ports": [
            {"port": 53, "protocol": "UDP"}, {"port": 80, "protocol": "TCP",
                                              "error": "PortConflict"}]},
            {"hostname": "lb.example.com"}]},
        "conditions": [CONDITION]}}
    patched = await kube.patch(SERVICES, "dns", body, namespace="default",
                               subresource="status")
    ingress = patched["status"]["loadBalancer"]["ingress"]
    assert ingress[0]["ipMode"] == "VIP"  # defaulted with an ip, as the real server does
    assert "ipMode" not in ingress[1]
    assert patched["spec"] == created["spec"]
    # The same resourceVersion again: someone wrote in between.
    with pytest.raises(Conflict):
        await kube.patch(SERVICES, "dns", body, namespace="default", subresource="status")
    # A status write never changes the spec, a spec write never the status.
    spec_change = await kube.patch(SERVICES, "dns", {"spec": {"ports": [
        {"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "web", "port": 80}]},
        "status": {"loadBalancer": {}}}, namespace="default")
    assert spec_change["status"]["loadBalancer"]["ingress"][0]["ip"] == "203.0.113.7"
    assert len(spec_change["spec"]["ports"]) == 2
    for bad, field in (
            ({"ingress": [{"ip": "not-an-ip"}]}, "ingress[0].ip"),
            ({"ingress": [{"hostname": "192.0.2.1"}]}, "ingress[0].hostname"),
            ({"ingress": [{"hostname": "lb.example.com", "ipMode": "Proxy"}]},
             "ingress[0].ipMode"),
            ({"ingress": [{"ip": "192.0.2.1", "ipMode": "Tunnel"}]}, "ingress[0].ipMode"),
            ({"ingress": [{"ip": "192.0.2.1", "ports": [{"port": 0, "protocol": "TCP"}]}]},
             "ports[0].port"),
            ({"ingress": [{"ip": "192.0.2.1", "ports": [{"port": 1, "protocol": "ICMP"}]}]},
             "ports[0].protocol"),
            ({"ingress": [{"ip": "192.0.2.1", "ports": [
                {"port": 1, "protocol": "TCP", "error": "not camel case!"}]}]},
             "ports[0].error")):
        with pytest.raises(Invalid) as info:
            await kube.patch(SERVICES, "dns", {"status": {"loadBalancer": bad}},
                             namespace="default", subresource="status")
        assert field in str(info.value), info.value
    for bad_condition, field in ((dict(CONDITION, reason=""), "reason"),
                                 (dict(CONDITION, status="Maybe"), "status"),
                                 (dict(CONDITION, lastTransitionTime=""),
                                  "lastTransitionTime"),
                                 (dict(CONDITION, type="not a type"), "type")):
        with pytest.raises(Invalid) as info:
            await kube.patch(SERVICES, "dns", {"status": {"conditions": [bad_condition]}},
                             namespace="default", subresource="status")
        assert f"conditions[0].{field}" in str(info.value), info.value
    with pytest.raises(Invalid):
        await kube.patch(SERVICES, "dns", {"status": {"conditions": [CONDITION, CONDITION]}},
                         namespace="default", subresource="status")
    # PUT of the subresource works the same way (what update_status sends).
    current = await kube.get(SERVICES, "dns", namespace="default")
    current["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.1",
                                                        "ipMode": "Proxy"}]}}
    put = await kube.update_status(SERVICES, current)
    assert put["status"]["loadBalancer"]["ingress"] == [{"ip": "198.51.100.1",
                                                         "ipMode": "Proxy"}]


async def test_load_balancer_class_rules(kube: KubeClient) -> None:
    plain = {**LB, "metadata": {"name": "plain", "namespace": "default"},
             "spec": {"ports": [{"port": 80}], "loadBalancerClass": "nodeagent.io/tunnel"}}
    with pytest.raises(Invalid) as info:
        await kube.create(SERVICES, plain)
    assert "may only be used when `type` is 'LoadBalancer'" in str(info.value)
    with pytest.raises(Invalid):
        await kube.create(SERVICES, {**LB, "spec": {**LB["spec"],
                                                    "loadBalancerClass": "no spaces/x y"}})
    created = await kube.create(SERVICES, LB)
    with pytest.raises(Invalid) as info:
        await kube.update(SERVICES, {**created, "spec": {
            **created["spec"], "loadBalancerClass": "example.com/other"}})
    assert "may not change once set" in str(info.value)
    # Status on a Service that is not a LoadBalancer: refused.
    cluster_ip = await kube.create(SERVICES, {**LB, "metadata": {"name": "cip",
                                                                 "namespace": "default"},
                                              "spec": {"ports": [{"port": 80}]}})
    assert cluster_ip["spec"]["type"] == "ClusterIP"
    with pytest.raises(Invalid):
        await kube.patch(SERVICES, "cip", {"status": {"loadBalancer": {"ingress": [
            {"ip": "192.0.2.1"}]}}}, namespace="default", subresource="status")


@needs_kubectl
async def test_kubectl_patches_the_status_and_shows_the_address(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = FakeKube(token="kubectl-admin", tls=True, bookmark_interval=0.2)
    await nursery.start(fake.serve)
    config = fake.write_kubeconfig(tmp_path / "kubeconfig")
    (tmp_path / "svc.json").write_text(json.dumps(LB))
    result = await kubectl(config, "apply", "-f", str(tmp_path / "svc.json"))
    assert result.returncode == 0, result.stderr.decode()
    got = await kubectl(config, "get", "svc", "dns")
    assert "<pending>" in got.stdout.decode(), got.stdout.decode()
    status: dict[str, Any] = {"status": {"loadBalancer": {"ingress": [
        {"ip": "203.0.113.7", "ipMode": "Proxy"}]}, "conditions": [CONDITION]}}
    result = await kubectl(config, "patch", "svc", "dns", "--subresource=status",
                           "--type=merge", "-p", json.dumps(status))
    assert result.returncode == 0, result.stderr.decode()
    got = await kubectl(config, "get", "svc", "dns")
    assert "203.0.113.7" in got.stdout.decode(), got.stdout.decode()
    bad = await kubectl(config, "patch", "svc", "dns", "--subresource=status", "--type=merge",
                        "-p", '{"status": {"loadBalancer": {"ingress": [{"ip": "x"}]}}}')
    assert bad.returncode != 0 and "must be a valid IP address" in bad.stderr.decode()
    shown = json.loads((await kubectl(config, "get", "svc", "dns", "-o", "json")).stdout)
    assert shown["status"]["conditions"][0]["reason"] == "PortsServed"
    assert shown["status"]["loadBalancer"]["ingress"] == [{"ip": "203.0.113.7",
                                                           "ipMode": "Proxy"}]
