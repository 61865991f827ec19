"""ensure_crds against the fake API server: install, upgrade, never downgrade; and the
installed schema really constrains ClusterTunnel objects."""

from __future__ import annotations

import copy

import pytest

from nodeagent.controller import crds
from nodeagent.controller.clustertunnel import (
    CLUSTER_TUNNELS,
    CRD_VERSION_ANNOTATION,
    parse_cluster_tunnel,
)
from nodeagent.controller.crds import CRD_REVISION, crd_manifests, ensure_crds
from nodeagent.kube import CUSTOMRESOURCEDEFINITIONS, KubeClient, KubeError

NAME = "clustertunnels.nodeagent.io"


async def revision(kube: KubeClient) -> str:
    crd = await kube.get(CUSTOMRESOURCEDEFINITIONS, NAME)
    return str(crd["metadata"]["annotations"][CRD_VERSION_ANNOTATION])


async def test_installs_then_is_a_no_op(kube: KubeClient) -> None:
    await ensure_crds(kube)
    assert await revision(kube) == str(CRD_REVISION)
    before = (await kube.get(CUSTOMRESOURCEDEFINITIONS, NAME))["metadata"]["resourceVersion"]
    await ensure_crds(kube)
    after = (await kube.get(CUSTOMRESOURCEDEFINITIONS, NAME))["metadata"]["resourceVersion"]
    assert before == after


async def test_upgrades_an_older_crd(kube: KubeClient) -> None:
    old = copy.deepcopy(crd_manifests()[0])
    old["metadata"]["annotations"][CRD_VERSION_ANNOTATION] = str(CRD_REVISION - 1)
    old["spec"]["versions"][0]["additionalPrinterColumns"] = []
    await kube.create(CUSTOMRESOURCEDEFINITIONS, old)
    await ensure_crds(kube)
    crd = await kube.get(CUSTOMRESOURCEDEFINITIONS, NAME)
    assert await revision(kube) == str(CRD_REVISION)
    assert crd["spec"]["versions"][0]["additionalPrinterColumns"]


async def test_never_downgrades_a_newer_crd(kube: KubeClient) -> None:
    newer = copy.deepcopy(crd_manifests()[0])
    newer["metadata"]["annotations"][CRD_VERSION_ANNOTATION] = str(CRD_REVISION + 1)
    await kube.create(CUSTOMRESOURCEDEFINITIONS, newer)
    await ensure_crds(kube)
    assert await revision(kube) == str(CRD_REVISION + 1)
    # And a CRD applied by hand without the annotation counts as the oldest.
    assert crds.installed_revision({"metadata": {}}) == 0


async def test_installed_schema_rejects_invalid_cluster_tunnels(kube: KubeClient) -> None:
    await ensure_crds(kube)
    good = {"apiVersion": "nodeagent.io/v1alpha1", "kind": "ClusterTunnel",
            "metadata": {"name": "default"},
            "spec": {"allowedNodePorts": [10250, "9100-9101"],
                     "intercept": {"rules": [{"name": "r", "destinations": ["10.9.0.0/16"]}]}}}
    created = await kube.create(CLUSTER_TUNNELS, good)
    spec = parse_cluster_tunnel(created)
    assert [(r.first, r.last) for r in spec.allowed_node_ports] == [(10250, 10250),
                                                                    (9100, 9101)]
    bad = dict(good, metadata={"name": "bad"}, spec={"intercept": {"mode": "nat"}})
    with pytest.raises(KubeError) as info:
        await kube.create(CLUSTER_TUNNELS, bad)
    assert "spec.intercept.mode" in str(info.value)
