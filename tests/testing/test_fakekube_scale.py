"""The fake's scale subresource (Deployments, StatefulSets) and its simulated workload
controller: the real `kubectl scale` against it, and raw HTTP for the edges."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from nodeagent.testing.fakekube import FakeKube
from nodeagent.testing.fakekube.kubectl import kubectl, needs_kubectl
from nodeagent.testing.fakekube.workloads import CRASH, WorkloadSimulator

NS = "default"


def deployment(name: str = "web", replicas: int | None = 2) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app": name}},
        "template": {"metadata": {"labels": {"app": name}}, "spec": {
            "nodeName": "edge-1",
            "containers": [{"name": "web", "image": "web",
                            "ports": [{"name": "http", "containerPort": 8080}]}]}}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


def statefulset(name: str = "db", replicas: int = 1) -> dict[str, Any]:
    doc = deployment(name, replicas)
    doc["kind"] = "StatefulSet"
    doc["spec"]["serviceName"] = name
    return doc


def service(name: str = "web", selector: str = "web") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"app": selector},
                     "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeKube:
    fake = FakeKube(token="admin", tls=True, bookmark_interval=0.2)
    await nursery.start(fake.serve)
    return fake


def client(fake: FakeKube) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=fake.url, verify=False, timeout=5,
                             headers={"authorization": "Bearer admin"})


SCALE = f"/apis/apps/v1/namespaces/{NS}/deployments/web/scale"


async def test_scale_subresource_reads_and_writes_the_workloads_replicas(
        fake: FakeKube) -> None:
    fake.put_object(deployment(replicas=None))  # defaulted to 1, as the API does
    async with client(fake) as http:
        got = (await http.get(SCALE)).json()
        assert got["kind"] == "Scale" and got["apiVersion"] == "autoscaling/v1"
        assert got["spec"] == {"replicas": 1}
        assert got["status"] == {"replicas": 0, "selector": "app=web"}
        rv = got["metadata"]["resourceVersion"]
        before = fake.get_object("deployments", "web", NS, group="apps")
        assert before is not None
        patched = await http.patch(SCALE, content=json.dumps({"spec": {"replicas": 0}}),
                                   headers={"content-type": "application/merge-patch+json"})
        assert patched.status_code == 200, patched.text
        assert patched.json()["spec"]["replicas"] == 0
        after = fake.get_object("deployments", "web", NS, group="apps")
        assert after is not None and after["spec"]["replicas"] == 0
        assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
        # PUT with a stale resourceVersion: 409, as a precondition.
        stale = dict(got, spec={"replicas": 3})
        conflict = await http.put(SCALE, json=stale)
        assert conflict.status_code == 409, conflict.text
        assert rv != after["metadata"]["resourceVersion"]
        fresh = (await http.get(SCALE)).json()
        put = await http.put(SCALE, json=dict(fresh, spec={"replicas": 3}))
        assert put.status_code == 200 and put.json()["spec"]["replicas"] == 3
        # Bad input: a clear 4xx, never a traceback.
        for body, ctype, code in (
                ({"spec": {"replicas": -1}}, "application/merge-patch+json", 422),
                ({"spec": {"replicas": "two"}}, "application/merge-patch+json", 422),
                ([{"op": "replace", "path": "/spec/replicas", "value": 2}],
                 "application/json-patch+json", 200),
                ({"spec": {"replicas": 1}}, "application/apply-patch+yaml", 415),
                ({"kind": "Deployment"}, "application/merge-patch+json", 400)):
            r = await http.patch(SCALE, content=json.dumps(body),
                                 headers={"content-type": ctype})
            assert r.status_code == code, (body, r.text)
        assert (await http.patch(SCALE, content=b"{nope",
                                 headers={"content-type": "application/merge-patch+json"})
                ).status_code == 400
        assert (await http.delete(SCALE)).status_code == 405
        missing = await http.get(f"/apis/apps/v1/namespaces/{NS}/deployments/nope/scale")
        assert missing.status_code == 404
        no_scale = await http.get(f"/api/v1/namespaces/{NS}/services/web/scale")
        assert no_scale.status_code == 404
        listed = (await http.get("/apis/apps/v1")).json()["resources"]
        entry = next(r for r in listed if r["name"] == "statefulsets/scale")
        assert (entry["group"], entry["version"], entry["kind"]) == ("autoscaling", "v1",
                                                                     "Scale")


@needs_kubectl
async def test_kubectl_scale_against_the_fake(fake: FakeKube, tmp_path: Path) -> None:
    path = fake.write_kubeconfig(tmp_path / "kubeconfig")
    fake.put_object(deployment(replicas=2))
    fake.put_object(statefulset(replicas=1))
    result = await kubectl(path, "scale", "deployment/web", "--replicas=0", "-n", NS)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip() == "deployment.apps/web scaled"
    got = fake.get_object("deployments", "web", NS, group="apps")
    assert got is not None and got["spec"]["replicas"] == 0
    # --current-replicas makes kubectl read the Scale and update it with a precondition.
    result = await kubectl(path, "scale", "statefulset", "db", "--current-replicas=1",
                           "--replicas=3", "-n", NS)
    assert result.returncode == 0, result.stderr.decode()
    sts = fake.get_object("statefulsets", "db", NS, group="apps")
    assert sts is not None and sts["spec"]["replicas"] == 3
    wrong = await kubectl(path, "scale", "statefulset", "db", "--current-replicas=7",
                          "--replicas=1", "-n", NS)
    assert wrong.returncode != 0
    assert "Expected replicas to be 7, was 3" in wrong.stderr.decode()
    got_scale = await kubectl(path, "get", "deployment", "web", "--subresource=scale",
                              "-n", NS, "-o", "json")
    assert got_scale.returncode == 0, got_scale.stderr.decode()
    assert json.loads(got_scale.stdout)["spec"]["replicas"] == 0


async def settle(fake: FakeKube, check: Any) -> Any:
    """Poll the store until `check()` is truthy (10 s hang guard)."""
    with trio.fail_after(10):
        while True:
            if result := check():
                return result
            await trio.sleep(0.02)


def ready_addresses(fake: FakeKube, service_name: str) -> list[tuple[str, bool]]:
    slices = [s for s in fake.objects("endpointslices", "discovery.k8s.io", NS)
              if s["metadata"]["labels"].get("kubernetes.io/service-name") == service_name]
    return [(e["targetRef"]["name"], e["conditions"]["ready"])
            for s in slices for e in s.get("endpoints") or []]


async def test_the_simulator_runs_pods_and_endpointslices_from_replicas(
        fake: FakeKube, nursery: trio.Nursery) -> None:
    sim = WorkloadSimulator(fake.store, start_delay=0.3, node="edge-1", pod_ip="10.1.0.7")
    await nursery.start(sim.run)
    fake.put_object(service())
    fake.put_object(deployment(replicas=2))
    pods = await settle(fake, lambda: fake.objects("pods", namespace=NS))
    # Created at once, Pending, without an address: no endpoint yet.
    assert all(p["status"]["phase"] == "Pending" for p in pods)
    rs = fake.objects("replicasets", "apps", NS)
    assert len(rs) == 1 and rs[0]["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
    assert all(p["metadata"]["ownerReferences"][0]["name"] == rs[0]["metadata"]["name"]
               for p in pods)
    assert ready_addresses(fake, "web") == []
    got = await settle(fake, lambda: [r for _, r in ready_addresses(fake, "web") if r])
    assert len(got) == 2
    (slice_,) = fake.objects("endpointslices", "discovery.k8s.io", NS)
    assert slice_["ports"] == [{"name": "http", "port": 8080, "protocol": "TCP"}]
    assert slice_["endpoints"][0]["addresses"] == ["10.1.0.7"]
    assert slice_["endpoints"][0]["nodeName"] == "edge-1"
    deploy = await settle(fake, lambda: (d := fake.get_object(
        "deployments", "web", NS, group="apps")) and d.get("status", {}).get(
        "readyReplicas") == 2 and d)
    assert deploy["status"]["replicas"] == 2
    # To zero: pods and endpoints go at once; the slice stays, empty.
    obj = fake.get_object("deployments", "web", NS, group="apps")
    assert obj is not None
    obj["spec"]["replicas"] = 0
    fake.put_object(obj)
    await settle(fake, lambda: not fake.objects("pods", namespace=NS)
                 and not ready_addresses(fake, "web"))
    # A StatefulSet: ordinal names.
    fake.put_object(service("db", "db"))
    fake.put_object(statefulset(replicas=2))
    await settle(fake, lambda: sorted(n for n, r in ready_addresses(fake, "db") if r)
                 == ["db-0", "db-1"])


async def test_a_crashing_workload_is_listed_never_ready_with_its_reason(
        fake: FakeKube, nursery: trio.Nursery) -> None:
    await nursery.start(WorkloadSimulator(fake.store, start_delay=0.1).run)
    fake.put_object(service())
    doc = deployment(replicas=1)
    doc["metadata"]["annotations"] = {CRASH: "panic: no database"}
    fake.put_object(doc)
    (pod,) = await settle(fake, lambda: fake.objects("pods", namespace=NS))
    await settle(fake, lambda: ready_addresses(fake, "web") == [
        (pod["metadata"]["name"], False)])
    (pod,) = fake.objects("pods", namespace=NS)
    status = pod["status"]["containerStatuses"][0]
    assert status["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert status["lastState"]["terminated"]["message"] == "panic: no database"
