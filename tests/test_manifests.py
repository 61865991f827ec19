"""manifests/ validated offline: each object against the Kubernetes schemas
(kubernetes-validate bundles them), the CRD against the model it is generated from, and the
relations between objects that no schema checks (selectors, ports, accounts, volumes, RBAC,
CLI flags, one image)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from nodeagent.config import ConfigError
from nodeagent.controller.clustertunnel import parse_cluster_tunnel
from nodeagent.controller.crds import crd_manifests
from nodeagent.testing.fakekube import schema as structural

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
K8S_VERSION = "1.33.0"
# Secrets and ConfigMaps the controller creates at start (never in the manifests: they
# hold generated keys).
BOOTSTRAPPED = {("Secret", "nodeagent-ca"), ("Secret", "nodeagent-server-tls"),
                ("ConfigMap", "nodeagent-ca"),
                # Kubernetes publishes the cluster CA in every namespace.
                ("ConfigMap", "kube-root-ca.crt")}
# The CLI contract of controller mode (nodeagent/cli.py implements it).
FLAGS = {
    "agent": {"--node", "--server", "--token-file", "--ca-file", "--controller",
              "--debug-socket", "--metrics-listen", "--keep-rules-on-exit", "--drain-seconds"},
    "server": {"--controller", "--token-file", "--ca-file", "--tunnel-listen", "--tls-cert",
               "--tls-key", "--ingress-http", "--ingress-https", "--server-id",
               "--metrics-listen", "--connect-listen", "--connect-client-ca", "--state-dir",
               "--shutdown-delay", "--ready-grace"},
    "controller": {"--kubeconfig", "--namespace", "--listen", "--identity", "--lease-name",
                   "--metrics-listen", "--tls-name"},
}


def kustomization() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    return doc


def objects() -> list[dict[str, Any]]:
    out = []
    for name in kustomization()["resources"]:
        out += [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]
    return out


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in objects() if o["kind"] == kind]


def workloads() -> list[dict[str, Any]]:
    return [o for o in objects() if o["kind"] in ("Deployment", "DaemonSet")]


def _id(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("obj", objects(), ids=_id)
def test_every_object_is_valid_for_kubernetes(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    files = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization()["resources"]) == files


def test_shipped_crd_is_what_the_model_generates() -> None:
    result = subprocess.run([sys.executable, "-m", "scripts.gen_manifests", "--check"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    shipped = [d for d in yaml.safe_load_all((MANIFESTS / "crds.yaml").read_text()) if d]
    assert shipped == crd_manifests()


def _crd_schema() -> dict[str, Any]:
    (crd,) = crd_manifests()
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_example_cluster_tunnel_passes_the_crd_schema_and_the_model() -> None:
    example = yaml.safe_load((MANIFESTS / "examples" / "clustertunnel.yaml").read_text())
    schema = _crd_schema()
    pruned = structural.prune(example, schema, root=True)
    assert pruned == example, "the schema would drop fields of the example"
    assert structural.validate(example, schema, root=True) == []
    spec = parse_cluster_tunnel(example)
    assert spec.intercept is not None and spec.intercept.rules[0].name == "cloud-services"
    assert spec.cloud_node_selector == {"node-role.kubernetes.io/control-plane": ""}
    assert [str(r) for r in spec.allowed_node_ports] == ["10250", "9100"] or \
        [(r.first, r.last) for r in spec.allowed_node_ports] == [(10250, 10250), (9100, 9100)]


@pytest.mark.parametrize(("spec", "field"), [
    ({"intercept": {"mode": "nat"}}, "spec.intercept.mode"),
    ({"allowedNodePorts": [True]}, "spec.allowedNodePorts[0]"),
    ({"intercept": {"proxy_port": 70000}}, "spec.intercept.proxy_port"),
    ({"egress": [{"protocol": "sctp"}]}, "spec.egress[0].protocol"),
    ({"nodeSelector": {"a": 1}}, "spec.nodeSelector.a"),
])
def test_crd_schema_rejects_invalid_fields(spec: dict[str, Any], field: str) -> None:
    obj = {"apiVersion": "nodeagent.io/v1alpha1", "kind": "ClusterTunnel",
           "metadata": {"name": "bad"}, "spec": spec}
    errors = structural.validate(obj, _crd_schema(), root=True)
    assert any(where == field for where, _, _ in errors), errors


def test_model_rejects_what_the_schema_cannot_express() -> None:
    """Some checks need code (overlapping CIDRs, URL schemes): the controller's parse
    catches them and names the object and field."""
    obj = {"metadata": {"name": "ct"}, "spec": {"serverUrl": "http://x", "intercept": {
        "rules": [{"name": "r", "destinations": ["10.0.0.0/8", "10.1.0.0/16"]}]}}}
    with pytest.raises(ConfigError) as info:
        parse_cluster_tunnel(obj)
    message = str(info.value)
    assert message.startswith("ClusterTunnel ct: spec")
    assert "serverUrl" in message and "overlaps" in message


@pytest.mark.parametrize("workload", workloads(), ids=_id)
def test_selectors_match_their_pod_templates(workload: dict[str, Any]) -> None:
    selector = workload["spec"]["selector"]["matchLabels"]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


def _pod_labels() -> list[dict[str, str]]:
    return [w["spec"]["template"]["metadata"]["labels"] for w in workloads()]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = workload["spec"]["template"]["spec"]["containers"]
    return containers


@pytest.mark.parametrize("service", by_kind("Service"), ids=_id)
def test_services_select_a_workload_and_target_its_ports(service: dict[str, Any]) -> None:
    selector = service["spec"]["selector"]
    matched = [w for w in workloads()
               if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
    assert len(matched) == 1, f"{_id(service)} selects {len(matched)} workloads"
    ports = [p for c in _containers(matched[0]) for p in c.get("ports", [])]
    for port in service["spec"]["ports"]:
        target = port["targetPort"]
        assert any(p.get("name") == target or p["containerPort"] == target for p in ports), \
            f"{_id(service)} targets {target}, not a container port"


def test_pod_disruption_budget_selects_the_server() -> None:
    (pdb,) = by_kind("PodDisruptionBudget")
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert any(selector.items() <= labels.items() for labels in _pod_labels())


def test_two_server_replicas_roll_one_at_a_time_and_keep_their_routes() -> None:
    """High availability is the default: two replicas on different nodes, rolled with a
    surge (never fewer ready than wanted), at most one voluntarily disrupted; the public
    Service spreads each connection (no ClientIP affinity: an agent must reach every
    replica); the last routes go to a writable emptyDir (--state-dir)."""
    (server,) = [w for w in workloads() if w["metadata"]["name"] == "nodeagent-server"]
    spec = server["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    pod = spec["template"]["spec"]
    assert any(c["topologyKey"] == "kubernetes.io/hostname"
               for c in pod["topologySpreadConstraints"])
    (pdb,) = by_kind("PodDisruptionBudget")
    assert 1 <= pdb["spec"]["minAvailable"] < spec["replicas"]
    (service,) = [o for o in by_kind("Service") if o["metadata"]["name"] == "nodeagent-server"]
    assert service["spec"].get("sessionAffinity", "None") == "None"
    (container,) = pod["containers"]
    (state,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--state-dir=")]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in container["volumeMounts"]
                 if state.startswith(m["mountPath"].rstrip("/") + "/"))
    assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly")


@pytest.mark.parametrize("workload", workloads(), ids=_id)
def test_workload_references_exist(workload: dict[str, Any]) -> None:
    pod = workload["spec"]["template"]["spec"]
    accounts = {o["metadata"]["name"] for o in by_kind("ServiceAccount")}
    assert pod["serviceAccountName"] in accounts
    shipped = {(o["kind"], o["metadata"]["name"]) for o in objects()}
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            ref = ("Secret", volume["secret"]["secretName"])
        elif "configMap" in volume:
            ref = ("ConfigMap", volume["configMap"]["name"])
        else:
            continue
        assert ref in shipped or ref in BOOTSTRAPPED, f"{_id(workload)} mounts {ref}"
    mounted = {v["name"] for v in pod.get("volumes", [])}
    for container in pod["containers"]:
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in mounted


@pytest.mark.parametrize("workload", workloads(), ids=_id)
def test_container_args_use_only_the_cli_contract(workload: dict[str, Any]) -> None:
    (container,) = _containers(workload)
    role, *args = container["args"]
    flags = {arg.split("=", 1)[0] for arg in args}
    assert flags <= FLAGS[role], flags - FLAGS[role]
    env = {e["name"] for e in container.get("env", [])}
    for ref in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert ref in env, f"{_id(workload)} uses $({ref}) without that env var"


def test_one_image_for_every_role() -> None:
    images = {c["image"] for w in workloads() for c in _containers(w)}
    assert len(images) == 1
    (image,) = images
    assert image.rsplit(":", 1)[0] == kustomization()["images"][0]["name"]


def test_rbac_bindings_name_existing_roles_and_accounts() -> None:
    roles = {(o["kind"], o["metadata"]["name"]) for o in objects()
             if o["kind"] in ("Role", "ClusterRole")}
    accounts = {(o["metadata"]["namespace"], o["metadata"]["name"])
                for o in by_kind("ServiceAccount")}
    bindings = by_kind("RoleBinding") + by_kind("ClusterRoleBinding")
    assert bindings
    for binding in bindings:
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in roles
        for subject in binding["subjects"]:
            assert (subject["namespace"], subject["name"]) in accounts


def test_agent_and_server_get_no_api_permissions() -> None:
    bound = {s["name"] for b in by_kind("RoleBinding") + by_kind("ClusterRoleBinding")
             for s in b["subjects"]}
    assert bound == {"nodeagent-controller"}
    (agent,) = by_kind("DaemonSet")
    pod = agent["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    projected = [v for v in pod["volumes"] if "projected" in v]
    assert projected[0]["projected"]["sources"][0]["serviceAccountToken"]["audience"] == \
        "nodeagent"
    assert pod["hostNetwork"] is True
    caps = pod["containers"][0]["securityContext"]["capabilities"]["add"]
    assert set(caps) == set(AGENT_CAPABILITIES)
    assert {"operator": "Exists"} in pod["tolerations"]


def test_controller_and_server_run_as_non_root() -> None:
    for workload in by_kind("Deployment"):
        assert workload["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_containerfile_essentials() -> None:
    text = (ROOT / "Containerfile").read_text()
    base = re.search(r"^ARG BASE=(\S+)$", text, re.M)
    assert base and re.search(r":\d+\.\d+\.\d+-slim", base.group(1)), "a pinned default base"
    assert re.findall(r"^FROM (\S+)", text, re.M) == [
        "${BASE}", "scratch", "${BASE}"], "wheel build, the wheels, then the runtime"
    assert "--require-hashes -r requirements.lock" in text, "wheels from the lock"
    assert "--require-hashes -r /wheels/requirements.lock" in text, "installed from the lock"
    assert re.search(r"^USER 65532", text, re.M), "non-root by default"
    assert not re.search(r"^ADD https?://", text, re.M)
    for package in ("nftables", "iptables", "iproute2"):
        assert package in text
    assert 'ENTRYPOINT ["nodeagent"]' in text


# The agent's capabilities, each with the reason; agent.yaml adds exactly these (and lists
# the same reasons next to them). Measured in a network namespace with only NET_ADMIN:
# nft, SO_MARK and IP_TRANSPARENT work; iptables-legacy fails ("can't initialize
# iptables table ... Permission denied") because libiptc opens a SOCK_RAW socket.
AGENT_CAPABILITIES = {
    "NET_ADMIN": "nftables/iptables rules, policy routing, SO_MARK, IP_TRANSPARENT",
    "NET_RAW": "iptables-legacy hosts only: libiptc's SOCK_RAW socket",
}


def _pod_security_context(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"].get("securityContext") or {})


@pytest.mark.parametrize("workload", workloads(), ids=_id)
def test_every_container_runs_with_the_runtime_default_seccomp_profile(
        workload: dict[str, Any]) -> None:
    pod_profile = _pod_security_context(workload).get("seccompProfile")
    pod = workload["spec"]["template"]["spec"]
    for container in pod["containers"] + pod.get("initContainers", []):
        profile = (container.get("securityContext") or {}).get("seccompProfile", pod_profile)
        assert profile == {"type": "RuntimeDefault"}, (_id(workload), container["name"])


@pytest.mark.parametrize("workload", workloads(), ids=_id)
def test_containers_drop_every_capability_and_add_only_the_agents(
        workload: dict[str, Any]) -> None:
    is_agent = workload["metadata"]["labels"]["app.kubernetes.io/component"] == "agent"
    for container in _containers(workload):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert not context.get("privileged")
        caps = context["capabilities"]
        assert caps["drop"] == ["ALL"]
        assert sorted(caps.get("add", [])) == (sorted(AGENT_CAPABILITIES) if is_agent else [])
    if is_agent:
        text = (MANIFESTS / "agent.yaml").read_text()
        for cap in AGENT_CAPABILITIES:  # the reason is written next to the manifest too
            assert re.search(rf"^\s*#\s+{cap}\s+\S", text, re.M), cap


@pytest.mark.parametrize("component", ["controller", "server"])
def test_controller_and_server_meet_the_restricted_pod_security_level(
        component: str) -> None:
    """The `restricted` profile's checks that apply to these pods; only the agent needs
    the namespace's `privileged` level."""
    workload = _workload(component)
    pod = workload["spec"]["template"]["spec"]
    context = _pod_security_context(workload)
    assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert not any("hostPath" in v for v in pod.get("volumes", []))
    for container in _containers(workload):
        assert not (container.get("securityContext") or {}).get("runAsUser")
        assert not any("hostPort" in p for p in container.get("ports", []))


def test_namespace_pod_security_level_admits_the_agent_and_warns_at_restricted() -> None:
    (namespace,) = by_kind("Namespace")
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"
    # Why privileged: what `baseline` forbids and the agent needs.
    agent = _workload("agent")["spec"]["template"]["spec"]
    assert agent["hostNetwork"] is True
    assert any("hostPath" in v for v in agent["volumes"])
    assert "NET_ADMIN" in AGENT_CAPABILITIES  # not in baseline's allowed set
    assert {w["metadata"]["namespace"] for w in workloads()} == {
        namespace["metadata"]["name"]}


def _controller_rules() -> list[tuple[dict[str, Any], str]]:
    return [(rule, o["kind"]) for o in objects() if o["kind"] in ("Role", "ClusterRole")
            and o["metadata"]["name"] == "nodeagent-controller" for rule in o["rules"]]


def test_crd_writes_are_limited_to_nodeagents_own_crds() -> None:
    ours = {m["metadata"]["name"] for m in crd_manifests()}
    crd_rules = [r for r, _ in _controller_rules()
                 if "customresourcedefinitions" in r["resources"]]
    for rule in crd_rules:
        if set(rule["verbs"]) & {"get", "update", "patch", "delete", "*"}:
            assert set(rule.get("resourceNames", [])) == ours, rule
    # create cannot carry resourceNames (the API would never match it); it is the only
    # unrestricted CRD verb.
    unrestricted = {v for r in crd_rules if not r.get("resourceNames") for v in r["verbs"]}
    assert unrestricted == {"create"}


def test_secret_rbac_documents_the_controllers_field_selector() -> None:
    """The ClusterRole cannot enforce the informer's field selector; rbac.yaml must name
    the selector the controller really uses, and nothing but the servers' certificate may
    be updated."""
    from nodeagent.controller.controller import SECRET_FIELD_SELECTOR
    from nodeagent.kube.client import selector_string

    selector = selector_string(SECRET_FIELD_SELECTOR)
    assert selector == "type=kubernetes.io/tls"
    text = (MANIFESTS / "rbac.yaml").read_text()
    assert f"`{selector}`" in text
    assert "RBAC has no conditions on" in text
    secret_rules = [(r, kind) for r, kind in _controller_rules() if "secrets" in r["resources"]]
    cluster_verbs = {v for r, kind in secret_rules if kind == "ClusterRole" for v in r["verbs"]}
    assert cluster_verbs <= {"get", "list", "watch"}
    writes = [r for r, _ in secret_rules
              if set(r["verbs"]) & {"update", "patch", "delete", "deletecollection", "*"}]
    assert [(r.get("resourceNames"), sorted(r["verbs"])) for r in writes] == [
        (["nodeagent-server-tls"], ["update"])]


def _workload(component: str) -> dict[str, Any]:
    (workload,) = [w for w in workloads()
                   if w["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return workload


def _args(workload: dict[str, Any]) -> dict[str, str]:
    (container,) = _containers(workload)
    return dict(a.split("=", 1) for a in container["args"][1:] if "=" in a)


def _mounted_file(workload: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume that provides `path` in the workload's container."""
    (container,) = _containers(workload)
    pod = workload["spec"]["template"]["spec"]
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            return dict(volume)
    raise AssertionError(f"{_id(workload)}: nothing mounted at {path}")


@pytest.mark.parametrize(("component", "account"), [("agent", "nodeagent-agent"),
                                                    ("server", "nodeagent-server")])
def test_agent_and_server_prove_their_pod_with_a_projected_token_and_trust_the_ca(
        component: str, account: str) -> None:
    """What the controller's signing endpoint expects: a projected token of audience
    nodeagent from the ServiceAccount it checks (SigningPolicy's defaults), no shared
    token Secret, and the CA ConfigMap to verify the controller's TLS stream with."""
    from nodeagent.controller.signing import AUDIENCE, SigningPolicy

    workload = _workload(component)
    pod = workload["spec"]["template"]["spec"]
    policy = SigningPolicy(namespace=workload["metadata"]["namespace"])
    assert pod["serviceAccountName"] == account
    kind = {"agent": "node", "server": "server"}[component]
    assert policy.username(kind) == f"system:serviceaccount:nodeagent:{account}"
    args = _args(workload)
    token = _mounted_file(workload, args["--token-file"])
    (source,) = token["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == AUDIENCE
    assert args["--token-file"].endswith("/" + source["serviceAccountToken"]["path"])
    assert _mounted_file(workload, args["--ca-file"])["configMap"]["name"] == "nodeagent-ca"
    assert args["--ca-file"].endswith("/ca.crt")
    assert args["--controller"].startswith("https://nodeagent-controller.nodeagent.svc:")
    assert not any("secret" in v and v["secret"]["secretName"] == "nodeagent-agent-token"
                   for v in pod["volumes"])


def test_controller_can_read_pods_and_review_tokens() -> None:
    rules = [(rule, o) for o in objects() if o["kind"] in ("Role", "ClusterRole")
             and o["metadata"]["name"] == "nodeagent-controller" for rule in o["rules"]]

    def allowed(resource: str, verb: str, namespaced_ok: bool = True) -> bool:
        return any(resource in r["resources"] and verb in r["verbs"] and
                   (namespaced_ok or o["kind"] == "ClusterRole") for r, o in rules)

    assert allowed("tokenreviews", "create", namespaced_ok=False)
    assert allowed("pods", "get")
    (service,) = [s for s in by_kind("Service")
                  if s["metadata"]["name"] == "nodeagent-controller"]
    (port,) = service["spec"]["ports"]
    assert port["appProtocol"] == "https"
    controller_port = int(_args(_workload("agent"))["--controller"].rsplit(":", 1)[1])
    assert port["port"] == controller_port


CONTROLPLANE = MANIFESTS / "controlplane"


def controlplane_objects() -> list[dict[str, Any]]:
    doc = yaml.safe_load((CONTROLPLANE / "kustomization.yaml").read_text())
    out = []
    for name in doc["resources"]:
        out += [d for d in yaml.safe_load_all((CONTROLPLANE / name).read_text()) if d]
    return out


def test_the_control_plane_server_variant_serves_the_egress_selectors_socket() -> None:
    """manifests/controlplane/: a server DaemonSet on control-plane hosts whose CONNECT
    front listens on the Unix socket egress-selector.yaml names, in a host directory; valid
    for Kubernetes, using only what manifests/ ships, flags the real CLI accepts."""
    from nodeagent.cli import build_parser
    from nodeagent.server.main import server_config_from_flags

    (daemonset,) = controlplane_objects()
    kubernetes_validate.validate(daemonset, K8S_VERSION, strict=True)
    assert daemonset["kind"] == "DaemonSet"
    pod = daemonset["spec"]["template"]["spec"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Its pods are servers for the base Service (agents' tunnels reach them) and the PDB.
    (public,) = [s for s in by_kind("Service") if s["metadata"]["name"] == "nodeagent-server"]
    assert public["spec"]["selector"].items() <= labels.items()
    assert pod["nodeSelector"] == {"node-role.kubernetes.io/control-plane": ""}
    # Account, Secrets, ConfigMaps: the base install's; one image.
    assert pod["serviceAccountName"] in {o["metadata"]["name"]
                                         for o in by_kind("ServiceAccount")}
    shipped = {(o["kind"], o["metadata"]["name"]) for o in objects()}
    for volume in pod["volumes"]:
        for kind, key, name in (("Secret", "secret", "secretName"),
                                ("ConfigMap", "configMap", "name")):
            if key in volume:
                ref = (kind, volume[key][name])
                assert ref in shipped or ref in BOOTSTRAPPED, ref
    (container,) = pod["containers"]
    base_images = {c["image"] for w in workloads() for c in _containers(w)}
    assert {container["image"]} == base_images
    # The CLI takes exactly these flags, and they make a server with the socket front.
    args = [a.replace("$(POD_NAME)", "nodeagent-server-uds-x") for a in container["args"]]
    config = server_config_from_flags(build_parser().parse_args(args))
    assert config.connect.uds is not None and config.connect.listen is None
    assert config.connect.uds_mode == 0o600
    # The socket lies in a hostPath directory, the one egress-selector.yaml names.
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in container["volumeMounts"]
                if str(config.connect.uds).startswith(m["mountPath"] + "/")]
    assert volumes[mount["name"]]["hostPath"]["path"] == mount["mountPath"]
    selector = yaml.safe_load((CONTROLPLANE / "egress-selector.yaml").read_text())
    assert selector["kind"] == "EgressSelectorConfiguration"
    (cluster,) = selector["egressSelections"]
    assert cluster["name"] == "cluster"
    assert cluster["connection"]["proxyProtocol"] == "HTTPConnect"
    assert cluster["connection"]["transport"]["uds"]["udsName"] == str(config.connect.uds)
    # Root for the root-owned host directory, but nothing more.
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_a_udp_cluster_tunnel_passes_the_crd_schema_and_the_model() -> None:
    """Kubernetes' spelling (protocol: UDP), DNS by zone, udp egress: what the API server
    accepts is what the controller parses."""
    tunnel = {"apiVersion": "nodeagent.io/v1alpha1", "kind": "ClusterTunnel",
              "metadata": {"name": "dns"},
              "spec": {"egress": [{"cidr": "10.200.0.10/32", "ports": ["53"],
                                   "protocol": "UDP"},
                                  {"cidr": "10.200.0.0/24", "protocol": "udp"}],
                       "intercept": {"mode": "tproxy", "rules": [{
                           "name": "cloud-dns", "protocol": "UDP",
                           "destinations": ["10.96.0.10/32"], "ports": [53],
                           "dns_zones": ["svc.cloud.internal"],
                           "dns_resolver": "10.200.0.10:53"}]}}}
    schema = _crd_schema()
    assert structural.prune(tunnel, schema, root=True) == tunnel
    assert structural.validate(tunnel, schema, root=True) == []
    spec = parse_cluster_tunnel(tunnel)
    assert spec.intercept is not None
    assert spec.intercept.rules[0].protocol == "udp"
    assert spec.egress[0].protocol == "udp" and spec.egress[1].protocol == "udp"
