"""What the client knows about a resource type: where it lives in the API and its kind.

A `Resource` turns (namespace, name, subresource) into a URL path. The constants are the
types nodeagent uses; `custom_resource()` describes nodeagent's own CRDs (group nodeagent.io).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

NODEAGENT_GROUP = "nodeagent.io"
NODEAGENT_VERSION = "v1alpha1"


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core ("legacy") group
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        """The `apiVersion` field of objects of this type: `v1` or `group/version`."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def qualified_name(self) -> str:
        """`plural.group`, as in RBAC rules and CRD names (`ingresses.networking.k8s.io`)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """The URL path; without namespace, a namespaced type is listed across all namespaces."""
        prefix = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        parts = [prefix]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{quote(namespace, safe='')}")
        elif not self.namespaced and namespace:
            raise ValueError(f"{self.qualified_name} is cluster-scoped, got {namespace=}")
        parts.append(self.plural)
        if name is not None:
            if not name:
                raise ValueError("empty object name")
            parts.append(quote(name, safe=""))
            if subresource:
                parts.append(subresource)
        elif subresource:
            raise ValueError("a subresource needs an object name")
        return "/".join(parts)

    def __str__(self) -> str:
        return self.qualified_name


def custom_resource(
    plural: str,
    kind: str,
    *,
    namespaced: bool,
    group: str = NODEAGENT_GROUP,
    version: str = NODEAGENT_VERSION,
) -> Resource:
    """A custom resource type; defaults to nodeagent's CRD group and version."""
    return Resource(group, version, plural, kind, namespaced)


NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
NODES = Resource("", "v1", "nodes", "Node", namespaced=False)
PODS = Resource("", "v1", "pods", "Pod", namespaced=True)
SERVICES = Resource("", "v1", "services", "Service", namespaced=True)
SECRETS = Resource("", "v1", "secrets", "Secret", namespaced=True)
CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap", namespaced=True)
EVENTS = Resource("", "v1", "events", "Event", namespaced=True)
ENDPOINTSLICES = Resource(
    "discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", namespaced=True
)
INGRESSES = Resource("networking.k8s.io", "v1", "ingresses", "Ingress", namespaced=True)
INGRESSCLASSES = Resource(
    "networking.k8s.io", "v1", "ingressclasses", "IngressClass", namespaced=False
)
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease", namespaced=True)
TOKENREVIEWS = Resource(
    "authentication.k8s.io", "v1", "tokenreviews", "TokenReview", namespaced=False
)
CUSTOMRESOURCEDEFINITIONS = Resource(
    "apiextensions.k8s.io",
    "v1",
    "customresourcedefinitions",
    "CustomResourceDefinition",
    namespaced=False,
)
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment", namespaced=True)
STATEFULSETS = Resource("apps", "v1", "statefulsets", "StatefulSet", namespaced=True)
REPLICASETS = Resource("apps", "v1", "replicasets", "ReplicaSet", namespaced=True)
