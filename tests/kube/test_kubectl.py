"""The real `kubectl` against the fake: what it does must work as against a cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from tests.fakekube import FakeKube
from tests.fakekube.kubectl import kubectl, needs_kubectl

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"

pytestmark = needs_kubectl


@pytest.fixture
async def kubeconfig(nursery: trio.Nursery, tmp_path: Path) -> tuple[FakeKube, Path]:
    fake = FakeKube(token="kubectl-admin", tls=True, bookmark_interval=0.2)
    await nursery.start(fake.serve)
    return fake, fake.write_kubeconfig(tmp_path / "kubeconfig")


async def test_apply_manifests_creates_every_kind(kubeconfig: tuple[FakeKube, Path]) -> None:
    fake, path = kubeconfig
    result = await kubectl(path, "apply", "-k", str(MANIFESTS), "--validate=false")
    assert result.returncode == 0, result.stderr.decode()
    out = result.stdout.decode()
    for line in ("clusterrole.rbac.authorization.k8s.io/nodeagent-controller created",
                 "clusterrolebinding.rbac.authorization.k8s.io/nodeagent-controller created",
                 "role.rbac.authorization.k8s.io/nodeagent-controller created",
                 "rolebinding.rbac.authorization.k8s.io/nodeagent-controller created",
                 "poddisruptionbudget.policy/nodeagent-server created"):
        assert line in out
    again = await kubectl(path, "apply", "-k", str(MANIFESTS), "--validate=false")
    assert again.returncode == 0, again.stderr.decode()
    assert "created" not in again.stdout.decode()
    got = await kubectl(path, "get", "clusterrole", "nodeagent-controller", "-o", "json")
    rules = json.loads(got.stdout)["rules"]
    assert {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
            "verbs": ["create"]} in rules
    assert fake.get_object("rolebindings", "nodeagent-controller", "nodeagent",
                           group="rbac.authorization.k8s.io") is not None
