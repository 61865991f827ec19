"""docs/kubernetes.md's install and uninstall commands, run as written with the real
kubectl against the fake API server (`nodeagent.testing.fakekube`, a process with TLS and
RBAC): the CRD first, the kind overlay, then the uninstall, including the way out when the
controller was removed before the ClusterTunnels (their finalizer then has no one to
release it). The right order, with a controller running, is test_kubectl_install.py's
step 6: the controller releases a deleted ClusterTunnel's finalizer itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.controller.clustertunnel import FINALIZER
from nodeagent.testing.fakekube.kubectl import needs_kubectl
from nodeagent.testing.fakekube.localcluster import FakeApiServer, Kubectl, wait_for

pytestmark = needs_kubectl
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def k(tmp_path: Path) -> Iterator[Kubectl]:
    server = FakeApiServer(tmp_path / "kubeconfig", "overlay-admin-token")
    try:
        yield Kubectl(server.kubeconfig)
    finally:
        server.close()


def test_install_the_kind_overlay_then_uninstall_with_a_stuck_tunnel(k: Kubectl) -> None:
    # Install: the CRD first (a ClusterTunnel in the same apply would race its
    # registration on a real API server), then the overlay.
    k.ok("apply", "-f", str(ROOT / "manifests" / "crds.yaml"))
    k.ok("wait", "--for", "condition=established", "--timeout=30s",
         "crd/clustertunnels.nodeagent.io")
    out = k.ok("apply", "-k", str(ROOT / "overlays" / "kind"))
    assert "clustertunnel.nodeagent.io/quickstart created" in out, out
    assert "service/nodeagent-tunnel created" in out
    args = k.json("daemonset", "nodeagent-agent", "-n", "nodeagent")["spec"]["template"][
        "spec"]["containers"][0]["args"]
    assert "--server=wss://172.18.0.2:30443/tunnel" in args
    assert k.ok("get", "svc", "nodeagent-tunnel", "-n", "nodeagent", "-o",
                "jsonpath={.spec.ports[0].nodePort}") == "30443"

    # What a running controller does to every ClusterTunnel.
    k.ok("patch", "clustertunnel", "quickstart", "--type=merge", "-p",
         f'{{"metadata":{{"finalizers":["{FINALIZER}"]}}}}')

    # The wrong order: the controller is gone (here: never ran), then the tunnel is
    # deleted: it stays, marked for deletion, held by the finalizer.
    k.ok("delete", "clustertunnel", "quickstart", "--wait=false")
    held = k.json("clustertunnel", "quickstart")
    assert held["metadata"]["deletionTimestamp"]
    assert held["metadata"]["finalizers"] == [FINALIZER]

    # The way out docs/kubernetes.md gives: release the finalizer by hand.
    k.ok("patch", "clustertunnel", "quickstart", "--type=json", "-p",
         '[{"op":"remove","path":"/metadata/finalizers"}]')
    k.ok("wait", "--for=delete", "clustertunnel/quickstart", "--timeout=15s")

    # The rest of the uninstall, as written.
    k.ok("delete", "-k", str(ROOT / "overlays" / "kind"), "--ignore-not-found")
    wait_for(lambda: k.run("get", "namespace", "nodeagent").returncode == 1,
             "the nodeagent namespace gone")
    gone = k.run("get", "crd", "clustertunnels.nodeagent.io")
    assert gone.returncode == 1 and "NotFound" in gone.stderr
