"""overlays/kind and overlays/k3s (docs/kubernetes.md) rendered by the real `kubectl
kustomize` and validated offline: every object against the Kubernetes schemas, the
ClusterTunnel against the CRD and its model, and what each overlay is for (the image,
the server address in one place, NodePorts where there is no LoadBalancer)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from nodeagent.controller.clustertunnel import parse_cluster_tunnel
from nodeagent.controller.crds import crd_manifests
from nodeagent.testing.fakekube import schema as structural
from nodeagent.testing.fakekube.kubectl import KUBECTL, needs_kubectl

ROOT = Path(__file__).resolve().parents[1]
K8S_VERSION = "1.33.0"
PLACEHOLDER = "--server=wss://nodeagent.example.com:8443/tunnel"
IMAGE = "localhost/nodeagent:0.1.0"
pytestmark = needs_kubectl


def render(overlay: str) -> list[dict[str, Any]]:
    proc = subprocess.run([KUBECTL, "kustomize", str(ROOT / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def containers(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for o in objs if o["kind"] in ("Deployment", "DaemonSet")
            for c in o["spec"]["template"]["spec"]["containers"]]


@pytest.mark.parametrize("overlay", ["kind", "k3s"])
def test_overlay_renders_valid_objects(overlay: str) -> None:
    objs = render(overlay)
    (crd,) = crd_manifests()
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for obj in objs:
        if obj["kind"] == "ClusterTunnel":
            assert structural.prune(obj, schema, root=True) == obj
            assert structural.validate(obj, schema, root=True) == []
            parse_cluster_tunnel(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    base = subprocess.run([KUBECTL, "kustomize", str(ROOT / "manifests")],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    kinds = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(base) if d}
    assert kinds | {("ClusterTunnel", "quickstart")} == {
        (o["kind"], o["metadata"]["name"]) for o in objs}, "the whole install, plus a tunnel"


@pytest.mark.parametrize("overlay", ["kind", "k3s"])
def test_overlay_sets_the_image_and_the_server_address_in_one_place(overlay: str) -> None:
    objs = render(overlay)
    assert {c["image"] for c in containers(objs)} == {IMAGE}
    url = find(objs, "ClusterTunnel", "quickstart")["spec"]["serverUrl"]
    agent = find(objs, "DaemonSet", "nodeagent-agent")
    args = agent["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--server={url}" in args
    assert PLACEHOLDER not in args
    base = next(d for d in yaml.safe_load_all((ROOT / "manifests" / "agent.yaml").read_text())
                if d and d["kind"] == "DaemonSet")
    base_args = base["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if not a.startswith("--server=")] == [
        a for a in base_args if a != PLACEHOLDER], "only --server changed"


def test_kind_has_no_load_balancer_so_everything_is_on_node_ports() -> None:
    objs = render("kind")
    tunnel = find(objs, "Service", "nodeagent-tunnel")
    public = find(objs, "Service", "nodeagent-server")
    assert [s["spec"]["type"] for s in (tunnel, public)] == ["NodePort", "NodePort"]
    assert [(p["port"], p["nodePort"]) for p in tunnel["spec"]["ports"]] == [(8443, 30443)]
    assert sorted((p["port"], p["nodePort"]) for p in public["spec"]["ports"]) == [
        (80, 30080), (443, 30444)]
    url = find(objs, "ClusterTunnel", "quickstart")["spec"]["serverUrl"]
    assert ":30443/" in url, "the agents dial the tunnel's NodePort"
    assert tunnel["spec"]["publishNotReadyAddresses"] is True  # the base's, kept


def test_k3s_keeps_servicelb_for_the_tunnel_and_leaves_80_443_to_traefik() -> None:
    objs = render("k3s")
    assert find(objs, "Service", "nodeagent-tunnel")["spec"]["type"] == "LoadBalancer"
    assert find(objs, "Service", "nodeagent-server")["spec"]["type"] == "NodePort"
    assert ":8443/" in find(objs, "ClusterTunnel", "quickstart")["spec"]["serverUrl"]


def test_a_changed_placeholder_fails_to_render(tmp_path: Path) -> None:
    """The replacement matches the base's argument by value: were it renamed, the overlay
    would fail loudly rather than overwrite another argument."""
    overlay = ROOT / "overlays" / "kind"
    text = (overlay / "kustomization.yaml").read_text()
    assert PLACEHOLDER in text
    copy = ROOT / "overlays" / f".test-{tmp_path.name}"
    copy.mkdir()
    try:
        for path in overlay.glob("*.yaml"):
            (copy / path.name).write_text(path.read_text())
        (copy / "kustomization.yaml").write_text(
            text.replace(PLACEHOLDER, "--server=wss://renamed.example.com:8443/tunnel"))
        proc = subprocess.run([KUBECTL, "kustomize", str(copy)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode != 0
        assert "unable to find field" in proc.stderr
    finally:
        for path in copy.glob("*"):
            path.unlink()
        copy.rmdir()
