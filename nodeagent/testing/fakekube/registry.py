"""The resource types the fake API server serves: built-ins and CRD-registered ones.

Only the types nodeagent and its tests use. Not served, unlike a real cluster: core v1
Endpoints and events.k8s.io (`kubectl describe` reads core v1 Events, by involvedObject
field selectors, which are served). Nothing fills in workload status: there is no kubelet
and no Deployment controller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COMMON_FIELDS = frozenset({"metadata.name", "metadata.namespace"})


@dataclass
class ResourceType:
    group: str
    versions: tuple[str, ...]  # served versions, preferred first
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    status: bool = False  # has a status subresource
    status_on_create: bool = False  # create keeps .status (Nodes do; most types reset it)
    fields: frozenset[str] = frozenset()  # field selectors beyond metadata.name/namespace
    custom: bool = False  # defined by a CRD
    verbs: frozenset[str] = frozenset(
        {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"})
    stored: bool = True  # tokenreviews are not
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # version → openAPIV3Schema
    # version → additionalPrinterColumns (CRD versions that declare them)
    printer_columns: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def qualified(self) -> str:
        """`plural.group` as in API messages (`leases.coordination.k8s.io`)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def api_version(self, version: str | None = None) -> str:
        v = version or self.versions[0]
        return f"{self.group}/{v}" if self.group else v

    def supports_field(self, path: str) -> bool:
        return path in COMMON_FIELDS or path in self.fields

    def discovery(self) -> dict[str, Any]:
        return {"name": self.plural, "singularName": self.singular or self.kind.lower(),
                "namespaced": self.namespaced, "kind": self.kind,
                "verbs": sorted(self.verbs), "shortNames": list(self.short_names)}


def _t(group: str, version: str, plural: str, kind: str, namespaced: bool, **kw: Any
       ) -> ResourceType:
    return ResourceType(group, (version,), plural, kind, namespaced, **kw)


_EVENT_FIELDS = frozenset(
    {f"involvedObject.{f}" for f in ("kind", "namespace", "name", "uid", "apiVersion",
                                     "resourceVersion", "fieldPath")}
    | {"reason", "reportingComponent", "source", "type"})


RBAC = "rbac.authorization.k8s.io"
AUTHZ = "authorization.k8s.io"


def builtin_types() -> list[ResourceType]:
    return [
        _t("", "v1", "namespaces", "Namespace", False, status=True, short_names=("ns",),
           fields=frozenset({"status.phase"})),
        _t("", "v1", "nodes", "Node", False, status=True, status_on_create=True,
           short_names=("no",), fields=frozenset({"spec.unschedulable"})),
        _t("", "v1", "pods", "Pod", True, status=True, short_names=("po",),
           fields=frozenset({"spec.nodeName", "spec.serviceAccountName", "status.phase",
                             "status.podIP", "spec.restartPolicy", "spec.schedulerName",
                             "status.nominatedNodeName", "spec.hostNetwork"})),
        _t("", "v1", "services", "Service", True, status=True, short_names=("svc",),
           fields=frozenset({"spec.clusterIP", "spec.type"})),
        _t("", "v1", "secrets", "Secret", True, fields=frozenset({"type"})),
        _t("", "v1", "configmaps", "ConfigMap", True, short_names=("cm",)),
        _t("", "v1", "serviceaccounts", "ServiceAccount", True, short_names=("sa",)),
        _t("", "v1", "events", "Event", True, short_names=("ev",), fields=_EVENT_FIELDS),
        _t("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", True),
        _t("networking.k8s.io", "v1", "ingresses", "Ingress", True, status=True,
           short_names=("ing",)),
        _t("networking.k8s.io", "v1", "ingressclasses", "IngressClass", False),
        _t("coordination.k8s.io", "v1", "leases", "Lease", True),
        _t("apps", "v1", "deployments", "Deployment", True, status=True,
           short_names=("deploy",)),
        _t("apps", "v1", "daemonsets", "DaemonSet", True, status=True, short_names=("ds",)),
        _t("apps", "v1", "statefulsets", "StatefulSet", True, status=True,
           short_names=("sts",)),
        _t("apps", "v1", "replicasets", "ReplicaSet", True, status=True,
           short_names=("rs",)),
        _t("authentication.k8s.io", "v1", "tokenreviews", "TokenReview", False,
           verbs=frozenset({"create"}), stored=False),
        _t("apiextensions.k8s.io", "v1", "customresourcedefinitions",
           "CustomResourceDefinition", False, status=True, short_names=("crd", "crds")),
        _t("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, status=True,
           short_names=("pdb",)),
        _t(RBAC, "v1", "roles", "Role", True),
        _t(RBAC, "v1", "clusterroles", "ClusterRole", False),
        _t(RBAC, "v1", "rolebindings", "RoleBinding", True),
        _t(RBAC, "v1", "clusterrolebindings", "ClusterRoleBinding", False),
        _t(AUTHZ, "v1", "selfsubjectaccessreviews", "SelfSubjectAccessReview", False,
           verbs=frozenset({"create"}), stored=False),
        _t(AUTHZ, "v1", "selfsubjectrulesreviews", "SelfSubjectRulesReview", False,
           verbs=frozenset({"create"}), stored=False),
        _t(AUTHZ, "v1", "subjectaccessreviews", "SubjectAccessReview", False,
           verbs=frozenset({"create"}), stored=False),
        _t(AUTHZ, "v1", "localsubjectaccessreviews", "LocalSubjectAccessReview", True,
           verbs=frozenset({"create"}), stored=False),
    ]


def type_from_crd(crd: dict[str, Any]) -> ResourceType:
    """The ResourceType a CustomResourceDefinition declares (served versions only)."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    versions = [v for v in spec.get("versions") or [] if v.get("served", True)]
    # The storage version is preferred in discovery; keep the declared order otherwise.
    versions.sort(key=lambda v: not v.get("storage", False))
    return ResourceType(
        group=spec["group"],
        versions=tuple(v["name"] for v in versions),
        plural=names["plural"],
        kind=names["kind"],
        namespaced=spec.get("scope", "Namespaced") == "Namespaced",
        singular=names.get("singular", ""),
        short_names=tuple(names.get("shortNames") or ()),
        status=any("status" in (v.get("subresources") or {}) for v in versions),
        custom=True,
        schemas={v["name"]: (v.get("schema") or {}).get("openAPIV3Schema") or {}
                 for v in versions},
        printer_columns={v["name"]: list(v["additionalPrinterColumns"]) for v in versions
                         if v.get("additionalPrinterColumns") is not None},
    )
