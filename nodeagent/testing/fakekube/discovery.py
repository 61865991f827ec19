"""Discovery documents: /version, /api, /apis, /apis/<group> and each group version's
resource list, built from the types the store serves (CRDs appear once established)."""

from __future__ import annotations

from collections.abc import Iterable

from nodeagent.testing.fakekube import scale
from nodeagent.testing.fakekube.errors import no_such_resource
from nodeagent.testing.fakekube.objects import Obj
from nodeagent.testing.fakekube.registry import ResourceType
from nodeagent.testing.fakekube.scale import has_scale

SERVER_VERSION = {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fakekube",
                  "platform": "linux/amd64", "goVersion": "go1.22"}


def api_versions(server_address: str) -> Obj:
    """/api: the core group's versions."""
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                            "serverAddress": server_address}]}


def group_list(types: Iterable[ResourceType]) -> Obj:
    types = list(types)
    groups: dict[str, list[str]] = {}
    for rt in types:
        if rt.group:
            versions = groups.setdefault(rt.group, [])
            versions.extend(v for v in rt.versions if v not in versions)
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [group(types, g) for g in sorted(groups)]}


def group(types: Iterable[ResourceType], name: str) -> Obj | None:
    versions: list[str] = []
    for rt in types:
        if rt.group == name:
            versions.extend(v for v in rt.versions if v not in versions)
    if not versions:
        return None
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"kind": "APIGroup", "apiVersion": "v1", "name": name, "versions": entries,
            "preferredVersion": entries[0]}


def resource_list(types: Iterable[ResourceType], group: str, version: str) -> Obj:
    resources = []
    for rt in types:
        if rt.group == group and version in rt.versions:
            resources.append(rt.discovery())
            if rt.status:
                resources.append({"name": f"{rt.plural}/status", "singularName": "",
                                  "namespaced": rt.namespaced, "kind": rt.kind,
                                  "verbs": ["get", "patch", "update"]})
            if has_scale(rt):
                resources.append(scale.discovery_entry(rt))
    if not resources:
        raise no_such_resource()
    return {"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources}
