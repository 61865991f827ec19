"""The real `kubectl` against the fake: what it does must work as against a cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from nodeagent.testing.fakekube import FakeKube
from nodeagent.testing.fakekube.control import FakeKubeControl
from nodeagent.testing.fakekube.kubectl import kubectl, needs_kubectl

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
    # Nothing changes: every object, bindings too (their defaulted subjects round-trip).
    lines = again.stdout.decode().splitlines()
    assert lines and all(line.endswith(" unchanged") for line in lines), lines
    got = await kubectl(path, "get", "clusterrole", "nodeagent-controller", "-o", "json")
    rules = json.loads(got.stdout)["rules"]
    assert {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
            "verbs": ["create"]} in rules
    assert fake.get_object("rolebindings", "nodeagent-controller", "nodeagent",
                           group="rbac.authorization.k8s.io") is not None


@pytest.fixture
async def rbac_kubeconfig(nursery: trio.Nursery, tmp_path: Path) -> tuple[FakeKube, Path]:
    fake = FakeKube(token="kubectl-admin", tls=True, bookmark_interval=0.2, rbac=True)
    await nursery.start(fake.serve)
    return fake, fake.write_kubeconfig(tmp_path / "kubeconfig")


async def test_auth_can_i_as_the_controller(rbac_kubeconfig: tuple[FakeKube, Path]) -> None:
    fake, path = rbac_kubeconfig
    result = await kubectl(path, "apply", "-k", str(MANIFESTS), "--validate=false")
    assert result.returncode == 0, result.stderr.decode()
    as_controller = "--as=system:serviceaccount:nodeagent:nodeagent-controller"
    cases = [
        (("list", "ingresses", "-A"), "yes"),
        (("list", "ingresses"), "yes"),
        (("watch", "endpointslices.discovery.k8s.io", "-A"), "yes"),
        (("update", "ingresses", "--subresource=status", "-n", "default"), "yes"),
        (("get", "secrets/nodeagent-ca", "-n", "nodeagent"), "yes"),
        (("update", "ingresses", "-n", "default"), "no"),
        (("delete", "nodes"), "no"),
        (("update", "secrets", "-n", "nodeagent"), "no"),
        (("create", "secrets", "-n", "nodeagent"), "yes"),
        (("create", "secrets", "-n", "default"), "no"),
        (("update", "leases", "-n", "nodeagent"), "yes"),
        (("list", "leases", "-n", "nodeagent"), "no"),
        (("create", "tokenreviews"), "yes"),
        (("get", "/healthz"), "yes"),
        (("get", "/metrics"), "no"),
    ]
    for args, expected in cases:
        result = await kubectl(path, "auth", "can-i", *args, as_controller)
        assert result.stdout.decode().strip() == expected, (args, result)
        assert result.returncode == (0 if expected == "yes" else 1), args
    # The admin (system:masters) may do anything; a stranger may not impersonate.
    result = await kubectl(path, "auth", "can-i", "delete", "nodes")
    assert result.stdout.decode().strip() == "yes"
    fake.add_token("stranger", username="stranger")
    other = fake.write_kubeconfig(path.parent / "stranger", token="stranger")
    result = await kubectl(other, "auth", "can-i", "list", "pods")
    assert (result.returncode, result.stdout.decode().strip()) == (1, "no")
    result = await kubectl(other, "get", "pods", as_controller)
    assert result.returncode == 1
    assert ('users "system:serviceaccount:nodeagent:nodeagent-controller" is forbidden'
            not in result.stderr.decode())
    assert 'serviceaccounts "nodeagent-controller" is forbidden: User "stranger" cannot ' \
           'impersonate resource "serviceaccounts"' in result.stderr.decode()
    # The controller itself, with its own token, sees the same as --as says.
    fake.add_service_account_token("ctl", namespace="nodeagent",
                                   service_account="nodeagent-controller")
    ctl = fake.write_kubeconfig(path.parent / "ctl", token="ctl")
    result = await kubectl(ctl, "get", "ingresses", "-A")
    assert result.returncode == 0, result.stderr.decode()
    result = await kubectl(ctl, "delete", "node", "n1")
    assert result.returncode == 1
    assert ('nodes "n1" is forbidden: User "system:serviceaccount:nodeagent:'
            'nodeagent-controller" cannot delete resource "nodes" in API group "" at the '
            'cluster scope') in result.stderr.decode()


def table(output: bytes) -> list[list[str]]:
    return [line.split() for line in output.decode().splitlines()]


async def test_get_prints_server_side_tables(kubeconfig: tuple[FakeKube, Path]) -> None:
    fake, path = kubeconfig
    result = await kubectl(path, "apply", "-k", str(MANIFESTS), "--validate=false")
    assert result.returncode == 0, result.stderr.decode()
    deployment = fake.get_object("deployments", "nodeagent-server", "nodeagent", group="apps")
    assert deployment is not None
    fake.put_object({**deployment, "status": {"replicas": 2, "readyReplicas": 1,
                                              "updatedReplicas": 2, "availableReplicas": 1}})
    result = await kubectl(path, "get", "deployments", "-n", "nodeagent")
    assert result.returncode == 0, result.stderr.decode()
    rows = table(result.stdout)
    assert rows[0] == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    server = next(r for r in rows if r[0] == "nodeagent-server")
    replicas = deployment["spec"].get("replicas", 1)
    assert server[1:4] == [f"1/{replicas}", "2", "1"]
    assert server[4].endswith("s")
    wide = table((await kubectl(path, "get", "deploy", "-n", "nodeagent", "-o", "wide")).stdout)
    assert wide[0][-3:] == ["CONTAINERS", "IMAGES", "SELECTOR"]
    # -A adds NAMESPACE from each row's object metadata.
    rows = table((await kubectl(path, "get", "services", "-A")).stdout)
    assert rows[0] == ["NAMESPACE", "NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)",
                       "AGE"]
    assert ["nodeagent", "nodeagent-controller"] == rows[1][:2] or any(
        r[:2] == ["nodeagent", "nodeagent-controller"] for r in rows)
    rows = table((await kubectl(path, "get", "serviceaccounts", "-n", "nodeagent")).stdout)
    assert rows[0] == ["NAME", "AGE"]
    assert sorted(r[0] for r in rows[1:]) == ["nodeagent-agent", "nodeagent-controller",
                                              "nodeagent-server"]
    rows = table((await kubectl(path, "get", "rolebinding", "-n", "nodeagent")).stdout)
    assert rows[0] == ["NAME", "ROLE", "AGE"]
    assert rows[1][:2] == ["nodeagent-controller", "Role/nodeagent-controller"]
    rows = table((await kubectl(path, "get", "pdb", "-n", "nodeagent")).stdout)
    assert rows[0] == ["NAME", "MIN", "AVAILABLE", "MAX", "UNAVAILABLE", "ALLOWED",
                       "DISRUPTIONS", "AGE"]


async def test_get_crd_prints_its_printer_columns(kubeconfig: tuple[FakeKube, Path]) -> None:
    fake, path = kubeconfig
    result = await kubectl(path, "apply", "-f", str(MANIFESTS / "crds.yaml"),
                           "--validate=false")
    assert result.returncode == 0, result.stderr.decode()
    result = await kubectl(path, "apply", "-f", str(MANIFESTS / "examples" /
                                                   "clustertunnel.yaml"), "--validate=false")
    assert result.returncode == 0, result.stderr.decode()
    rows = table((await kubectl(path, "get", "clustertunnels")).stdout)
    assert rows[0] == ["NAME", "SERVER", "NODES", "VERSION", "READY", "AGE"]
    # No status yet: the NODES/VERSION/READY cells are null, which kubectl leaves blank.
    assert rows[1][:2] == ["default", "wss://nodeagent.example.com:8443/tunnel"]
    assert len(rows[1]) == 3 and rows[1][2].endswith("s")
    tunnel = fake.get_object("clustertunnels", "default", group="nodeagent.io")
    assert tunnel is not None
    fake.put_object({**tunnel, "status": {
        "nodesCovered": 4, "nodesConnected": 3, "configVersion": 17,
        "conditions": [
            {"type": "Degraded", "status": "False", "reason": "Fine", "message": "",
             "lastTransitionTime": "2024-01-01T00:00:00Z"},
            {"type": "Ready", "status": "True", "reason": "Serving", "message": "",
             "lastTransitionTime": "2024-01-01T00:00:00Z"}]}})
    rows = table((await kubectl(path, "get", "ct", "default")).stdout)
    assert rows[1][:5] == ["default", "wss://nodeagent.example.com:8443/tunnel", "3", "17",
                           "True"]
    assert rows[1][5].endswith("s")
    # -o wide adds the columns of priority 1.
    rows = table((await kubectl(path, "get", "ct", "-o", "wide")).stdout)
    assert rows[0] == ["NAME", "SERVER", "NODES", "VERSION", "READY", "AGE", "COVERED",
                       "REASON"]
    assert rows[1][:5] == ["default", "wss://nodeagent.example.com:8443/tunnel", "3", "17",
                           "True"] and rows[1][6:] == ["4", "Serving"]
    rows = table((await kubectl(path, "get", "crd")).stdout)
    assert rows[0] == ["NAME", "CREATED", "AT"]
    assert rows[1][0] == "clustertunnels.nodeagent.io" and rows[1][1].endswith("Z")


async def test_apply_with_validation_and_explain_against_the_process(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "nodeagent.testing.fakekube", "--tls", "--token", "t0k",
         "--kubeconfig", str(kubeconfig)], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        with trio.fail_after(10):
            buffer = b""
            while b"\n" not in buffer:
                chunk = await process.stdout.receive_some()
                assert chunk, "fakekube exited before listening"
                buffer += chunk
        url = json.loads(buffer.split(b"\n")[0])["url"]
        result = await kubectl(kubeconfig, "apply", "-k", str(MANIFESTS))  # validation on
        assert result.returncode == 0, result.stderr.decode()
        assert "clustertunnels.nodeagent.io created" in result.stdout.decode()
        assert "daemonset.apps/nodeagent-agent created" in result.stdout.decode()
        async with FakeKubeControl(url) as control:
            writes = [r for r in await control.requests() if r["method"] in ("POST", "PATCH")]
        # kubectl found the fieldValidation parameter in the OpenAPI v3 documents.
        assert writes and {r["query"].get("fieldValidation") for r in writes} == {"Strict"}
        result = await kubectl(kubeconfig, "apply", "-f",
                               str(MANIFESTS / "examples" / "clustertunnel.yaml"))
        assert result.returncode == 0, result.stderr.decode()
        explained = await kubectl(kubeconfig, "explain", "clustertunnels.spec")
        assert explained.returncode == 0, explained.stderr.decode()
        text = explained.stdout.decode()
        assert "KIND:       ClusterTunnel" in text and "VERSION:    v1alpha1" in text
        for field in ("allowedNodePorts", "egress", "intercept", "serverUrl"):
            assert field in text
        explained = await kubectl(kubeconfig, "explain", "deployment.spec.replicas")
        assert explained.returncode == 0, explained.stderr.decode()
        assert "FIELD: replicas <integer>" in explained.stdout.decode()
        missing = await kubectl(kubeconfig, "explain", "clustertunnels.spec.nosuchfield")
        assert missing.returncode != 0
    finally:
        process.terminate()
        with trio.move_on_after(5):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_openapi_v3_documents(kubeconfig: tuple[FakeKube, Path]) -> None:
    fake, _ = kubeconfig
    async with httpx.AsyncClient(base_url=fake.url, verify=False,
                                 headers={"Authorization": "Bearer kubectl-admin"}) as api:
        paths = (await api.get("/openapi/v3")).json()["paths"]
        assert {"api/v1", "apis/apps/v1", "apis/rbac.authorization.k8s.io/v1"} <= set(paths)
        doc = (await api.get(paths["apis/apps/v1"]["serverRelativeURL"])).json()
        patch = doc["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"]
        assert patch["x-kubernetes-group-version-kind"] == {
            "group": "apps", "version": "v1", "kind": "Deployment"}
        assert "fieldValidation" in [p["name"] for p in patch["parameters"]]
        schemas = doc["components"]["schemas"]
        assert "io.k8s.api.core.v1.PodSpec" in schemas  # referenced definitions come along
        for schema in schemas.values():
            assert "$defs" not in json.dumps(schema)
        assert (await api.get("/openapi/v3/apis/nosuch.io/v1")).status_code == 404


async def test_auth_can_i_list(rbac_kubeconfig: tuple[FakeKube, Path]) -> None:
    """`kubectl auth can-i --list` (a SelfSubjectRulesReview): the rules that apply to the
    user in the namespace, cluster-wide ones and the namespace's own."""
    _, path = rbac_kubeconfig
    result = await kubectl(path, "apply", "-k", str(MANIFESTS), "--validate=false")
    assert result.returncode == 0, result.stderr.decode()
    as_controller = "--as=system:serviceaccount:nodeagent:nodeagent-controller"
    listed = await kubectl(path, "auth", "can-i", "--list", "-n", "nodeagent", as_controller)
    assert listed.returncode == 0, listed.stderr.decode()
    rows = {(line.split()[0], line.split()[-1])
            for line in listed.stdout.decode().splitlines()[1:]}
    assert ("tokenreviews.authentication.k8s.io", "[create]") in rows, rows  # cluster-wide
    assert any(r[0] == "leases.coordination.k8s.io" for r in rows), rows  # the namespace's
    elsewhere = await kubectl(path, "auth", "can-i", "--list", "-n", "default",
                              as_controller)
    assert not any(line.startswith("leases.coordination.k8s.io")
                   for line in elsewhere.stdout.decode().splitlines()), elsewhere.stdout
    admin = await kubectl(path, "auth", "can-i", "--list")
    assert admin.returncode == 0 and "*.*" in admin.stdout.decode(), admin.stdout


async def test_strict_field_validation_refuses_unknown_fields_of_a_custom_object(
        kubeconfig: tuple[FakeKube, Path], tmp_path: Path) -> None:
    """As a real API server does for a structural schema: with fieldValidation=Strict
    (kubectl's default when the server declares the parameter, and --validate=strict) an
    unknown field of a ClusterTunnel is a 400 naming it, on create and on apply's patch;
    with --validate=false it is pruned."""
    fake, path = kubeconfig
    result = await kubectl(path, "apply", "-k", str(MANIFESTS))
    assert result.returncode == 0, result.stderr.decode()
    typo = tmp_path / "typo.yaml"
    typo.write_text("apiVersion: nodeagent.io/v1alpha1\nkind: ClusterTunnel\n"
                    "metadata: {name: typo}\n"
                    "spec: {serverUrl: 'wss://t.example.com/tunnel', allowedNodeport: [22],"
                    " intercept: {bogus: 1}}\n")
    message = ('ClusterTunnel in version "v1alpha1" cannot be handled as a ClusterTunnel: '
               'strict decoding error: unknown field "spec.allowedNodeport", unknown field '
               '"spec.intercept.bogus"')
    for args in (("create", "-f", str(typo)), ("apply", "--validate=strict", "-f", str(typo))):
        refused = await kubectl(path, *args)
        assert refused.returncode == 1, refused.stdout.decode()
        assert message in refused.stderr.decode(), refused.stderr.decode()
    assert fake.get_object("clustertunnels", "typo", group="nodeagent.io") is None
    # Without validation the API server prunes what its schema does not declare; a later
    # apply of the typo (a merge patch) is refused the same way.
    pruned = await kubectl(path, "apply", "--validate=false", "-f", str(typo))
    assert pruned.returncode == 0, pruned.stderr.decode()
    stored = fake.get_object("clustertunnels", "typo", group="nodeagent.io")
    assert stored is not None and "allowedNodeport" not in stored["spec"]
    typo.write_text(typo.read_text().replace("[22]", "[2222]"))
    patched = await kubectl(path, "apply", "-f", str(typo))
    assert patched.returncode == 1 and "strict decoding error" in patched.stderr.decode()
